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

Packed rows (``ctx.documents``): N(i) holds only the keys of i's own document. The reference
masks the kernel matrix; the fast path keeps one summary per document (encoder) or restarts
the prefix sums at each document (decoder), see :func:`linear_attention`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.terms import Term
from ..errors import PositionError
from .base import Context, Dims, Softmax, document_rank
from .conv_layers import CAT
from .registry import register

EPS = 1e-12  # a padded query with no real key before it gets 0, not 0/0


def features(q: Tensor, k: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """φ(q), φ(k) with padded keys zeroed."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    if keep is not None:
        fk = fk * keep[:, None, :, None].to(fk.dtype)
    return fq, fk


def same_document(documents: Tensor) -> Tensor:
    """[b, 1, n, n] bool: query i and key j lie in the same document of a packed row."""
    return (documents[:, :, None] == documents[:, None, :])[:, None]


def linear_attention_dense(fq: Tensor, fk: Tensor, v: Tensor, causal: bool,
                           documents: Tensor | None = None) -> Tensor:
    """Reference: the n×n kernel matrix, masked (causal, same document) and row-normalised."""
    a = fq @ fk.transpose(-1, -2)
    if causal:
        a = a.tril()
    if documents is not None:
        a = a * same_document(documents).to(a.dtype)
    return (a @ v) / a.sum(-1, keepdim=True).clamp_min(EPS)


def linear_attention(fq: Tensor, fk: Tensor, v: Tensor, causal: bool, chunk: int,
                     documents: Tensor | None = None) -> Tensor:
    """Linear in n: a global summary (encoder) or chunked prefix sums (decoder), per document
    of a packed row when ``documents`` is given."""
    if documents is not None:
        if causal:
            return _causal_documents(fq, fk, v, chunk, documents)
        return _documents(fq, fk, v, documents)
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


def _documents(fq: Tensor, fk: Tensor, v: Tensor, documents: Tensor) -> Tensor:
    """Encoder, packed: one summary Σ_j φ(k_j) v_jᵀ per document (a one-hot [n, D] of the
    document ranks selects each token's), O(n·D·d·d_v) for D documents in a row."""
    b, h, n, d = fq.shape
    rank = document_rank(documents)
    onehot = F.one_hot(rank, int(rank.max()) + 1).to(fq.dtype)[:, None, :, :, None]  # [b, 1, n, D, 1]
    fk_docs = (fk[:, :, :, None, :] * onehot).flatten(3)  # [b, h, n, D·d]
    fq_docs = (fq[:, :, :, None, :] * onehot).flatten(3)
    num = fq_docs @ (fk_docs.transpose(-1, -2) @ v)
    return num / (fq_docs @ fk_docs.sum(-2, keepdim=True).transpose(-1, -2)).clamp_min(EPS)


def _causal_documents(fq: Tensor, fk: Tensor, v: Tensor, chunk: int, documents: Tensor) -> Tensor:
    """Decoder, packed: the chunked prefix sums restart at each document. Inside a chunk the
    kernel matrix is masked to the same document; of the chunks before, only the document open
    at the chunk's first token can reach into it, so each chunk carries that document's running
    sum S_c: the sums of the chunks before, back to the one where that document began (exclusive
    cumulative sums of each chunk's part that belongs to the next chunk's first document,
    differenced at the chunk where the document began)."""
    b, h, n, d = fq.shape
    pad = -n % chunk
    fq, fk, v = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v))
    docs = torch.cat([documents, documents[:, -1:].expand(b, pad)], 1)  # padded keys have φ(k) = 0
    c = (n + pad) // chunk
    fq, fk, v = (t.view(b, h, c, chunk, t.shape[-1]) for t in (fq, fk, v))
    docs = docs.view(b, c, chunk)
    head = docs[:, :, 0]  # [b, c]: the document open at each chunk's first token
    same = (docs[:, :, :, None] == docs[:, :, None, :])[:, None]  # [b, 1, c, chunk, chunk]
    inner = (fq @ fk.transpose(-1, -2)).tril() * same.to(fq.dtype)
    # the part of chunk c − 1 that belongs to the document open at chunk c
    nxt = torch.cat([head[:, 1:], head[:, -1:]], 1)
    tail = (docs == nxt[:, :, None])[:, None, :, :, None].to(fk.dtype)  # [b, 1, c, chunk, 1]
    kv = (fk * tail).transpose(-1, -2) @ v  # [b, h, c, d, d_v]
    z = (fk * tail).sum(-2)  # [b, h, c, d]
    # S_c = Σ_{c' ∈ [r − 1, c)} (tail sums), r the last chunk ≤ c whose first document is new
    index = torch.arange(c, device=fq.device).expand(b, c)
    new = torch.ones_like(head, dtype=torch.bool)
    new[:, 1:] = head[:, 1:] != head[:, :-1]
    begun = torch.where(new, (index - 1).clamp_min(0), torch.zeros_like(index)).cummax(-1).values
    # in float64: the earlier documents' total taken off a running sum must not swamp a short one
    acc_kv, acc_z = (t.double().cumsum(2) - t.double() for t in (kv, z))
    at = begun[:, None, :]
    before_kv = (acc_kv - acc_kv.gather(2, at[..., None, None].expand_as(acc_kv))).to(kv.dtype)
    before_z = (acc_z - acc_z.gather(2, at[..., None].expand_as(acc_z))).to(z.dtype)
    first = (docs == head[:, :, None])[:, None, :, :, None].to(fq.dtype)  # queries of the open document
    num = inner @ v + first * (fq @ before_kv)
    den = inner.sum(-1) + first[..., 0] * (fq @ before_z.unsqueeze(-1)).squeeze(-1)
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
            return linear_attention_dense(fq, fk, v, ctx.causal, ctx.documents)
        return linear_attention(fq, fk, v, ctx.causal, self.chunk, ctx.documents)
