"""The fast path: the same function as :mod:`.reference`, computed per term structure.

- :class:`LowRank` terms fold exactly into extra q/k dimensions: q' = [q/√d_h, u], k' = [k, v],
  so no n×n bias exists and SDPA keeps its fused kernel (v is zero-padded to the same width,
  which the CPU flash kernel needs).
- A :class:`Toeplitz` term with a ``causal_form`` uses that low-rank form under a causal mask.
- :class:`QueryRelative` terms gather q·Wᵀ ([b, h, n, 2w+1]) instead of building Shaw's
  n×n×d tensor.
- What remains is summed into one bias handed to ``scaled_dot_product_attention``; with no bias
  and no padding the causal case runs with ``is_causal`` (no mask tensor at all).

Never more memory than the reference path.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .masking import allowed_mask
from .terms import LowRank, QueryRelative, Term, Toeplitz, relative_index


def query_relative_bias(t: QueryRelative, n: int) -> Tensor:
    """[b, h, n, n] from the [b, h, n, 2w+1] products with the relative embeddings."""
    w = t.weight if t.weight.dim() == 3 else t.weight.unsqueeze(0)  # [h|1, 2w+1, d]
    prod = torch.einsum("bhid,hmd->bhim", t.vec, w) * t.scale
    r = relative_index(n, t.vec.device) - (n - 1)
    idx = (r.T if t.key_side else r).clamp(-t.window, t.window) + t.window  # [n, n]
    if t.key_side:  # t_ij = prod[j, idx_ij]
        return prod.gather(-1, idx.T.expand(*prod.shape[:2], n, n)).transpose(-1, -2)
    return prod.gather(-1, idx.expand(*prod.shape[:2], n, n))


def fold_low_rank(q: Tensor, k: Tensor, v: Tensor, terms: list[LowRank], scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Append each u to q (after scaling q) and v to k; zero-pad v to the new width."""
    b, h, n, _ = q.shape
    qs, ks = [q * scale], [k]
    for t in terms:
        qs.append(t.u.expand(b, h, n, -1).to(q.dtype))
        ks.append(t.v.expand(b, h, n, -1).to(k.dtype))
    q2, k2 = torch.cat(qs, -1), torch.cat(ks, -1)
    return q2, k2, F.pad(v, (0, q2.shape[-1] - v.shape[-1]))


def attend(
    q: Tensor, k: Tensor, v: Tensor, terms: list[Term], keep: Tensor | None, causal: bool,
    dropout: float = 0.0, training: bool = False,
) -> Tensor:
    """Attention output [b, h, n, d_v], equal to :func:`posattn.attention.reference.attend`."""
    n, d_v = q.shape[-2], v.shape[-1]
    low: list[LowRank] = []
    bias: Tensor | None = None
    for t in terms:
        if isinstance(t, Toeplitz) and causal and t.causal_form is not None:
            t = t.causal_form
        if isinstance(t, LowRank):
            low.append(t)
            continue
        dense = query_relative_bias(t, n) if isinstance(t, QueryRelative) else t.dense(n)
        bias = dense if bias is None else bias + dense
    scale = 1.0 / math.sqrt(q.shape[-1])
    if low:
        q, k, v = fold_low_rank(q, k, v, low, scale)
        scale = 1.0
    p = dropout if training else 0.0
    if bias is None and keep is None:
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal, scale=scale)
        return o[..., :d_v]
    ok = allowed_mask(n, keep, causal, q.device)
    if bias is None:
        mask: Tensor | None = ok
    else:
        mask = bias.to(q.dtype)
        if ok is not None:
            mask = mask.masked_fill(~ok, float("-inf"))
        if mask.dim() == 3:
            mask = mask.unsqueeze(0)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)
    return o[..., :d_v]
