"""Multi-head self-attention that composes position mechanisms.

The layer knows the four hooks of :class:`posattn.mechanisms.base.Mechanism` and the term
structures of :mod:`.terms`, never a mechanism's name:

    q, k, v = split(x W_QKV)                    # minus the heads a mechanism supplies itself
    for m in mechanisms: q, k, v = m.transform_qkv(q, k, v)
    terms   = [t for m in mechanisms for t in m.score_terms(q, k)]
                                                # (additive terms, or a score transform that
                                                #  rewrites q·kᵀ/√d_h + Σ terms before the mask)
    o       = attend(q, k, v, terms)            # reference or fast path,
            | mixer.mix(q, k, v, terms, softmax) # or a mixer that replaces softmax(s)·V
                                                # (the mask: padding, causality, documents)
    for m in mechanisms: o = m.transform_output(o, v)
    y       = merge(o) W_O

With ``rows`` (the last layer of a model whose loss reads a few positions) only those query rows
are attended and projected, O(m·n) for m rows (:func:`.reference.attend_rows`), when every
mechanism of the layer builds its terms for chosen rows (the mechanisms that decode
incrementally, :func:`.decode.mode`), or by the mixer itself when it gives chosen rows
(``mixes_rows``) and no mechanism transforms the output; otherwise the whole layer runs and the
rows are taken after.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import PositionError
from ..mechanisms.base import Context, Dims, Mechanism, Softmax
from . import fast, reference
from .decode import blockers
from .masking import allowed_mask
from .terms import Term, take_rows

Path = Literal["reference", "fast"]
PATHS: dict[str, object] = {"reference": reference.attend, "fast": fast.attend}


def mix(mechanisms: list[Mechanism], q: Tensor, k: Tensor, v: Tensor, ctx: Context, path: Path = "fast",
        dropout: float = 0.0, training: bool = False, rows: Tensor | None = None) -> Tensor:
    """Score terms, then softmax(s)·V on ``path`` or the mechanisms' mixer in its place:
    [b, h, n, d_v] from q, k, v after their transforms; with ``rows`` ([b|1, m], only for a
    mixer that gives chosen rows, :func:`mixes_rows`) those query rows alone, [b, h, m, d_v]."""
    terms = [t for m in mechanisms for t in m.score_terms(q, k, ctx)]
    for m in mechanisms:
        if m.mixes:
            softmax = Softmax(path, PATHS[path], ctx.keep, ctx.causal, dropout, training, ctx.documents)
            if rows is None:
                return m.mix(q, k, v, terms, ctx, softmax)
            if m.mixes_rows:
                return m.mix(q, k, v, terms, ctx, softmax, rows)
    if rows is not None:
        raise PositionError("mix: rows are given to a mixer that gives chosen rows (mixes_rows) only")
    # softmax attention itself is called directly: building the frozen Softmax dataclass inside a
    # torch.compile'd step failed on CUDA (torch 2.11: "'Softmax' object has no attribute 'path'")
    return PATHS[path](q, k, v, terms, ctx.keep, ctx.causal, dropout, training, ctx.documents)


def mixes_rows(mechanisms: list[Mechanism]) -> bool:
    """Whether the layer's mixer gives chosen query rows alone (``mixes_rows``) and no mechanism
    of the layer transforms the output (a transform reads the whole output)."""
    plain = all(type(m).transform_output is Mechanism.transform_output for m in mechanisms)
    return plain and any(m.mixes and m.mixes_rows for m in mechanisms)


class Attention(nn.Module):
    """Self-attention over [b, n, d_model] with the given per-layer mechanisms."""

    def __init__(self, dims: Dims, mechanisms: list[Mechanism], path: Path = "fast",
                 dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        if path not in PATHS:
            raise PositionError(f"unknown attention path {path!r}; valid: {', '.join(PATHS)}")
        self.dims, self.path, self.dropout = dims, path, dropout
        self.mechanisms = nn.ModuleList(mechanisms)
        self.qkv = nn.Linear(dims.d_model, 3 * dims.d_model, bias=bias)
        self.out = nn.Linear(dims.d_model, dims.d_model, bias=bias)

    def linear_qkv(self, x: Tensor) -> list[Tensor]:
        """x W_QKV as q, k, v [b, h', n, d_h], without the last heads that a mechanism supplies
        itself (:meth:`Mechanism.own_heads`): those rows of W_QKV are never computed. On the fast
        path under ``fast.Policy.split_qkv``, three products on W_QKV's rows (BERT's three
        projections): their gradients need no stacking into one, the same numbers."""
        b, n, d = x.shape
        h, hd = self.dims.n_heads, self.dims.head_dim
        owned = [m.own_heads() for m in self.mechanisms]
        own = [max([0, *(o.get(t, 0) for o in owned)]) for t in "qkv"]
        split = self.path == "fast" and fast.policy_for(x.device).split_qkv
        if not any(own) and not split:
            return list(self.qkv(x).view(b, n, 3, h, hd).permute(2, 0, 3, 1, 4))
        widths = [(h - c) * hd for c in own]
        w, bias = self.qkv.weight, self.qkv.bias
        rows = [slice(i * d, i * d + width) for i, width in enumerate(widths)]
        if split:
            parts = [F.linear(x, w[r], None if bias is None else bias[r]) for r in rows]
        else:
            y = F.linear(x, torch.cat([w[r] for r in rows]),
                         None if bias is None else torch.cat([bias[r] for r in rows]))
            parts = list(y.split(widths, -1))
        return [part.view(b, n, -1, hd).transpose(1, 2) for part in parts]

    def project(self, x: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as [b, h, n, d_h] after every mechanism's q/k/v transform."""
        q, k, v = self.linear_qkv(x)
        ctx.x = x
        for m in self.mechanisms:
            q, k, v = m.transform_qkv(q, k, v, ctx)
        return q, k, v

    def terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        return [t for m in self.mechanisms for t in m.score_terms(q, k, ctx)]

    def forward(self, x: Tensor, ctx: Context, rows: Tensor | None = None) -> Tensor:
        """[b, n, d_model]; with ``rows`` ([b|1, m] positions) the output rows at those positions,
        [b, m, d_model]."""
        q, k, v = self.project(x, ctx)
        few = rows is not None and rows.shape[-1] < ctx.n
        if few and not blockers(list(self.mechanisms)):
            q = take_rows(q, rows)
            o = reference.attend_rows(q, k, v, self.terms(q, k, ctx), rows, ctx.keep, ctx.causal,
                                      self.dropout, self.training, ctx.documents)
        elif few and mixes_rows(list(self.mechanisms)):
            o = mix(list(self.mechanisms), q, k, v, ctx, self.path, self.dropout, self.training, rows)
        else:
            o = mix(list(self.mechanisms), q, k, v, ctx, self.path, self.dropout, self.training)
            for m in self.mechanisms:
                o = m.transform_output(o, v, ctx)
            o = o if rows is None else take_rows(o, rows)
        b, h, m, d = o.shape
        return self.out(o.transpose(1, 2).reshape(b, m, h * d))

    def scores(self, x: Tensor, ctx: Context) -> Tensor:
        """Pre-softmax scores [b, h, n, n] with every position term (reference form)."""
        for m in self.mechanisms:
            if m.mixes:
                raise PositionError(f"{m.name}: replaces softmax attention; it has no n×n score matrix "
                                    f"of n_heads heads to report")
        q, k, _ = self.project(x, ctx)
        ok = allowed_mask(ctx.n, ctx.keep, ctx.causal, q.device, documents=ctx.documents)
        return reference.scores(q, k, self.terms(q, k, ctx), ok=ok)
