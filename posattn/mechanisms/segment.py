"""Segment information (Chen et al. 2021, DIET Eq 2), per head in the scores or at the input.

- ``mode="attention"`` (DIET): s_ij += E_S(S(i), S(j)) = S_h[S(i), S(j)], a learned
  n_seg × n_seg table per head. As onehot(S(i)) S_h onehot(S(j))ᵀ it is low rank (rank n_seg).
- ``mode="input"`` (BERT): x_i ← x_i + E_seg[S(i)].
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.terms import LowRank, Term
from ..errors import PositionError
from .base import Context, Dims, Mechanism, Structure
from .registry import register


@register("segment")
class Segment(Mechanism):
    """Segment information (Chen et al. 2021, DIET Eq 2, or BERT's input segment embeddings): a
    learned per-head table of segment pairs in the scores, or an embedding added to the input.

    Options:
        mode: "attention" (DIET: s_ij += S_h[S(i), S(j)], low rank) or "input" (BERT:
            x_i += E_seg[S(i)])."""

    paper = "Chen et al. 2021 (DIET), Eq 1-2; Devlin et al. 2019 (input segment embeddings)"
    equation = "s_ij += S_h[S(i), S(j)]  (or x_i += E_seg[S(i)])"
    acts_on = ("score",)
    cost_class = "narrow_low_rank"
    positional = False  # segment ids, not positions

    def __init__(self, dims: Dims, shared: dict[str, nn.Module],
                 mode: Literal["attention", "input"] = "attention") -> None:
        super().__init__(dims, shared)
        if mode not in ("attention", "input"):
            raise PositionError(f"segment: unknown mode {mode!r}; valid: attention, input")
        if dims.n_segments < 1:
            raise PositionError("segment: the model has n_segments = 0; set n_segments >= 1")
        self.mode = mode
        if mode == "input":
            self.placement = "input"
            self.acts_on = ("input",)
            self.cost_class = "input"
            self.embedding = nn.Embedding(dims.n_segments, dims.d_model)
            nn.init.normal_(self.embedding.weight, std=0.02)
        else:
            self.table = nn.Parameter(torch.randn(dims.n_heads, dims.n_segments, dims.n_segments) * 0.02)

    @classmethod
    def placement_for(cls, options: dict) -> str:
        return "input" if options.get("mode") == "input" else "layer"

    def start_at_zero(self) -> bool:
        """S = 0 (or E_seg = 0 at the input): nothing added, the table still trained."""
        with torch.no_grad():
            (self.embedding.weight if self.mode == "input" else self.table).zero_()
        return True

    def check(self, ctx: Context) -> None:
        if ctx.segments.numel() and int(ctx.segments.max()) >= self.dims.n_segments:
            raise self.fail(f"segment id {int(ctx.segments.max())} but the model has "
                            f"n_segments = {self.dims.n_segments}")

    def embed(self, x: Tensor, ctx: Context) -> Tensor:
        if self.mode != "input":
            return x
        return x + self.embedding(ctx.segments)

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        if self.mode != "attention":
            return []
        onehot = F.one_hot(ctx.segments, self.dims.n_segments).to(q.dtype)[:, None]  # [b,1,n,S]
        return [LowRank(u=onehot @ self.table.to(q.dtype), v=onehot)]

    def position_structures(self, n: int, ctx: Context) -> list[Structure]:
        """The segment-pair table S_h [h, S, S] (DIET Eq 2); none at the input."""
        if self.mode != "attention":
            return []
        return [Structure(self.name, "segment", self.table.detach().double())]
