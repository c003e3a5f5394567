"""Length-projected attention: ``linformer`` (Wang et al. 2020, Eq 7) and ``diet_abs_lin``
(DIET-ABS on Linformer, Chen et al. 2021, Eq 4).

    linformer:     head = softmax(q (E K)ᵀ / √d_h) (F V),             E, F ∈ R^{k×n}
    diet_abs_lin:  s_ij = q_i·(E K)_j / √d_h + (P_Q P_Kᵀ)_ij,         P_Q ∈ R^{n×d_p}, P_K ∈ R^{k×d_p}

E and F are learned over ``max_len`` positions (initialised N(0, 1/k) as in Linformer §4); an
input of n positions uses their columns at its position ids, so the cost is O(n·k) and the
mixer is not inductive. Padded keys and values are zeroed before the projection. ``sharing``
(Linformer §4): ``none`` (own E, F per head), ``head`` (one E, F per layer, shared by its
heads), ``kv`` (additionally E = F), ``layer`` (one E = F for every layer and head). Linformer
mixes the whole sequence into each projected key, so it cannot be causal. DIET-ABS's P_Q, P_K
are per head, rank ``rank`` (default d_h), per layer (shared by every layer with
``sharing="layer"``): a position-only term added to the n×k scores. Attention dropout drops
the n×k probabilities with posattn's masks (:mod:`posattn.attention.dropout`).

In a packed row (``ctx.documents``, positions restarting at each document) each of the row's
D documents is projected on its own, E K_doc with the columns at its own positions, and a
query attends only to its document's k projected keys: exactly Linformer run on each document
alone, at O(n·D·k) cost.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.reference import weighted_values
from ..attention.terms import Term
from ..errors import PositionError
from .base import Context, Dims, Mechanism, Softmax, document_rank, max_len_check
from .registry import register

Sharing = Literal["none", "head", "kv", "layer"]
SHARINGS = ("none", "head", "kv", "layer")


@register("linformer")
class Linformer(Mechanism):
    """Linformer (Wang et al. 2020, Eq 7), a mixer: keys and values projected along the length,
    softmax(q (E K)ᵀ/√d_h)(F V) with E, F ∈ R^{k×max_len}; O(n·k), encoder only, not inductive.

    Options:
        k: the projected length.
        sharing: "none" (own E, F per head), "head" (one E, F per layer), "kv" (also E = F)
            or "layer" (one E = F for every layer and head)."""

    paper = "Wang et al. 2020 (Linformer), Eq 7; Chen et al. 2021 (DIET), §3.3"
    equation = "softmax(q (E K)ᵀ/√d_h)(F V), E, F ∈ R^{k×n}"
    acts_on = ("mixer",)
    inductive = False
    translation_invariant = False
    mixes = True
    cost_class = "mixer"
    takes_score_terms = False

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], k: int = 32, sharing: Sharing = "none") -> None:
        super().__init__(dims, shared)
        self.k, self.sharing = k, sharing
        heads = dims.n_heads if sharing == "none" else 1
        self.e = nn.Parameter(torch.randn(heads, k, dims.max_len) / k ** 0.5)
        self.f = None if sharing in ("kv", "layer") else nn.Parameter(torch.randn(heads, k, dims.max_len) / k ** 0.5)

    @classmethod
    def validate(cls, options: dict, others: list[str], dims: Dims) -> None:
        if dims.causal:
            raise PositionError(f"{cls.name}: projects the whole sequence into each key, so it cannot "
                                f"be causal; use it in an encoder")
        if options.get("sharing", "none") not in SHARINGS:
            raise PositionError(f"{cls.name}: unknown sharing {options['sharing']!r}; valid: {', '.join(SHARINGS)}")
        if options.get("k", 32) < 1:
            raise PositionError(f"{cls.name}: the projected length k must be >= 1, got {options['k']}")

    @classmethod
    def layer_shared(cls, options: dict) -> bool:
        return options.get("sharing", "none") == "layer"

    def check(self, ctx: Context) -> None:
        max_len_check(self, ctx.positions, self.dims.max_len)

    def project(self, t: Tensor, proj: Tensor, ctx: Context) -> Tensor:
        """(E T) per head: [b, h, k, d] from T [b, h, n, d] and the columns at the position ids;
        in a packed row one projection per document, [b, h, D·k, d] (document-major)."""
        cols = proj[:, :, ctx.positions].permute(2, 0, 1, 3).to(t.dtype)  # [b, heads, k, n]
        if ctx.keep is not None:
            t = t * ctx.keep[:, None, :, None].to(t.dtype)
        if ctx.documents is None:
            return cols @ t
        onehot = F.one_hot(document_rank(ctx.documents)).to(t.dtype)  # [b, n, D]
        per_doc = cols[:, :, None] * onehot.transpose(1, 2)[:, None, :, None, :]  # [b, heads, D, k, n]
        return (per_doc @ t[:, :, None]).flatten(2, 3)

    def bias(self, ctx: Context, dtype: torch.dtype) -> Tensor | None:
        """An additive [b|1, h|1, n, k] score term; none for plain Linformer."""
        return None

    def mix(self, q: Tensor, k: Tensor, v: Tensor, terms: list[Term], ctx: Context,
            softmax: Softmax) -> Tensor:
        kp = self.project(k, self.e, ctx)
        vp = self.project(v, self.e if self.f is None else self.f, ctx)
        bias, ok = self.bias(ctx, q.dtype), None
        if ctx.documents is not None:  # each query sees only its own document's k projected keys
            rank = document_rank(ctx.documents)
            ok = (rank[:, None, :, None] == torch.arange(kp.shape[-2] // self.k, device=q.device)
                  .repeat_interleave(self.k))
            bias = None if bias is None else bias.repeat(1, 1, 1, kp.shape[-2] // self.k)
        if softmax.training and softmax.dropout > 0:  # posattn's dropout masks (attention/dropout.py)
            s = q @ kp.transpose(-1, -2) / math.sqrt(q.shape[-1])
            return weighted_values(s if bias is None else s + bias, ok, vp, softmax.dropout, True)
        if ok is not None:
            blocked = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill(~ok, float("-inf"))
            bias = blocked if bias is None else bias + blocked
        from ..attention.fast import sdpa  # the attention package imports the mechanisms' modules

        return sdpa(q, kp, vp, bias)  # under the fast path's Policy.sdpa_backend


@register("diet_abs_lin")
class DietAbsLin(Linformer):
    """DIET-ABS on Linformer (Chen et al. 2021, Eq 4), a mixer: Linformer's projected scores plus
    a per-head position term (P_Q P_Kᵀ)_ij, P_Q ∈ R^{max_len×d_p}, P_K ∈ R^{k×d_p}.

    Options:
        k: the projected length.
        sharing: Linformer's sharing of E and F ("none", "head", "kv", "layer"; with "layer"
            P_Q and P_K are shared by every layer too).
        rank: d_p, the rank of the position term (default: the head size d_h)."""

    paper = "Chen et al. 2021 (DIET), Eq 4"
    equation = "q_i·(E K)_j/√d_h + (P_Q P_Kᵀ)_ij, P_Q ∈ R^{n×d_p}, P_K ∈ R^{k×d_p}"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], k: int = 32, sharing: Sharing = "none",
                 rank: int | None = None) -> None:
        super().__init__(dims, shared, k, sharing)
        self.rank = rank or dims.head_dim
        self.p_q = nn.Parameter(torch.randn(dims.n_heads, dims.max_len, self.rank) * 0.02)
        self.p_k = nn.Parameter(torch.randn(dims.n_heads, k, self.rank) * 0.02)

    def bias(self, ctx: Context, dtype: torch.dtype) -> Tensor:
        p_q = self.p_q[:, ctx.positions].transpose(0, 1)  # [b, h, n, d_p]
        return (p_q @ self.p_k.transpose(-1, -2)).to(dtype)
