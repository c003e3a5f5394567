"""The reference path: the spec's equations line by line, with a dense n×n score matrix.

    s_ij = q_i·k_j / √d_h + Σ_terms t_ij ;  p = softmax_j(s_ij masked) ;  o_i = Σ_j p_ij v_j

Obviously correct and quadratic in memory; the fast path is tested equal to it.
:func:`attend_rows` is the same for chosen query rows i only, O(m·n) for m rows.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .dropout import dropout as drop
from .masking import allowed_mask
from .terms import ScoreTransform, Term


def scores(q: Tensor, k: Tensor, terms: list[Term], scale: float | None = None, ok: Tensor | None = None) -> Tensor:
    """Pre-softmax scores [b, h, n, n] (no mask; ``ok``, the allowed mask, is read by score
    transforms alone)."""
    n = q.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    parts = [t.dense(n) for t in terms if not isinstance(t, ScoreTransform)]
    return transformed(torch.einsum("bhid,bhjd->bhij", q, k) * scale, parts, terms, ok,
                       torch.arange(n, device=q.device)[None])


def transformed(logits: Tensor, parts: list[Tensor], terms: list[Term], ok: Tensor | None, rows: Tensor) -> Tensor:
    """logits + Σ parts (the additive terms, added in order), then every :class:`ScoreTransform`
    of ``terms`` applied in order to (logits, Σ parts), for score rows at positions ``rows``."""
    changes = [t for t in terms if isinstance(t, ScoreTransform)]
    if not changes:
        s = logits
        for part in parts:
            s = s + part
        return s
    bias = torch.zeros_like(logits)
    for part in parts:
        bias = bias + part
    s = logits + bias
    for t in changes:
        s = t.apply(logits, bias, ok, rows)
        bias = s - logits
    return s


def attend(
    q: Tensor, k: Tensor, v: Tensor, terms: list[Term], keep: Tensor | None, causal: bool,
    dropout: float = 0.0, training: bool = False, documents: Tensor | None = None,
) -> Tensor:
    """Attention output [b, h, n, d_v] from the dense score matrix; ``documents`` ([b, n]): the
    document of each token of a packed row, no query sees another document's keys."""
    ok = allowed_mask(q.shape[-2], keep, causal, q.device, documents=documents)
    return weighted_values(scores(q, k, terms, ok=ok), ok, v, dropout, training)


def weighted_values(s: Tensor, ok: Tensor | None, v: Tensor, dropout: float = 0.0, training: bool = False) -> Tensor:
    """softmax_j(s_ij, −inf where ``ok`` is False), dropped out (:mod:`.dropout`), times v."""
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    return drop(torch.softmax(s, dim=-1), dropout, training) @ v


def attend_rows(
    q: Tensor, k: Tensor, v: Tensor, terms: list[Term], index: Tensor, keep: Tensor | None, causal: bool,
    dropout: float = 0.0, training: bool = False, documents: Tensor | None = None,
) -> Tensor:
    """Attention output [b, h, m, d_v] of the query rows ``index`` ([b|1, m] positions; q holds
    those m rows) over all n keys: the rows of :func:`attend`, from an m×n score matrix."""
    n = k.shape[-2]
    ok = allowed_mask(n, keep, causal, q.device, index, documents)
    s = transformed(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]),
                    [t.rows(index, n) for t in terms if not isinstance(t, ScoreTransform)], terms, ok, index)
    return weighted_values(s, ok, v, dropout, training)
