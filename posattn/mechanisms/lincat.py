"""``lincat``: CAT with linear attention (Li et al. 2024, LinCAT; the linear attention of
Katharopoulos et al. 2020, Eq 4-6).

CAT's filters convolve q, k, v (:class:`~.conv_layers.CAT`, same options), then softmax is
replaced by a positive feature map φ(x) = elu(x) + 1 applied per head, normalised by the
sum of the kernel:

    o_i = Σ_{j∈N(i)} (φ(q_i)·φ(k_j)) v_j / Σ_{j∈N(i)} φ(q_i)·φ(k_j),

N(i) = every real key (encoder) or the real keys j ≤ i (decoder); padded keys have φ(k_j) = 0.
No 1/√d_h scale (as in Katharopoulos et al.); no attention dropout (there is no probability
matrix).

Paths: ``reference`` materialises the n×n kernel matrix; ``fast`` is linear in n: one
(d×d_v) summary Σ_j φ(k_j) v_jᵀ for an encoder, and for a decoder the chunked prefix-sum form
(chunks of ``chunk`` positions: the kernel matrix inside a chunk, running sums of the
summaries of the chunks before), O(n·(chunk + d)·d_v) time, O(n·d·d_v/chunk) extra memory.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.terms import Term
from ..errors import PositionError
from .base import Context, Dims, Softmax
from .conv_layers import CAT
from .registry import register

EPS = 1e-12  # a padded query with no real key before it gets 0, not 0/0


def features(q: Tensor, k: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """φ(q), φ(k) with padded keys zeroed."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    if keep is not None:
        fk = fk * keep[:, None, :, None].to(fk.dtype)
    return fq, fk


def linear_attention_dense(fq: Tensor, fk: Tensor, v: Tensor, causal: bool) -> Tensor:
    """Reference: the n×n kernel matrix, masked and row-normalised."""
    a = fq @ fk.transpose(-1, -2)
    if causal:
        a = a.tril()
    return (a @ v) / a.sum(-1, keepdim=True).clamp_min(EPS)


def linear_attention(fq: Tensor, fk: Tensor, v: Tensor, causal: bool, chunk: int) -> Tensor:
    """Linear in n: a global summary (encoder) or chunked prefix sums (decoder)."""
    if not causal:
        num = fq @ (fk.transpose(-1, -2) @ v)
        return num / (fq @ fk.sum(-2, keepdim=True).transpose(-1, -2)).clamp_min(EPS)
    b, h, n, d = fq.shape
    pad = -n % chunk
    fq, fk, v = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v))
    c = (n + pad) // chunk
    fq, fk, v = (t.view(b, h, c, chunk, t.shape[-1]) for t in (fq, fk, v))
    inner = (fq @ fk.transpose(-1, -2)).tril()  # [b, h, c, chunk, chunk]
    kv = fk.transpose(-1, -2) @ v  # [b, h, c, d, d_v]: each chunk's summary
    z = fk.sum(-2)  # [b, h, c, d]
    before_kv, before_z = kv.cumsum(2) - kv, z.cumsum(2) - z  # sums over the chunks before
    num = inner @ v + fq @ before_kv
    den = inner.sum(-1) + (fq @ before_z.unsqueeze(-1)).squeeze(-1)
    out = num / den.clamp_min(EPS).unsqueeze(-1)
    return out.view(b, h, c * chunk, -1)[:, :, :n]


@register("lincat")
class LinCAT(CAT):
    """LinCAT (Li et al. 2024; Katharopoulos et al. 2020, Eq 4-6), a mixer: CAT's filters on q, k, v,
    then linear attention o_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j) with φ = elu + 1.

    Options:
        kernel_size: CAT's filter length (see ``cat``).
        depthwise: CAT's per-channel (True) or shared (False) filters.
        targets: which of q, k, v CAT filters, letters from "qkv".
        qk_norm: CAT's ℓ2-normalised q and k with a learned temperature.
        chunk: positions per chunk of the decoder's prefix-sum form (the fast path's
            memory/time trade-off; the result does not depend on it)."""

    paper = "Li et al. 2024 (CAT), LinCAT; Katharopoulos et al. 2020, Eq 4-6"
    equation = "CAT q,k,v; o_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j), φ = elu + 1"
    mixes = True
    cost_class = "mixer"
    takes_score_terms = False

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], kernel_size: int = 3,
                 depthwise: bool = True, targets: str = "qkv", qk_norm: bool = False, chunk: int = 64) -> None:
        super().__init__(dims, shared, kernel_size, depthwise, targets, qk_norm)
        if chunk < 1:
            raise PositionError(f"lincat: chunk must be >= 1, got {chunk}")
        self.acts_on = self.acts_on + ("mixer",)
        self.chunk = chunk

    def mix(self, q: Tensor, k: Tensor, v: Tensor, terms: list[Term], ctx: Context,
            softmax: Softmax) -> Tensor:
        fq, fk = features(q, k, ctx.keep)
        if softmax.path == "reference":
            return linear_attention_dense(fq, fk, v, ctx.causal)
        return linear_attention(fq, fk, v, ctx.causal, self.chunk)
