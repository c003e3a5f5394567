"""DIET (Chen et al. 2021): position added per head directly to the attention scores.

- ``diet_abs`` (Eq 1): s_ij += (P_Q P_Kᵀ)_ij, P_Q, P_K ∈ R^{n×d_p} (rank d_p, default d_h),
  rows taken at the input's position ids.
  Sharing (§3.1/§4): ``none`` (own P per layer and head), ``head`` (one P per layer, shared by
  its heads), ``layer`` (one P per head, shared by all layers). The score rank can exceed d_h
  (Theorem 1). The term is low rank, so the fast path folds it into q/k.
- ``diet_rel`` (Eq 3): s_ij += R_h[j − i], one scalar per head and offset with no log binning
  (offsets beyond ±max_distance clipped to the edge). The paper writes R_{i−j}; indexing by
  j − i is the same family.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from ..attention.terms import LowRank, Term, Toeplitz
from ..errors import PositionError
from .base import Context, Dims, Mechanism, Structure, max_len_check, offsets
from .registry import register

Sharing = Literal["none", "head", "layer"]


@register("diet_abs")
class DietAbs(Mechanism):
    """DIET-ABS (Chen et al. 2021, Eq 1): a per-head low-rank position term in the scores,
    s_ij += (P_Q P_Kᵀ)_ij, P_Q, P_K ∈ R^{max_len×d_p} read at the input's position ids.

    Options:
        rank: d_p, the rank of the term (default: the head size d_h).
        sharing: "none" (own P per layer and head), "head" (one P per layer shared by its
            heads) or "layer" (one P per head shared by all layers)."""

    paper = "Chen et al. 2021 (DIET), Eq 1 and Theorem 1"
    equation = "s_ij += (P_Q P_Kᵀ)_ij"
    acts_on = ("score",)
    cost_class = "wide_low_rank"
    inductive = False
    translation_invariant = False

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], rank: int | None = None,
                 sharing: Sharing = "none") -> None:
        super().__init__(dims, shared)
        if sharing not in ("none", "head", "layer"):
            raise PositionError(f"diet_abs: unknown sharing {sharing!r}; valid: none, head, layer")
        self.rank = rank or dims.head_dim
        heads = 1 if sharing == "head" else dims.n_heads
        self.p_q = nn.Parameter(torch.randn(heads, dims.max_len, self.rank) * 0.02)
        self.p_k = nn.Parameter(torch.randn(heads, dims.max_len, self.rank) * 0.02)

    @classmethod
    def layer_shared(cls, options: dict) -> bool:
        return options.get("sharing", "none") == "layer"

    def check(self, ctx: Context) -> None:
        max_len_check(self, ctx.positions, self.p_q.shape[1])

    def start_at_zero(self) -> bool:
        """P_K = 0: the term P_Q P_Kᵀ is zero while P_K's gradient (through P_Q) is not."""
        with torch.no_grad():
            self.p_k.zero_()
        return True

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        pos = ctx.row_positions  # rows of P_Q, P_K at the input's position ids: [heads, b|1, n, r]
        return [LowRank(u=self.p_q[:, pos].transpose(0, 1).to(q.dtype),
                        v=self.p_k[:, pos].transpose(0, 1).to(q.dtype))]

    def position_structures(self, n: int, ctx: Context) -> list[Structure]:
        """P_Q P_Kᵀ [heads, n, n] (DIET Fig 4/7)."""
        pq, pk = self.p_q[:, :n].detach().double(), self.p_k[:, :n].detach().double()
        return [Structure(self.name, "matrix", pq @ pk.transpose(-1, -2))]


@register("diet_rel")
class DietRel(Mechanism):
    """DIET-REL (Chen et al. 2021, Eq 3): s_ij += R_h[clip(j − i)], one learned scalar per head and
    offset, with no log binning.

    Options:
        max_distance: offsets beyond ±max_distance share the edge value (default: max_len − 1,
            every offset its own)."""

    paper = "Chen et al. 2021 (DIET), Eq 3"
    equation = "s_ij += R_h[clip(j−i)]"
    acts_on = ("score",)
    cost_class = "learned_table"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], max_distance: int | None = None) -> None:
        super().__init__(dims, shared)
        self.max_distance = max_distance or dims.max_len - 1
        self.rel = nn.Parameter(torch.randn(dims.n_heads, 2 * self.max_distance + 1) * 0.02)

    def start_at_zero(self) -> bool:
        """R = 0: no bias at any offset, every offset still trained."""
        with torch.no_grad():
            self.rel.zero_()
        return True

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        m = self.max_distance
        idx = offsets(ctx.n, q.device).clamp(-m, m) + m
        return [Toeplitz(self.rel[:, idx].to(q.dtype), window=m)]
