"""Exact attention for score terms that are constant outside a window, in linear memory (CPU).

Clipped relative terms (fixed_conv, dynamic_conv, composite, key_dynamic_conv, T5 beyond its
max_distance, narrow TISA kernels) only vary for |j − i| ≤ w. Per query row the keys split in
three, each with a structure the fused kernel handles:

    band   |j − i| ≤ w :  s_ij = q_i·k_j + B[i, j − i + w]            explicit, [b, h, n, 2w+1]
    left   j < i − w   :  s_ij = (q_i + α_L)·(k_j + β_L) + c_L         one causal flash call
    right  j > i + w   :  s_ij = (q_i + α_R)·(k_j + β_R) + c_R         one causal flash call on
                                                                     the reversed sequence

The left keys of row i are exactly keys 0 … i−w−1, so ``q[w+1:]`` against ``k[:n−w−1]`` with
``is_causal`` covers the whole left region in one fused call (the right one likewise after
reversing the sequence). A query-side term q_i·u outside the window folds into the key shift
β = u, a key-side term u·k_j into the query shift α = u, a per-head constant into c, which
only moves that piece's log-sum-exp. The three pieces merge by log-sum-exp; each piece's
backward gets the merged output and log-sum-exp, so its gradients are exact; the constants'
gradients come in closed form: Σ_ij dS_ij = Σ_j v_j·dv_j − Σ_i D_i·exp(lse_piece,i − lse_i).

The band is computed in query blocks of ``chunk`` rows against ``chunk + 2w`` keys, and read
off each block as a strided (skew) view, so no n×n tensor is ever built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .kernels import flash_bwd, flash_fwd, key_bias, reduce_to

NEG = float("-inf")


@dataclass(frozen=True)
class BandGeometry:
    """Static description of one banded attention call."""

    window: int
    causal: bool
    keep: Tensor | None  # [b, n] bool, True = real token
    chunk: int  # query rows per band block


def skew(block: Tensor, width: int) -> Tensor:
    """View a contiguous [..., c, c + width − 1] block as its band: out[..., i, r] = block[..., i, i + r]."""
    m = block.shape[-1]
    return block.as_strided((*block.shape[:-1], width), (*block.stride()[:-2], m + 1, 1))


def _rows(x: Tensor, rows: int) -> Tensor:
    """Zero-pad (or cut) dim −2 of x to ``rows``."""
    return F.pad(x, (0, 0, 0, rows - x.shape[-2]))


def _spans(n: int, chunk: int, per_row: int) -> list[tuple[int, int]]:
    """Row ranges of whole blocks, each holding at most about 2^22 block elements."""
    step = max(chunk, (1 << 22) // per_row // chunk * chunk)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def band_dot(x: Tensor, yp: Tensor, w: int, chunk: int) -> Tensor:
    """[b, h, n, 2w+1] with out[i, r] = x_i · yp_{i+r} (yp = y zero-padded by w rows each side).

    Rows go in blocks of ``chunk`` (≥ 2w) against their chunk + 2w keys, all blocks of a span
    in one batched matmul; the band is a skew view of each block."""
    b, h, n, d = x.shape
    width, span = 2 * w + 1, chunk + 2 * w
    out = x.new_empty(b, h, n, width)
    for a, e in _spans(n, chunk, b * h * span):
        nb = -(-(e - a) // chunk)
        xb = _rows(x[:, :, a:e], nb * chunk).view(b, h, nb, chunk, d)
        yb = _rows(yp[:, :, a:e + 2 * w], nb * chunk + 2 * w).unfold(2, span, chunk)
        blocks = torch.matmul(xb, yb)  # [b, h, nb, chunk, span]
        out[:, :, a:e] = skew(blocks, width).reshape(b, h, nb * chunk, width)[:, :, :e - a]
    return out


def _scatter_band(p: Tensor, nb: int, chunk: int) -> Tensor:
    """Zero blocks [b, h, nb, chunk, chunk + 2w] holding the band p [b, h, ≤ nb·chunk, 2w+1]."""
    b, h, _, width = p.shape
    z = p.new_zeros(b, h, nb, chunk, chunk + width - 1)
    skew(z, width).copy_(_rows(p, nb * chunk).view(b, h, nb, chunk, width))
    return z


def band_apply(p: Tensor, yp: Tensor, w: int, chunk: int) -> Tensor:
    """[b, h, n, d] with out_i = Σ_r p[i, r] · yp_{i+r}."""
    b, h, n, _ = p.shape
    span = chunk + 2 * w
    out = p.new_empty(b, h, n, yp.shape[-1])
    for a, e in _spans(n, chunk, b * h * span):
        nb = -(-(e - a) // chunk)
        z = _scatter_band(p[:, :, a:e], nb, chunk)
        yb = _rows(yp[:, :, a:e + 2 * w], nb * chunk + 2 * w).unfold(2, span, chunk).transpose(-1, -2)
        out[:, :, a:e] = torch.matmul(z, yb).reshape(b, h, nb * chunk, -1)[:, :, :e - a]
    return out


def band_apply_t(p: Tensor, x: Tensor, w: int, chunk: int) -> Tensor:
    """The transpose of :func:`band_apply`: [b, h, n + 2w, d] with out_{i+r} += p[i, r] · x_i."""
    b, h, n, _ = p.shape
    d = x.shape[-1]
    span = chunk + 2 * w
    out = x.new_zeros(b, h, n + 2 * chunk, d)
    for a, e in _spans(n, chunk, b * h * span):
        nb = -(-(e - a) // chunk)
        z = _scatter_band(p[:, :, a:e], nb, chunk)
        xb = _rows(x[:, :, a:e], nb * chunk).view(b, h, nb, chunk, d)
        part = torch.matmul(z.transpose(-1, -2), xb)  # [b, h, nb, span, d]
        out[:, :, a:a + nb * chunk] += part[..., :chunk, :].reshape(b, h, nb * chunk, d)
        tail = out[:, :, a + chunk:a + (nb + 1) * chunk].view(b, h, nb, chunk, d)
        tail[..., :2 * w, :] += part[..., chunk:, :]
    return out[:, :, :n + 2 * w]


def band_mask(n: int, w: int, causal: bool, keep: Tensor | None, dtype: torch.dtype,
              device: torch.device) -> Tensor:
    """Additive [b|1, 1, n, 2w+1] mask of the band: −inf outside the sequence, in the future
    (causal) and at padding keys (a query always sees itself)."""
    r = torch.arange(2 * w + 1, device=device)
    j = torch.arange(n, device=device)[:, None] + r - w
    bad = (j < 0) | (j >= n)
    if causal:
        bad = bad | (r > w)
    if keep is not None:
        seen = F.pad(keep, (w, w)).unfold(1, 2 * w + 1, 1) | (r == w)  # [b, n, 2w+1]
        bad = bad | ~seen
    mask = torch.zeros(bad.shape, dtype=dtype, device=device).masked_fill_(bad, NEG)
    return mask[:, None] if mask.dim() == 3 else mask[None, None]


def _shift(x: Tensor, s: Tensor | None) -> Tensor:
    return x if s is None else x + s


def _flip(x: Tensor) -> Tensor:
    return x.flip(-2)


class _Pieces:
    """The left and right pieces' inputs, rebuilt identically in forward and backward."""

    def __init__(self, geo: BandGeometry, q: Tensor, k: Tensor, v: Tensor,
                 shifts: tuple[Tensor | None, ...]) -> None:
        n, w = q.shape[-2], geo.window
        m = n - w - 1
        al, ar, bl, br = shifts
        kb = None if geo.keep is None else key_bias(geo.keep, q.dtype)
        self.m = m
        self.left = (_shift(q[:, :, w + 1:], al), _shift(k[:, :, :m], bl), v[:, :, :m],
                     None if kb is None else kb[..., :m])
        self.right = None
        if not geo.causal:
            self.right = (_flip(_shift(q[:, :, :m], ar)), _flip(_shift(k[:, :, w + 1:], br)),
                          _flip(v[:, :, w + 1:]), None if kb is None else kb[..., w + 1:].flip(-1))


def _empty_rows(keep: Tensor | None, w: int, m: int) -> tuple[Tensor | None, Tensor | None]:
    """[b, 1, m] bool: rows whose left (right) keys are all padding."""
    if keep is None:
        return None, None
    count = keep.long().cumsum(-1)
    left = count[:, :m] == 0
    right = (count[:, -1:] - count[:, w:w + m]) == 0
    return left[:, None], right[:, None]


def _lse_piece(lse: Tensor, c: Tensor | None, empty: Tensor | None) -> Tensor:
    if c is not None:
        lse = lse + c[..., None]
    return lse if empty is None else lse.masked_fill(empty, NEG)


def _const_grad(vp: Tensor, dvp: Tensor, d: Tensor, lse_p: Tensor, lse: Tensor) -> Tensor:
    """Σ over a piece of dS_ij, per batch and head (the gradient of a constant added to it)."""
    return (vp * dvp).sum((-1, -2)) - (d * torch.exp(lse_p - lse)).sum(-1)


class BandedAttention(torch.autograd.Function):
    """softmax over the three pieces; see the module docstring. Scale is 1 (pre-scale q)."""

    @staticmethod
    def forward(ctx: Any, geo: BandGeometry, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                cl: Tensor | None, cr: Tensor | None, al: Tensor | None, ar: Tensor | None,
                bl: Tensor | None, br: Tensor | None) -> Tensor:
        n, w, c = q.shape[-2], geo.window, geo.chunk
        pieces = _Pieces(geo, q, k, v, (al, ar, bl, br))
        m = pieces.m
        empty_l, empty_r = _empty_rows(geo.keep, w, m)
        kp, vp = F.pad(k, (0, 0, w, w)), F.pad(v, (0, 0, w, w))
        s = band_dot(q, kp, w, c)
        if bias is not None:
            s += bias
        s += band_mask(n, w, geo.causal, geo.keep, q.dtype, q.device)
        lse = torch.logsumexp(s, -1)
        o_l, lse_l = flash_fwd(*pieces.left[:3], causal=True, mask=pieces.left[3])
        lse_l = _lse_piece(lse_l, cl, empty_l)
        lse[..., w + 1:] = torch.logaddexp(lse[..., w + 1:], lse_l)
        lse_r = o_r = None
        if pieces.right is not None:
            o_r, lse_r = flash_fwd(*pieces.right[:3], causal=True, mask=pieces.right[3])
            o_r, lse_r = _flip(o_r), _lse_piece(lse_r.flip(-1), cr, empty_r)
            lse[..., :m] = torch.logaddexp(lse[..., :m], lse_r)
        p = s.sub_(lse[..., None]).exp_()
        out = band_apply(p, vp, w, c)
        out[:, :, w + 1:] += torch.exp(lse_l - lse[..., w + 1:])[..., None] * o_l
        if o_r is not None:
            out[:, :, :m] += torch.exp(lse_r - lse[..., :m])[..., None] * o_r
        ctx.geo = geo
        ctx.save_for_backward(q, k, v, bias, cl, cr, al, ar, bl, br, out, lse, lse_l, lse_r, p)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        geo: BandGeometry = ctx.geo
        q, k, v, bias, cl, cr, al, ar, bl, br, out, lse, lse_l, lse_r, p = ctx.saved_tensors
        w, c, n = geo.window, geo.chunk, q.shape[-2]
        do = grad.contiguous()
        d = (do * out).sum(-1)
        kp, vp = F.pad(k, (0, 0, w, w)), F.pad(v, (0, 0, w, w))
        ds = band_dot(do, vp, w, c).sub_(d[..., None]).mul_(p)
        dq = band_apply(ds, kp, w, c)
        dk = band_apply_t(ds, q, w, c)[:, :, w:w + n]
        dv = band_apply_t(p, do, w, c)[:, :, w:w + n]
        pieces = _Pieces(geo, q, k, v, (al, ar, bl, br))
        m = pieces.m
        grads: dict[str, Tensor | None] = dict.fromkeys(("cl", "cr", "al", "ar", "bl", "br"))
        ql, kl, vl, ml = pieces.left
        lse_in = lse[..., w + 1:] if cl is None else lse[..., w + 1:] - cl[..., None]
        gq, gk, gv = flash_bwd(do[:, :, w + 1:], ql, kl, vl, out[:, :, w + 1:], lse_in.contiguous(),
                               causal=True, mask=ml)
        dq[:, :, w + 1:] += gq
        dk[:, :, :m] += gk
        dv[:, :, :m] += gv
        if cl is not None and ctx.needs_input_grad[5]:
            grads["cl"] = reduce_to(_const_grad(vl, gv, d[..., w + 1:], lse_l, lse[..., w + 1:]), cl)
        grads["al"] = None if al is None else reduce_to(gq.sum(-2, keepdim=True), al)
        grads["bl"] = None if bl is None else reduce_to(gk.sum(-2, keepdim=True), bl)
        if pieces.right is not None:
            qr, kr, vr, mr = pieces.right
            lse_in = lse[..., :m] if cr is None else lse[..., :m] - cr[..., None]
            gq, gk, gv = (_flip(g) for g in flash_bwd(
                _flip(do[:, :, :m]), qr, kr, vr, _flip(out[:, :, :m]), lse_in.flip(-1).contiguous(),
                causal=True, mask=mr))
            dq[:, :, :m] += gq
            dk[:, :, w + 1:] += gk
            dv[:, :, w + 1:] += gv
            if cr is not None and ctx.needs_input_grad[6]:
                grads["cr"] = reduce_to(_const_grad(_flip(vr), gv, d[..., :m], lse_r, lse[..., :m]), cr)
            grads["ar"] = None if ar is None else reduce_to(gq.sum(-2, keepdim=True), ar)
            grads["br"] = None if br is None else reduce_to(gk.sum(-2, keepdim=True), br)
        dbias = None if bias is None or not ctx.needs_input_grad[4] else reduce_to(ds, bias)
        return (None, dq, dk, dv, dbias, grads["cl"], grads["cr"], grads["al"], grads["ar"],
                grads["bl"], grads["br"])


def banded_attention(q: Tensor, k: Tensor, v: Tensor, geo: BandGeometry, bias: Tensor | None = None,
                     c_left: Tensor | None = None, c_right: Tensor | None = None,
                     a_left: Tensor | None = None, a_right: Tensor | None = None,
                     b_left: Tensor | None = None, b_right: Tensor | None = None) -> Tensor:
    """Attention [b, h, n, d] (scale 1) with the band, left and right terms of the module docstring.

    ``bias`` [b|1, h|1, n|1, 2w+1] is the band term B; ``c_*`` [b|1, h|1] per-head constants;
    ``a_*`` / ``b_*`` [b|1, h|1, 1, d] query / key shifts. Needs n ≥ w + 2.
    """
    return BandedAttention.apply(geo, q, k, v, bias, c_left, c_right, a_left, a_right, b_left, b_right)
