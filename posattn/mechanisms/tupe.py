"""TUPE, untied positional encoding (Ke et al. 2021; DIET Table 2).

    s_ij = q_i·k_j / √(2d_h) + (p_i U_Q)(p_j U_K)ᵀ / √(2d_h) [+ b_{j−i}]

p ∈ R^{max_len×d} is one learned position embedding shared by all layers (never added to the
input); U_Q, U_K are per-layer projections split by head. ``untie_cls``: the [CLS] (first)
token's position terms are replaced by learned scalars, θ1 for its row (CLS → all) and θ2 for
its column (others → CLS), per head (on by default in encoders). ``relative_bias``: TUPE-R,
adds a T5 bucket bias, which (as in TUPE's code, where [CLS] gets its own buckets) does not
reach the untied [CLS] row and column. p_i is read at the input's position ids. Low rank: untying
adds two dimensions, u_i = [p_iU_Q·1{i>0}, 1{i=0}, 1{i>0}], v_j = [p_jU_K·1{j>0}, θ1, θ2·1{j=0}],
and two more cancel the relative bias on row and column 0. In packed rows each document's first
token is its [CLS].
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..attention.terms import LowRank, Term
from .base import Context, Dims, Mechanism, document_positions, max_len_check
from .registry import register
from .t5 import T5Bias


@register("tupe")
class TUPE(Mechanism):
    """TUPE, untied positional encoding (Ke et al. 2021): s_ij = q_i·k_j/√(2d_h) +
    (p_i U_Q)(p_j U_K)ᵀ/√(2d_h), one learned position embedding p shared by all layers and never
    added to the input.

    Options:
        untie_cls: replace the [CLS] (first) token's position terms by learned scalars per head
            (default: on in an encoder, off in a decoder).
        relative_bias: TUPE-R: add a T5 bucket bias, which does not reach the untied [CLS] row
            and column."""

    paper = "Ke et al. 2021 (TUPE); Chen et al. 2021 (DIET) Table 2"
    equation = "s_ij = q_i·k_j/√(2d_h) + (p_iU_Q)(p_jU_K)ᵀ/√(2d_h)"
    acts_on = ("q", "score")
    cost_class = "wide_low_rank"
    inductive = False
    translation_invariant = False

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], untie_cls: bool | None = None,
                 relative_bias: bool = False) -> None:
        super().__init__(dims, shared)
        if "tupe.positions" not in shared:
            shared["tupe.positions"] = nn.Embedding(dims.max_len, dims.d_model)
            nn.init.normal_(shared["tupe.positions"].weight, std=0.02)
        self.positions = shared["tupe.positions"]
        self.u_q = nn.Linear(dims.d_model, dims.d_model, bias=False)
        self.u_k = nn.Linear(dims.d_model, dims.d_model, bias=False)
        self.untie_cls = (not dims.causal) if untie_cls is None else untie_cls
        if self.untie_cls:
            self.theta = nn.Parameter(torch.zeros(2, dims.n_heads))
        self.relative = T5Bias(dims, shared, bidirectional=not dims.causal) if relative_bias else None

    def check(self, ctx: Context) -> None:
        max_len_check(self, ctx.positions, self.positions.num_embeddings)

    incremental = "rows"  # the q/k/v transform is a per-row rescaling

    def transform_qkv(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        return q / math.sqrt(2.0), k, v

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        n, h = ctx.n, self.dims.n_heads
        p = self.positions(ctx.row_positions)  # [b|1, n, d]
        b = p.shape[0]
        u = self.u_q(p).view(b, n, h, -1).transpose(1, 2) / math.sqrt(2.0 * self.dims.head_dim)
        v = self.u_k(p).view(b, n, h, -1).transpose(1, 2)
        relative = self.relative.score_terms(q, k, ctx) if self.relative is not None else []
        if self.untie_cls:
            # each token's offset o from its [CLS]: the first token of the row, or of its document
            o = torch.arange(n, device=q.device)[None] if ctx.documents is None else document_positions(ctx.documents)
            first = (o == 0).to(u.dtype)[:, None, :, None]  # [b|1, 1, n, 1]
            b = max(b, first.shape[0])
            u, v = u.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)
            rest = 1.0 - first
            cls = first.expand(b, h, n, 1)
            u = torch.cat([u * rest, cls, rest.expand(b, h, n, 1)], -1)
            v = torch.cat([v * rest, self.theta[0][:, None, None].expand(b, h, n, 1),
                           self.theta[1][:, None, None] * cls], -1)
            if relative:  # cancel b(j − c) on the [CLS] row c and b(c − i) on its column
                table = relative[0].table.to(u.dtype)  # [h, 2n − 1], offset r at r + n − 1
                row0, col0 = table[:, o + n - 1].transpose(0, 1), table[:, n - 1 - o].transpose(0, 1)  # [b|1, h, n]
                u = torch.cat([u, cls, (-col0[..., None] * rest).expand(b, h, n, 1)], -1)
                v = torch.cat([v, -row0[..., None].expand(b, h, n, 1), cls], -1)
        return [LowRank(u=u.to(q.dtype), v=v.to(q.dtype)), *relative]
