"""Exact attention with a learnable additive bias in linear memory (CPU): "flash-bias".

For score terms that are not constant outside a small window (a full Toeplitz table: TISA
with wide kernels, DIET-REL, bidirectional ALiBi; query-relative or dense terms mixed with them).

Forward: per query chunk, PyTorch's fused CPU flash kernel with a no-grad bias chunk. The keys
are taken in *reversed* order, so the Toeplitz bias of a chunk, T[j − i], becomes
T_rev[i + j'] (j' = n − 1 − j): an overlapping strided *view* of the reversed table with strides
(1, 1). The bias is never copied, let alone materialized as n×n.

Backward: one explicit pass per query chunk that computes dS = P ∘ (dP − D) once and uses it
for dq, dk, dv (five matmuls, as in the fused kernel) *and* the bias gradients: the table
gradient is the sum of dS along anti-diagonals (i + j' constant), read through a strided
view, no index scatter. Other bias terms (query-relative, dense) are rebuilt per chunk and
differentiated with autograd.

Padding, or terms other than one Toeplitz table, materialize the bias per chunk (still linear).
With one Toeplitz table alone (no padding, float32) the backward is one fused C++ kernel,
:mod:`.native`, where it builds: the same arithmetic, with each block of dS in cache.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native
from .kernels import flash_bwd, flash_fwd, reduce_to

NEG = float("-inf")

# builds an extra bias chunk [b|1, h|1, i1 − i0, n − j0] over reversed keys j' ∈ [j0, n)
ChunkFn = Callable[[Sequence[Tensor], int, int, int], Tensor]


@dataclass(frozen=True)
class BiasGeometry:
    """Static description of one flash-bias call."""

    causal: bool
    keep: Tensor | None  # [b, n] bool
    flash_chunk: int = 1024  # query rows per fused forward call (the CPU kernel prefers ≥ 768)
    grad_chunk: int = 256  # query rows per explicit backward step
    max_chunk_elems: int = 1 << 24  # materialized chunks [b, h, rows, n] stay below this size
    extras: tuple[tuple[ChunkFn, int], ...] = field(default=())  # (builder, number of inputs)
    native: bool = True  # the fused C++ backward (:mod:`.native`) where it applies and builds


def antidiag_sum(x: Tensor) -> Tensor:
    """[..., C, m] (m ≥ C) -> [..., C + m − 1]: out[c] = Σ_{i + j = c} x[..., i, j]."""
    *lead, c, m = x.shape
    x = x.contiguous()
    out = x.new_zeros(*lead, c + m - 1)
    st = x.stride()[:-2]
    body = x.as_strided((*lead, c, m - c + 1), (*st, m - 1, 1), x.storage_offset() + c - 1)
    out[..., c - 1:m] = body.sum(-2)
    if c > 1:
        out[..., :c - 1] = _small_antidiag(x[..., :c - 1, :c - 1])[..., :c - 1]
        out[..., m:] = _small_antidiag(x[..., 1:, m - c + 1:])[..., c - 2:]
    return out


def _small_antidiag(a: Tensor) -> Tensor:
    """Anti-diagonal sums of a square [..., K, K] block via a skew copy: [..., 2K − 1]."""
    *lead, k, _ = a.shape
    y = a.new_zeros(*lead, k, 2 * k - 1)
    y.as_strided((*lead, k, k), (*y.stride()[:-2], 2 * k, 1)).copy_(a)
    return y.sum(-2)


def relative_chunk(n: int, window: int, scale: float, key_side: bool) -> ChunkFn:
    """Chunk builder for a query-relative term s·q_i·W[clip(j − i)] (or its key-side twin
    s·k_j·W[clip(i − j)]) over reversed keys, inputs (vec, W).

    With reversed keys both offsets are functions of x = i + j', so a chunk needs only the W
    rows its offsets reach: the query side is one matmul q_c·W_xᵀ read through a skew view; the
    key side, where the vector belongs to the key, is a banded product done in key blocks of the
    chunk's height (each block against its 2c − 1 W rows, then a skew view). About one q·kᵀ of
    work per pass and no gather, for any window up to the whole sequence."""
    from .banded import skew

    flipped: list[tuple[Tensor, Tensor]] = []

    def build(inputs: Sequence[Tensor], i0: int, i1: int, j0: int) -> Tensor:
        vec, weight = inputs
        W = weight if weight.dim() == 3 else weight.unsqueeze(0)  # [h|1, 2w+1, d]
        b, h, _, d = vec.shape
        c, m = i1 - i0, n - j0
        span = c + m - 1
        x = torch.arange(span, device=vec.device)
        offset = x + (i0 + j0 - n + 1) if key_side else (n - 1 - i0 - j0) - x
        wx = W[:, offset.clamp(-window, window) + window]  # [h|1, span, d]
        if not key_side:
            prod = (torch.matmul(vec[:, :, i0:i1], wx.transpose(-1, -2)) * scale).contiguous()
            sb, sh = prod.stride()[:2]
            return prod.as_strided((b, h, c, m), (sb, sh, span + 1, 1))
        if not flipped or flipped[0][0] is not vec:
            flipped[:] = [(vec, vec.flip(-2))]
        nb = -(-m // c)
        keys = F.pad(flipped[0][1][:, :, j0:], (0, 0, 0, nb * c - m)).view(b, h, nb, c, d)
        windows = F.pad(wx, (0, 0, 0, nb * c + c - 1 - span)).unfold(-2, 2 * c - 1, c)
        blocks = torch.matmul(keys, windows) * scale  # [b, h, nb, c keys, 2c − 1]
        band = skew(blocks, c)  # [b, h, nb, key, row] = blocks[key, key + row]
        return band.permute(0, 1, 4, 2, 3).reshape(b, h, c, nb * c)[..., :m]

    return build


def toeplitz_view(trev: Tensor, i0: int, i1: int, j0: int, j1: int) -> Tensor:
    """Bias chunk [1, h|1, i1−i0, j1−j0] = T[j − i] over rows i0…, reversed keys j0…, as a view
    of the reversed table ``trev`` [h|1, 2n − 1] (no copy)."""
    h = trev.shape[0]
    return trev.as_strided((1, h, i1 - i0, j1 - j0), (0, trev.stride(0), 1, 1),
                           trev.storage_offset() + i0 + j0)


def _chunk_rows(rows: int, geo: BiasGeometry, per_row: int, bounded: bool) -> int:
    """``rows``, lowered (to at least 16) so a [b, h, rows, n] chunk stays within the limit."""
    return max(16, min(rows, geo.max_chunk_elems // per_row)) if bounded else rows


class _Masks:
    """Builds the additive bias chunks of one call, identically in forward and backward."""

    def __init__(self, geo: BiasGeometry, n: int, trev: Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.geo, self.n, self.trev, self.dtype, self.device = geo, n, trev, dtype, device
        self.materialize = geo.keep is not None or bool(geo.extras) or trev is None
        self.keep_rev = None if geo.keep is None else geo.keep.flip(-1)

    def key_start(self, i1: int) -> int:
        """First reversed key any row < i1 may see."""
        return self.n - i1 if self.geo.causal else 0

    def build(self, extra_inputs: Sequence[Tensor], i0: int, i1: int, j0: int) -> Tensor:
        """The materialized chunk: table + extras, −inf where hidden (padding, future)."""
        n = self.n
        mask: Tensor | None = None if self.trev is None else toeplitz_view(self.trev, i0, i1, j0, n)
        at = 0
        for fn, count in self.geo.extras:
            part = fn(extra_inputs[at:at + count], i0, i1, j0)
            mask = part if mask is None else mask + part
            at += count
        if mask is None:
            mask = torch.zeros(1, 1, i1 - i0, n - j0, dtype=self.dtype, device=self.device)
        rows = torch.arange(i0, i1, device=self.device)[:, None]
        keys = n - 1 - torch.arange(j0, n, device=self.device)[None, :]  # natural key index
        allowed: Tensor | None = (keys <= rows) if self.geo.causal else None
        if self.keep_rev is not None:
            seen = self.keep_rev[:, None, None, j0:] | (keys == rows)
            allowed = seen if allowed is None else seen & allowed
        return mask if allowed is None else torch.where(allowed, mask, NEG).to(self.dtype)

    def triangle(self, c: int) -> Tensor:
        """[c, c] additive causal mask of the diagonal block in reversed-key order."""
        i = torch.arange(c, device=self.device)[:, None]
        j = torch.arange(c, device=self.device)[None, :]
        return torch.zeros(c, c, dtype=self.dtype, device=self.device).masked_fill_(j < c - 1 - i, NEG)


def _product(scratch: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """a @ b written into the front of the flat buffer ``scratch``: a chunk's [b, h, rows, n]
    products reuse one allocation per backward call, because on CPU the page faults of a fresh
    chunk-sized tensor cost about as much as the matmul that fills it."""
    shape = (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    return torch.matmul(a, b, out=scratch[:math.prod(shape)].view(shape))


def _merge(o1: Tensor, l1: Tensor, o2: Tensor, l2: Tensor) -> tuple[Tensor, Tensor]:
    lse = torch.logaddexp(l1, l2)
    return torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2, lse


class FlashBias(torch.autograd.Function):
    """softmax(q kᵀ + T[j − i] + extras, masked) v with scale 1; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, geo: BiasGeometry, q: Tensor, k: Tensor, v: Tensor, table: Tensor | None,
                *extra_inputs: Tensor) -> Tensor:
        b, h, n, _ = q.shape
        trev = None if table is None else table.flip(-1).contiguous()
        masks = _Masks(geo, n, trev, q.dtype, q.device)
        kr, vr = k.flip(-2), v.flip(-2)
        out = q.new_empty(b, h, n, v.shape[-1])
        lse = q.new_empty(b, h, n)
        rows = _chunk_rows(geo.flash_chunk, geo, b * h * n, masks.materialize)
        for i0 in range(0, n, rows):
            i1 = min(n, i0 + rows)
            qc = q[:, :, i0:i1]
            if masks.materialize:
                j0 = masks.key_start(i1)
                o, chunk_lse = flash_fwd(qc, kr[:, :, j0:], vr[:, :, j0:],
                                         mask=masks.build(extra_inputs, i0, i1, j0))
            elif not geo.causal:
                o, chunk_lse = flash_fwd(qc, kr, vr, mask=toeplitz_view(trev, i0, i1, 0, n))
            else:  # diagonal block in natural order with is_causal, the past as a view
                o, chunk_lse = flash_fwd(qc, k[:, :, i0:i1], v[:, :, i0:i1], causal=True,
                                         mask=toeplitz_view(trev, i0, i1, n - i1, n - i0).flip(-1))
                if i0:
                    o2, l2 = flash_fwd(qc, kr[:, :, n - i0:], vr[:, :, n - i0:],
                                       mask=toeplitz_view(trev, i0, i1, n - i0, n))
                    o, chunk_lse = _merge(o, chunk_lse, o2, l2)
            out[:, :, i0:i1] = o
            lse[..., i0:i1] = chunk_lse
        ctx.geo = geo
        ctx.save_for_backward(q, kr, vr, table, trev, out, lse, *extra_inputs)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        geo: BiasGeometry = ctx.geo
        q, kr, vr, table, trev, out, lse, *extra_inputs = ctx.saved_tensors
        b, h, n, _ = q.shape
        masks = _Masks(geo, n, trev, q.dtype, q.device)
        do = grad.contiguous()
        want_table = table is not None and ctx.needs_input_grad[4]
        want_extra = [ctx.needs_input_grad[5 + i] for i in range(len(extra_inputs))]
        if not want_table and not any(want_extra):
            return (None, *_fused_backward(geo, masks, q, kr, vr, extra_inputs, out, lse, do),
                    None, *[None] * len(extra_inputs))
        lib = (native.kernels() if geo.native and want_table and not masks.materialize
               and q.dtype == torch.float32 and table.dim() == 2 else None)
        if lib is not None:  # one table, nothing else: every gradient from the fused kernel
            dq, dk, dv, dtable, *_ = lib.biased_backward(q, kr.flip(-2), vr.flip(-2), table, None, None, None,
                                                         None, None, out, lse, do, geo.causal, native.BLOCK)
            return (None, dq, dk, dv, dtable)
        d = (do * out).sum(-1)
        dq = torch.empty_like(q)
        dkr, dvr = torch.zeros_like(kr), torch.zeros_like(vr)
        g = q.new_zeros(h, 2 * n - 1) if want_table else None
        leaves = [x.detach().requires_grad_(w) for x, w in zip(extra_inputs, want_extra)]
        dextra: list[Tensor | None] = [None] * len(extra_inputs)
        rows = _chunk_rows(geo.grad_chunk, geo, b * h * n, True)
        s_buf, ds_buf = (q.new_empty(b * h * min(rows, n) * n) for _ in range(2))
        for i0 in range(0, n, rows):
            i1 = min(n, i0 + rows)
            c, j0 = i1 - i0, masks.key_start(i1)
            qc, doc = q[:, :, i0:i1], do[:, :, i0:i1]
            k_, v_ = kr[:, :, j0:], vr[:, :, j0:]
            s = _product(s_buf, qc, k_.transpose(-1, -2))
            if masks.materialize:
                with torch.enable_grad():
                    mask = masks.build(leaves, i0, i1, j0)
                s += mask.detach()
            else:
                s += toeplitz_view(trev, i0, i1, j0, n)
                if geo.causal:
                    s[..., :c] += masks.triangle(c)
            p = s.sub_(lse[..., i0:i1, None]).exp_()
            ds = _product(ds_buf, doc, v_.transpose(-1, -2)).sub_(d[..., i0:i1, None]).mul_(p)
            dq[:, :, i0:i1] = torch.matmul(ds, k_)
            dkr[:, :, j0:] += torch.matmul(ds.transpose(-1, -2), qc)
            dvr[:, :, j0:] += torch.matmul(p.transpose(-1, -2), doc)
            if g is not None:
                g[:, i0 + j0:i1 + n - 1] += antidiag_sum(ds.sum(0))
            if any(want_extra):
                used = [x for x, w in zip(leaves, want_extra) if w]
                parts = torch.autograd.grad(mask, used, reduce_to(ds, mask), allow_unused=True)
                it = iter(parts)
                for i, w in enumerate(want_extra):
                    if w:
                        gi = next(it)
                        if gi is not None:
                            dextra[i] = gi if dextra[i] is None else dextra[i] + gi
        dtable = None if g is None else reduce_to(g.flip(-1), table)
        return (None, dq, dkr.flip(-2), dvr.flip(-2), dtable, *dextra)


def _fused_backward(geo: BiasGeometry, masks: _Masks, q: Tensor, kr: Tensor, vr: Tensor,
                    extra_inputs: Sequence[Tensor], out: Tensor, lse: Tensor,
                    do: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv when no bias needs a gradient: the fused kernel's backward per chunk, with the
    same bias chunks as the forward."""
    b, h, n, _ = q.shape
    dq = torch.empty_like(q)
    dkr, dvr = torch.zeros_like(kr), torch.zeros_like(vr)
    dk_nat, dv_nat = torch.zeros_like(kr), torch.zeros_like(vr)  # diagonal blocks, natural order
    trev = masks.trev
    rows = _chunk_rows(geo.flash_chunk, geo, b * h * n, masks.materialize)
    for i0 in range(0, n, rows):
        i1 = min(n, i0 + rows)
        qc, oc, lc, doc = q[:, :, i0:i1], out[:, :, i0:i1], lse[..., i0:i1], do[:, :, i0:i1]
        if masks.materialize or not geo.causal:
            j0 = masks.key_start(i1) if masks.materialize else 0
            mask = (masks.build(extra_inputs, i0, i1, j0) if masks.materialize
                    else toeplitz_view(trev, i0, i1, 0, n))
            gq, gk, gv = flash_bwd(doc, qc, kr[:, :, j0:], vr[:, :, j0:], oc, lc, mask=mask)
            dkr[:, :, j0:] += gk
            dvr[:, :, j0:] += gv
        else:
            k_nat, v_nat = kr[:, :, n - i1:n - i0].flip(-2), vr[:, :, n - i1:n - i0].flip(-2)
            gq, gk, gv = flash_bwd(doc, qc, k_nat, v_nat, oc, lc, causal=True,
                                   mask=toeplitz_view(trev, i0, i1, n - i1, n - i0).flip(-1))
            dk_nat[:, :, i0:i1] += gk
            dv_nat[:, :, i0:i1] += gv
            if i0:
                g2 = flash_bwd(doc, qc, kr[:, :, n - i0:], vr[:, :, n - i0:], oc, lc,
                               mask=toeplitz_view(trev, i0, i1, n - i0, n))
                gq = gq + g2[0]
                dkr[:, :, n - i0:] += g2[1]
                dvr[:, :, n - i0:] += g2[2]
        dq[:, :, i0:i1] = gq
    return dq, dkr.flip(-2) + dk_nat, dvr.flip(-2) + dv_nat


def flash_bias_attention(q: Tensor, k: Tensor, v: Tensor, geo: BiasGeometry, table: Tensor | None,
                         extra_inputs: Sequence[Tensor] = ()) -> Tensor:
    """Attention [b, h, n, d] (scale 1) with bias T[j − i] (``table`` [h|1, 2n − 1]) plus the
    extra chunk builders of ``geo`` applied to ``extra_inputs``."""
    return FlashBias.apply(geo, q, k, v, table, *extra_inputs)
