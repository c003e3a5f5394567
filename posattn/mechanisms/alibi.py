"""ALiBi (Press et al. 2022): a fixed linear distance penalty per head.

    s_ij += −m_h · |j − i|,  m_h = 2^{−8h/H} (geometric; the paper's rule for H not a power of 2)

Under a causal mask −m_h(i − j) = m_h·j − m_h·i, and the −m_h·i part is constant per row, so
the term is declared with an equivalent rank-1 ``causal_form`` (u_i = m_h, v_j = j).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..attention.terms import LowRank, Term, Toeplitz
from .base import Context, Dims, Mechanism, offsets
from .registry import register


def alibi_slopes(h: int) -> Tensor:
    """Press et al. 2022 §3: 2^{-8/H·(1..H)}, interleaving for non-powers of two."""
    def pow2(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(h).is_integer():
        return torch.tensor(pow2(h))
    p = 2 ** math.floor(math.log2(h))
    return torch.tensor(pow2(p) + pow2(2 * p)[0::2][: h - p])


@register("alibi")
class ALiBi(Mechanism):
    paper = "Press et al. 2022 (ALiBi)"
    equation = "s_ij += −m_h·|j−i|"
    acts_on = ("score",)
    cost_class = "fixed_bias"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module]) -> None:
        super().__init__(dims, shared)
        self.register_buffer("slopes", alibi_slopes(dims.n_heads), persistent=False)

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        n = ctx.n
        table = -self.slopes[:, None] * offsets(n, q.device).abs()
        pos = torch.arange(n, device=q.device, dtype=q.dtype)
        causal = LowRank(u=self.slopes.to(q.dtype)[None, :, None, None].expand(1, -1, n, 1),
                         v=pos[None, None, :, None])
        return [Toeplitz(table.to(q.dtype), causal_form=causal)]
