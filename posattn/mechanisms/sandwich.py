"""Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens of
Receptive Field Analysis"): a fixed bias from the inner product of sinusoidal position
embeddings p of d' dimensions (Vaswani et al. §3.5), shifted to 0 at distance 0 and scaled per
head as ALiBi's slopes are:

    s_ij += (p_i · p_j − d'/2) / (8h/H),   h = 1 … H
    p_i · p_j = Σ_{k=0}^{d'/2−1} cos((i − j) · ω_k),   ω_k = 10000^{−2k/d'}

since sin a sin b + cos a cos b = cos(a − b). It depends on i − j alone (a fixed Toeplitz table,
even in i − j, so the same in an encoder as in the paper's decoders): 0 at distance 0, falling
with distance at first like ALiBi's penalty, then levelling off near −(d'/2)/(8h/H) as the
cosines average out, with small oscillations.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..attention.terms import Term, Toeplitz
from ..errors import PositionError
from .base import Context, Dims, Mechanism, offsets
from .registry import register


def sandwich_table(n: int, dim: int, n_heads: int, base: float = 10000.0) -> Tensor:
    """[H, 2n − 1] float64: the Sandwich bias at every offset of an n-token input."""
    r = offsets(n).double()
    omega = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # ω_k, k = 0 … d'/2 − 1
    dot = torch.cos(r[:, None] * omega[None, :]).sum(-1)  # p_i · p_j at r = j − i
    scale = 8.0 * torch.arange(1, n_heads + 1, dtype=torch.float64) / n_heads
    return (dot[None, :] - dim / 2) / scale[:, None]


@register("sandwich")
class Sandwich(Mechanism):
    """Sandwich: the bias is the inner product of d'-dimensional sinusoidal position embeddings,
    shifted and scaled per head (Chi et al. 2023: (p_i·p_j − d'/2)/(8h/H)); no parameters.

    Options:
        dim: d', the width of the sinusoidal embeddings whose inner product is the bias (even;
            larger d' adds slower frequencies, so the bias keeps decaying further out).
    """

    paper = "Chi et al. 2023 (Sandwich)"
    equation = "s_ij += (p_i·p_j − d'/2)/(8h/H)"
    acts_on = ("score",)
    cost_class = "fixed_bias"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], dim: int = 128) -> None:
        super().__init__(dims, shared)
        if not isinstance(dim, int) or dim < 2 or dim % 2:
            raise PositionError(f"sandwich: dim (d') must be an even integer >= 2, got {dim!r}")
        self.dim = dim

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        n = ctx.n
        table = ctx.cached(("sandwich", self.dim, n, q.dtype, q.device),  # one table for every layer
                           lambda: sandwich_table(n, self.dim, self.dims.n_heads).to(q.device, q.dtype))
        return [Toeplitz(table)]
