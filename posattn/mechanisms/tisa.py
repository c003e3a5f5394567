"""Translation-invariant self-attention, TISA (Wennberg & Henter 2021, Eq 4-5).

    s_ij += f_θ(j − i),   f_θ(r) = Σ_{s=1}^{S} a_s exp(−|b_s| (r − c_s)²)       (Eq 5)

one f per head and layer (3·S·H·L positional parameters, Table 2). The function is
tabulated once per forward over the offsets of the input (never evaluated per score).

Modes (Eq 4): ``replace`` (TISA alone, no position embedding at the input: case b) and
``supplement`` (F_P added on top of input position embeddings: case a), which therefore
requires an input position mechanism (``absolute`` or ``sinusoidal``) in the same model.
Initialisation (ours; the paper initialises from a pretrained model, see posattn.analysis):
a ~ N(0, 0.5²), |b| = 0.5, centres c spread over −(S−1)/2 … (S−1)/2.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from ..attention.terms import Term, Toeplitz
from ..errors import PositionError
from .base import Context, Dims, Mechanism, offsets
from .registry import REGISTRY, register


def tisa_function(r: Tensor, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """f(r) for offsets r [m] and kernel parameters [h, S] -> [h, m] (TISA Eq 5)."""
    d = r.to(a.dtype)[None, None, :] - c[..., None]
    return (a[..., None] * torch.exp(-b.abs()[..., None] * d * d)).sum(-2)


def tisa_window(r: Tensor, b: Tensor, c: Tensor) -> int | None:
    """The largest |r| at which some Gaussian exp(−|b|(r − c)²) is not exactly 0 in floating
    point, or None if none underflows. Beyond it f_θ and all its gradients are exactly 0, so the
    table is clipped there (a ``window`` the fast path exploits). Inside ``torch.compile`` None:
    the window is a shape read from the parameters, a host sync that would split a compiled step,
    and the unclipped table holds the same values."""
    if torch.compiler.is_compiling():
        return None
    with torch.no_grad():
        d = r.to(b.dtype)[None, None, :] - c[..., None]
        live = (torch.exp(-b.abs()[..., None] * d * d) != 0).flatten(0, 1).any(0)
        w = int(r.abs().masked_fill(~live, 0).max())
    return None if w >= int(r.max()) else w


@register("tisa")
class TISA(Mechanism):
    """Translation-invariant self-attention (Wennberg & Henter 2021, Eq 4-5): s_ij += f_θ(j − i),
    f_θ(r) = Σ_s a_s exp(−|b_s|(r − c_s)²), one function per head and layer.

    Options:
        n_kernels: S, the Gaussian kernels per head.
        mode: "replace" (TISA alone, no input position embedding: Eq 4 case b) or
            "supplement" (on top of ``absolute`` or ``sinusoidal`` in the same model: case a)."""

    paper = "Wennberg & Henter 2021 (TISA), Eq 4-5"
    equation = "s_ij += Σ_s a_s exp(−|b_s|(j−i−c_s)²)"
    acts_on = ("score",)
    cost_class = "learned_table"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], n_kernels: int = 5,
                 mode: Literal["replace", "supplement"] = "replace") -> None:
        super().__init__(dims, shared)
        if n_kernels < 1:
            raise PositionError(f"tisa: n_kernels must be >= 1, got {n_kernels}")
        self.mode = mode
        h, s = dims.n_heads, n_kernels
        self.a = nn.Parameter(torch.randn(h, s) * 0.5)
        self.b = nn.Parameter(torch.full((h, s), 0.5))
        self.c = nn.Parameter(torch.linspace(-(s - 1) / 2, (s - 1) / 2, s).repeat(h, 1))

    @classmethod
    def validate(cls, options: dict, others: list[str], dims: Dims) -> None:
        mode = options.get("mode", "replace")
        if mode not in ("replace", "supplement"):
            raise PositionError(f"tisa: unknown mode {mode!r}; valid: replace, supplement")
        inputs = [o for o in others if "input positions" in REGISTRY[o].claims]
        if mode == "replace" and inputs:
            raise PositionError(f"tisa: mode='replace' takes the place of input position embeddings, "
                                f"but {inputs[0]!r} is also present; use mode='supplement' or drop it")
        if mode == "supplement" and not inputs:
            raise PositionError("tisa: mode='supplement' adds to input position embeddings; "
                                "add 'absolute' or 'sinusoidal', or use mode='replace'")

    @classmethod
    def retrofit_options(cls, options: dict, keeps_input_positions: bool) -> dict:
        """Eq 4's case a (``supplement``) where the pretrained model keeps its position embeddings,
        case b (``replace``) where they are removed."""
        mode = "supplement" if keeps_input_positions else "replace"
        if options.get("mode", mode) != mode:
            raise PositionError(f"tisa: mode {options['mode']!r} disagrees with the retrofit mode {mode!r}")
        return {**options, "mode": mode}

    def start_at_zero(self) -> bool:
        """a = 0: f_θ ≡ 0 while b, c and a itself still train."""
        with torch.no_grad():
            self.a.zero_()
        return True

    def set_kernels(self, kernels: dict) -> bool:
        """a, b, c [h, S] of this layer from a fit (TISA App. C initialisation)."""
        values = {name: torch.as_tensor(kernels[name]) for name in ("a", "b", "c")}
        for name, value in values.items():
            if value.shape != self.a.shape:
                raise self.fail(f"the fitted {name} has shape {tuple(value.shape)} (heads, kernels); "
                                f"this layer needs {tuple(self.a.shape)}")
        with torch.no_grad():
            for name, value in values.items():
                getattr(self, name).copy_(value)
        return True

    def table(self, n: int) -> Tensor:
        """[h, 2n−1]: f_θ at every offset −(n−1) … n−1."""
        return tisa_function(offsets(n, self.a.device), self.a, self.b, self.c)

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        window = tisa_window(offsets(ctx.n, self.a.device), self.b, self.c)
        return [Toeplitz(self.table(ctx.n).to(q.dtype), window=window)]
