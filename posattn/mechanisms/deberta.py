"""DeBERTa's disentangled attention (He et al. 2021, "DeBERTa: Decoding-enhanced BERT with
Disentangled Attention", §3.1, Eq 2-4):

    Ã_ij = Q^c_i·K^c_j (c2c) + Q^c_i·K^r_{δ(i,j)} (c2p) + K^c_j·Q^r_{δ(i,j)} (p2c),   s_ij = Ã_ij/√(3 d_h)
    δ(i, j) = clamp(i − j + k, 0, 2k − 1)                                         (Eq 3)
    K^r = P W_{k,r} + b_{k,r},   Q^r = P W_{q,r} + b_{q,r},   P ∈ R^{2k×d_model}

Q^c, K^c are the layer's own query and key; P, the relative position embeddings, is one table
shared by every layer (DeBERTa-v2 normalises it by a LayerNorm first, ``layer_norm``);
W_{k,r}, W_{q,r} (with biases, as transformers' DebertaV2 without ``share_att_key``) are per layer
and split by head. d is taken per head, as the authors' code and
transformers do (√(d_h · 3)); with one of c2p, p2c left out (``pos_att_type``) the 3 is a 2.

Indices: the p2c term reads Q^r at δ(i, j), the row of i − j, as c2p does. The paper writes
δ(j, i) (the query's position relative to the key); the authors' code, and transformers', gather
p2c at clamp(−r_pos + k) of the key's row and transpose, which is δ(i, j) — and that is the model
people load weights into, so this follows it (a test matches transformers' DebertaV2 attention).

DeBERTa-v2's log buckets (``position_buckets`` = 2m > 0; transformers' ``make_log_bucket_position``):
distances |i − j| ≤ m keep their own index, larger ones share buckets

    bucket(δ) = sign(δ) · (⌈log(|δ|/m) / log((M − 1)/m) · (m − 1)⌉ + m),   M = max_relative_positions,

and δ(i, j) = clamp(bucket(i − j) + 2m, 0, 4m − 1) over a table of 4m rows. The logarithm is taken
in float32, as transformers takes it, so that every distance lands in the bucket it has there.

Structures (:mod:`posattn.attention.terms`), exact on every fast path: c2p is a query-relative
term q_i·W[clip(j − i)] and p2c its key-side twin k_j·W[clip(i − j)] (like ``dynamic_conv`` and
``key_dynamic_conv``), W the rows of K^r (Q^r) gathered at each offset's index over the window
beyond which the index no longer changes (k; or where the buckets saturate), never wider than
the input. The 1/√(3d_h) of c2c is the layer's 1/√d_h with q divided by √3 first
(:meth:`DeBERTa.transform_qkv`; ``rescale=False`` keeps the layer's own scale on c2c). The terms
come from the offsets j − i alone, so they are translation invariant and defined at any length.
DeBERTa's enhanced mask decoder (absolute positions before the output layer) is a model head, not
part of the attention, and is not included.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..attention.terms import QueryRelative, Term
from ..errors import PositionError
from .base import Context, Dims, Mechanism
from .registry import register

TERMS = ("c2p", "p2c")


def log_bucket(distance: Tensor, buckets: int, max_position: int) -> Tensor:
    """DeBERTa-v2's bucket of each relative distance i − j (long in, long out; see the module
    docstring), computed in float32 as transformers computes it."""
    mid = buckets // 2
    sign = torch.sign(distance)
    inner = (distance < mid) & (distance > -mid)
    size = torch.where(inner, torch.full_like(distance, mid - 1), distance.abs()).float()
    far = torch.ceil(torch.log(size / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)) + mid
    return torch.where(size <= mid, distance.float(), far * sign).long()


@register("deberta")
class DeBERTa(Mechanism):
    """DeBERTa's disentangled attention (He et al. 2021, Eq 2-4): content-to-content,
    content-to-position q_i·K^r_{δ(i,j)} and position-to-content k_j·Q^r_{δ(i,j)}, scaled by
    1/√(3d_h), δ(i, j) = clamp(i − j + k, 0, 2k − 1); DeBERTa-v2's log buckets as an option.

    Options:
        max_relative_positions: k, the clipping distance of δ (P has 2k rows); default max_len
            (transformers' default, max_position_embeddings). With buckets: M, the distance the
            log buckets reach their last bucket at.
        position_buckets: 0 for the clipped distances of DeBERTa (Eq 3); 2m > 0 for DeBERTa-v2's
            log buckets (P has 2·position_buckets rows; 256 in DeBERTa-v2 and -v3).
        pos_att_type: which position terms to add, c2p and/or p2c, as a list or as "c2p|p2c"
            (the paper's ablations drop one); the scale is 1/√((1 + how many) d_h).
        rescale: divide c2c by √(1 + how many) as well (the paper); False keeps the layer's own
            1/√d_h on q·k, which gives a pretrained model (posattn.hf) a neutral start.
        layer_norm: normalise P by a LayerNorm (shared, like P) before the projections, as
            DeBERTa-v2 and -v3 do (transformers' norm_rel_ebd="layer_norm")."""

    paper = "He et al. 2021 (DeBERTa), Eq 2-4; DeBERTa-v2 log buckets"
    equation = "s_ij = (q_i·k_j + q_i·K^r_{δ(i,j)} + k_j·Q^r_{δ(i,j)})/√(3d_h)"
    acts_on = ("q", "score")
    cost_class = "relative_embedding"
    incremental = "rows"  # the q transform is a per-row rescaling

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], max_relative_positions: int | None = None,
                 position_buckets: int = 0, pos_att_type: list[str] | tuple[str, ...] | str = TERMS,
                 rescale: bool = True, layer_norm: bool = False) -> None:
        super().__init__(dims, shared)
        k = dims.max_len if max_relative_positions is None else max_relative_positions
        if not isinstance(k, int) or k < 1:
            raise PositionError(f"deberta: max_relative_positions must be a positive integer, got {k!r}")
        if not isinstance(position_buckets, int) or position_buckets < 0 or position_buckets in (1, 2, 3):
            raise PositionError(f"deberta: position_buckets must be 0 (no buckets) or an integer >= 4, "
                                f"got {position_buckets!r}")
        if position_buckets and k - 1 <= position_buckets // 2:
            raise PositionError(f"deberta: with position_buckets = {position_buckets} the log buckets start at "
                                f"distance {position_buckets // 2}, so max_relative_positions must exceed "
                                f"{position_buckets // 2 + 1}, got {k}")
        # a list, or transformers' older string form "c2p|p2c"
        kinds = tuple(t.strip() for t in pos_att_type.split("|")) if isinstance(pos_att_type, str) else tuple(
            pos_att_type)
        if not kinds or len(set(kinds)) != len(kinds) or not set(kinds) <= set(TERMS):
            raise PositionError(f"deberta: pos_att_type must name c2p and/or p2c once each, got {list(kinds)}")
        self.max_relative, self.buckets, self.kinds, self.rescale = k, position_buckets, kinds, rescale
        self.span = position_buckets or k  # transformers' att_span: P has 2·span rows
        self.scale_factor = 1 + len(kinds)
        if not rescale:
            self.acts_on = ("score",)
        self.window = self.saturation()
        if "deberta.relative" not in shared:
            shared["deberta.relative"] = nn.Embedding(2 * self.span, dims.d_model)
            nn.init.normal_(shared["deberta.relative"].weight, std=0.02)
        self.relative = shared["deberta.relative"]  # P, one table for every layer
        if layer_norm and "deberta.norm" not in shared:
            shared["deberta.norm"] = nn.LayerNorm(dims.d_model, eps=1e-7)  # transformers' layer_norm_eps
        self.norm = shared["deberta.norm"] if layer_norm else None
        self.pos_key = nn.Linear(dims.d_model, dims.d_model) if "c2p" in kinds else None  # W_{k,r}
        self.pos_query = nn.Linear(dims.d_model, dims.d_model) if "p2c" in kinds else None  # W_{q,r}

    def index(self, distance: Tensor) -> Tensor:
        """δ: the row of P for each relative distance i − j (long)."""
        if self.buckets:
            distance = log_bucket(distance, self.buckets, self.max_relative)
        return (distance + self.span).clamp(0, 2 * self.span - 1)

    def saturation(self) -> int:
        """The least w with δ(w') = δ(w) and δ(−w') = δ(−w) for every w' > w: the index is
        constant beyond ±w (δ is monotone in i − j)."""
        top, limit = 2 * self.span - 1, 2 * self.span
        while True:
            d = torch.arange(1, limit + 1)
            done = (self.index(d) == top) & (self.index(-d) == 0)
            if done.any():
                return int(d[done.nonzero()[0, 0]])
            limit *= 2

    def start_at_zero(self) -> bool:
        """K^r = Q^r = 0 (projections and biases at zero): c2p and p2c add nothing while their
        projections still train. Only with ``rescale=False``: otherwise c2c is divided by √3."""
        if self.rescale:
            return False
        with torch.no_grad():
            for proj in (self.pos_key, self.pos_query):
                if proj is not None:
                    proj.weight.zero_()
                    proj.bias.zero_()
        return True

    def transform_qkv(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        return (q / math.sqrt(self.scale_factor) if self.rescale else q), k, v

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        w = min(self.window, ctx.n - 1)
        idx = self.index(torch.arange(-w, w + 1, device=q.device))  # δ at i − j = −w … w
        table = self.relative.weight if self.norm is None else ctx.cached(
            ("deberta.norm", id(self.norm)), lambda: self.norm(self.relative.weight))  # once for every layer
        rows = table[idx].to(q.dtype)  # P[δ(i − j)], [2w + 1, d_model]
        h, dh = self.dims.n_heads, self.dims.head_dim
        scale = 1.0 / math.sqrt(self.scale_factor * dh)
        terms: list[Term] = []
        if self.pos_key is not None:  # c2p: q_i·K^r[δ(i − j)], a table over r = j − i = −(i − j)
            table = self.pos_key(rows.flip(0)).view(2 * w + 1, h, dh).transpose(0, 1)
            terms.append(QueryRelative(q, table, w, 1.0 / math.sqrt(dh) if self.rescale else scale))
        if self.pos_query is not None:  # p2c: k_j·Q^r[δ(i − j)], a table over i − j
            table = self.pos_query(rows).view(2 * w + 1, h, dh).transpose(0, 1)
            terms.append(QueryRelative(k, table, w, scale, key_side=True))
        return terms
