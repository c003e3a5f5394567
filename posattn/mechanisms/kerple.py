"""KERPLE (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding for Length
Extrapolation"): a conditionally positive definite kernel of the distance, shifted
into a score bias, with two learned parameters per head.

    log:    s_ij += −r₁ · log(1 + r₂ · |i − j|)
    power:  s_ij += −r₁ · |i − j|^{r₂},   0 < r₂ ≤ 2

r₁, r₂ > 0 per head and layer. Positivity (and r₂ ≤ 2 for the power kernel) is kept by clamping,
as the authors' code does (at 1e-2): here in the forward, so a parameter past a bound holds
there and gets no gradient until the optimiser's other updates move it back. Initialised
uniformly, r₁ ∈ (0, 2) and r₂ ∈ (0, 1) for the log kernel, r₁ ∈ (0, 1) and r₂ ∈ (0, 2) for the
power kernel. The bias is a learned Toeplitz table over the offsets of the input, symmetric in
an encoder (the paper's models are decoders, where only the past half is used).
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from ..attention.terms import Term, Toeplitz
from ..errors import PositionError
from .base import Context, Dims, Mechanism, offsets
from .registry import register

KERNELS = ("log", "power")
EPS = 1e-2  # the lower bound of r₁ and r₂ (the authors' clamp)
MAX_POWER = 2.0  # r₂ ≤ 2 keeps −|r|^{r₂} conditionally positive definite


def kerple_table(distance: Tensor, r1: Tensor, r2: Tensor, kernel: str) -> Tensor:
    """The bias [h, m] at distances |i − j| ``distance`` [m] for the clamped per-head r₁, r₂ [h]."""
    d = distance.to(r1.dtype)[None, :]
    r1, r2 = r1[:, None], r2[:, None]
    if kernel == "log":
        return -r1 * torch.log1p(r2 * d)
    # |r|^{r₂} as exp(r₂·log|r|), with 0 at r = 0 (where the gradient in r₂ would be 0·log 0)
    power = torch.exp(r2 * torch.log(d.clamp(min=1)))
    return -r1 * torch.where(d == 0, torch.zeros_like(power), power)


@register("kerple")
class KERPLE(Mechanism):
    """KERPLE: a conditionally positive definite kernel of the distance as the bias, r₁, r₂ > 0
    learned per head (Chi et al. 2022; kept positive by clamping at 1e-2).

    Options:
        kernel: log (−r₁·log(1 + r₂·abs(i−j)), the variant the paper recommends) or power
            (−r₁·abs(i−j)^r₂ with 0 < r₂ ≤ 2).
    """

    paper = "Chi et al. 2022 (KERPLE)"
    equation = "s_ij += −r₁·log(1 + r₂|i−j|)  (or −r₁|i−j|^r₂)"
    acts_on = ("score",)
    cost_class = "learned_table"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], kernel: Literal["log", "power"] = "log") -> None:
        super().__init__(dims, shared)
        if kernel not in KERNELS:
            raise PositionError(f"kerple: unknown kernel {kernel!r}; valid: {', '.join(KERNELS)}")
        self.kernel = kernel
        h = dims.n_heads
        scale1, scale2 = (2.0, 1.0) if kernel == "log" else (1.0, 2.0)
        self.r1 = nn.Parameter(torch.rand(h) * scale1)
        self.r2 = nn.Parameter(torch.rand(h) * scale2)

    def parameters_in_range(self) -> tuple[Tensor, Tensor]:
        """r₁, r₂ [h] as used: clamped to their ranges."""
        r2 = self.r2.clamp(EPS, MAX_POWER) if self.kernel == "power" else self.r2.clamp(min=EPS)
        return self.r1.clamp(min=EPS), r2

    def table(self, n: int) -> Tensor:
        """[h, 2n − 1]: the bias at every offset r = j − i of an n-token input."""
        r1, r2 = self.parameters_in_range()
        return kerple_table(offsets(n, r1.device).abs(), r1, r2, self.kernel)

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        table = ctx.cached(("kerple", id(self)), lambda: self.table(ctx.n))
        return [Toeplitz(table.to(q.dtype))]
