"""CUDA, opt-in (``fast.Policy.flex_band_grads``): the gradients of FlexAttention's windowed captured
terms from the band and two far sums per row, instead of FlexAttention's per-score atomic adds.

FlexAttention differentiates through ``score_mod`` by adding every score's gradient dS_ij into the
captured tensor entry it read, one atomic add per score. For a term that is constant beyond a
window w (query-relative products prod[i, clip(j − i, −w, w) + w], Shaw et al. 2018 / Chang et al.
Eq 5; Toeplitz tables constant for |j − i| > w: T5, the fixed convolution) every far score of a row
lands in the same entry, and those adds serialise: on an H100 (n 4096, batch 16, 4 heads of 64,
2026-11-27) FlexAttention's backward took 15.7 ms for ``dynamic_conv`` and 5.5 ms for ``t5``
against 3.4 ms for ALiBi, whose table learns nothing.

Such a term needs dS only inside the band |j − i| ≤ w and as two sums per row beyond it. With
P_ij = exp(s_ij − L_i) (L the row's log-sum-exp), dP_ij = dO_i · v_j and D_i = dO_i · O_i,

    dS_ij = P_ij (dP_ij − D_i)                                      (the band: n × (2w + 1) scores)
    Σ_{j < i − w} dS_ij = e^(L_i^< − L_i) (dO_i · O_i^< − D_i)      (and the same for j > i + w)

where O^< and L^< are the output and log-sum-exp of one more attention forward restricted to the
keys j < i − w (FlexAttention with that block mask: the far sums need no n × n tensor). A
key-side product (Huang et al. 2020) prod[j, clip(i − j, −w, w) + w] needs the same band and sums
by columns instead,

    Σ_{i < j − w} dS_ij = v_j · A_j − A'_j,   [A_j, A'_j] = Σ_{i < j − w} P_ij [dO_i, D_i]

which is one FlexAttention forward with queries and keys exchanged, ``score_mod`` minus L_i and
[dO, D] as the values: its output times e^(its log-sum-exp). So the captured tensors are read
detached (FlexAttention's backward then computes dq, dk, dv only), and :class:`BandGrads` hands
them these gradients. Terms without a window, dense biases and two-sided vectors that need a
gradient keep FlexAttention's own backward (``flex._band_applies``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# (region mask_mod or None for every key) -> (O [b, h, N, d_v], L [b, h, N]) of the attention restricted to it
Forward = Callable[[MaskMod | None], tuple[Tensor, Tensor]]
# (region mask_mod in (query i, key j), values X [b, h, N, e] by query row, L [b, h, N]) -> per key j the
# output and log-sum-exp of queries and keys exchanged: O'_j e^(L'_j) = Σ_{i in the region} P_ij X_i
Columns = Callable[[MaskMod, Tensor, Tensor], tuple[Tensor, Tensor]]
BLOCK = 128   # query rows per block of the band products


def banded(a: Tensor, c: Tensor, w: int) -> Tensor:
    """[b, h, N, 2w + 1] with entry (i, m) = a_i · c_(i + m − w) (0 where that key is outside 0 … N − 1),
    from a [b, h, N, d] and c [b, h, N, d]: per block of :data:`BLOCK` rows one product with the
    block's 128 + 2w keys, its diagonals read back by a skew (rows padded by one and re-cut). Memory
    b·h·N·(128 + 2w), never N²."""
    b, h, n, d = a.shape
    rows = min(BLOCK, n)
    nb = -(-n // rows)
    a = F.pad(a, (0, 0, 0, nb * rows - n))
    width = rows + 2 * w
    keys = F.pad(c, (0, 0, w, nb * rows - n + w)).unfold(2, width, rows)       # [b, h, nb, d, width]
    s = torch.einsum("bhnid,bhndj->bhnij", a.view(b, h, nb, rows, d), keys)   # [b, h, nb, rows, width]
    # entry (i, i + m) of each block: row i of the flat block read with rows one longer
    flat = F.pad(s.flatten(-2), (0, rows))
    band = flat.unflatten(-1, (rows, width + 1))[..., :2 * w + 1]
    return band.reshape(b, h, nb * rows, 2 * w + 1)[:, :, :n]


@dataclass
class Band:
    """What the backward needs besides the tensors: the score and mask functions FlexAttention ran
    (reading the captured tensors detached), the windows of the query-side and then the key-side
    products that need a gradient (in the order of :class:`BandGrads`' inputs), the Toeplitz table's
    window (None: no table needs a gradient), whether the attention is causal, the restricted
    forward and the exchanged one (needed only with key-side products)."""

    score_mod: ScoreMod
    mask_mod: MaskMod | None
    windows: list[int]
    table_window: int | None
    causal: bool
    forward: Forward
    key_windows: list[int] = field(default_factory=list)
    columns: Columns | None = None


def _far_sums(band: Band, w: int, dO: Tensor, D: Tensor, L: Tensor) -> tuple[Tensor, Tensor]:
    """Σ dS_ij over the keys j < i − w and over j > i + w, per row ([b, h, N] each)."""
    out = []
    for side in ("left", "right"):
        if side == "right" and band.causal:
            out.append(torch.zeros_like(D))
            continue

        def region(bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor, side: str = side) -> Tensor:
            return ki < qi - w if side == "left" else ki > qi + w

        o_far, l_far = band.forward(region)
        seen = torch.isfinite(l_far)        # a row with no key there: no sum
        scale = torch.where(seen, torch.exp(torch.where(seen, l_far, 0.0) - L), 0.0)
        out.append(scale * ((dO * o_far.float()).sum(-1) - D))
    return out[0], out[1]


def _far_column_sums(band: Band, w: int, v: Tensor, dO: Tensor, D: Tensor, L: Tensor) -> tuple[Tensor, Tensor]:
    """Σ dS_ij over the queries i < j − w and over i > j + w, per key j ([b, h, N] each)."""
    if band.columns is None:
        raise ValueError("flex_band: key-side products need Band.columns")
    width = dO.shape[-1]
    # [dO, D] as the values, zero-padded to a power of two wide (FlexAttention's head sizes)
    values = F.pad(torch.cat([dO, D[..., None]], -1), (0, _power_of_two(width + 1) - width - 1))
    out = []
    for side in ("left", "right"):
        if side == "left" and band.causal:   # a causal key j has no query i < j
            out.append(torch.zeros_like(D))
            continue

        def region(bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor, side: str = side) -> Tensor:
            return qi < ki - w if side == "left" else qi > ki + w

        o_t, l_t = band.columns(region, values.to(v.dtype), L)
        seen = torch.isfinite(l_t)
        agg = o_t.float() * torch.where(seen, torch.exp(torch.where(seen, l_t, 0.0)), 0.0)[..., None]
        out.append((v.float() * agg[..., :width]).sum(-1) - agg[..., width])
    return out[0], out[1]


def _power_of_two(x: int) -> int:
    return 1 << (x - 1).bit_length()


def band_gradients(band: Band, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   dO: Tensor) -> tuple[list[Tensor], Tensor | None]:
    """The gradients of the products ([b, h, N, 2w + 1] each: ``band.windows`` then
    ``band.key_windows``) and of the Toeplitz table ([h, 2N − 1], None without one) from q, k, v as
    FlexAttention took them ([b, h, N, ·], scale folded into q), its output ``o``, log-sum-exp
    ``lse`` and the output's gradient ``dO``."""
    b, h, n, _ = q.shape
    widest = max([*band.windows, *band.key_windows, band.table_window or 0])
    dO, o, L = dO.float(), o.float(), lse.float()
    D = (dO * o).sum(-1)
    dev = q.device
    qi = torch.arange(n, device=dev)[:, None]
    ki = qi + torch.arange(-widest, widest + 1, device=dev)           # [N, 2W + 1]
    inside = (ki >= 0) & (ki < n)
    kc = ki.clamp(0, n - 1)
    bi = torch.arange(b, device=dev).view(b, 1, 1, 1)
    hi = torch.arange(h, device=dev).view(1, h, 1, 1)
    s = band.score_mod(banded(q.float(), k.float(), widest), bi, hi, qi, kc)
    keep = inside if band.mask_mod is None else inside & band.mask_mod(bi, hi, qi, kc)
    p = torch.where(keep, torch.exp(s - L[..., None]), 0.0)
    ds = p * (banded(dO, v.float(), widest) - D[..., None])            # [b, h, N, 2W + 1]
    far: dict[int, tuple[Tensor, Tensor]] = {}
    for w in {*band.windows, *([band.table_window] if band.table_window is not None else [])}:
        far[w] = _far_sums(band, w, dO, D, L)
    prods = []
    for w in band.windows:
        g = ds[..., widest - w:widest + w + 1].clone()
        g[..., 0] += far[w][0]
        g[..., -1] += far[w][1]
        prods.append(g)
    rows = torch.arange(n, device=dev)[:, None]
    for w in band.key_windows:   # prod[j, m] holds the score (i, j) with i − j = m − w: j − i = w − m
        i = rows + torch.arange(-w, w + 1, device=dev)                      # [N (key j), 2w + 1]
        slot = torch.arange(w, -w - 1, -1, device=dev) + widest               # the band column of j − i
        g = torch.where((i >= 0) & (i < n), ds[:, :, i.clamp(0, n - 1), slot], 0.0)
        left, right = _far_column_sums(band, w, v, dO, D, L)
        g[..., 0] += left
        g[..., -1] += right
        prods.append(g)
    table = None
    if band.table_window is not None:
        w = band.table_window
        table = ds.new_zeros(h, 2 * n - 1)
        table[:, n - 1 - w:n + w] = ds[..., widest - w:widest + w + 1].sum((0, 2))
        table[:, n - 2 - w] = far[w][0].sum((0, 2))     # offset −(w + 1): every far-left score
        table[:, n + w] = far[w][1].sum((0, 2))         # offset w + 1: every far-right score
    return prods, table


class BandGrads(torch.autograd.Function):
    """The identity on FlexAttention's output whose backward also returns the gradients of the
    captured tensors (:func:`band_gradients`): inputs (o, lse, q, k, v, band, table or None,
    product, ...)."""

    @staticmethod
    def forward(ctx, o: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor,  # type: ignore[override]
                band: Band, table: Tensor | None, *prods: Tensor) -> Tensor:
        ctx.save_for_backward(o, lse, q, k, v)
        ctx.band = band
        ctx.has_table = table is not None
        ctx.shapes = [(p.shape, p.dtype) for p in prods]
        ctx.table_meta = (table.shape, table.dtype) if table is not None else None
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        o, lse, q, k, v = ctx.saved_tensors
        with torch.no_grad():
            prods, table = band_gradients(ctx.band, q.detach(), k.detach(), v.detach(), o, lse, grad)
        d_table = table.to(ctx.table_meta[1]).expand(ctx.table_meta[0]) if ctx.has_table else None
        d_prods = [g.to(dtype).expand(shape) for g, (shape, dtype) in zip(prods, ctx.shapes)]
        return (grad, None, None, None, None, None, d_table, *d_prods)


def attend(flex: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, score_mod: ScoreMod,
           mask_mod: MaskMod | None, block_mask: object, batch: int | None, causal: bool,
           options: dict[str, object] | None, table: Tensor | None, table_window: int | None,
           prods: list[tuple[Tensor, int]], key_prods: list[tuple[Tensor, int]]) -> Tensor:
    """FlexAttention (``flex``, compiled) over q, k, v [b, h, N, ·] with ``score_mod`` reading the
    captured tensors detached and ``block_mask`` (from ``mask_mod``, per batch row when ``batch``),
    whose output hands the learned ``table`` (window ``table_window``) and query-/key-side
    ``prods`` ((product, window), the tensors ``score_mod`` reads detached) their gradients through
    :class:`BandGrads`."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    n = q.shape[-2]

    def mask(region: MaskMod) -> object:
        return create_block_mask(region, batch, None, n, n, device=q.device)

    def restricted(region: MaskMod | None) -> tuple[Tensor, Tensor]:
        """Output and log-sum-exp of the attention over the keys ``region`` also allows."""
        both = region if mask_mod is None or region is None else (
            lambda bi, hi, qi, ki: mask_mod(bi, hi, qi, ki) & region(bi, hi, qi, ki))
        out, aux = flex(q.detach(), k.detach(), v.detach(), score_mod=score_mod, scale=1.0, kernel_options=options,
                        block_mask=None if both is None else mask(both), return_aux=AuxRequest(lse=True))
        return out, aux.lse

    def exchanged(region: MaskMod, values: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
        """Queries and keys exchanged, ``score_mod`` minus the rows' log-sum-exp ``lse``, over the
        (query, key) pairs ``region`` and the mask allow: per key, the output over ``values`` (by
        query row) and its log-sum-exp."""
        def score_t(score: Tensor, bi: Tensor, hi: Tensor, kj: Tensor, qi: Tensor) -> Tensor:
            return score_mod(score, bi, hi, qi, kj) - lse[bi, hi, qi]

        def mask_t(bi: Tensor, hi: Tensor, kj: Tensor, qi: Tensor) -> Tensor:
            inside = region(bi, hi, qi, kj)
            return inside if mask_mod is None else inside & mask_mod(bi, hi, qi, kj)

        out, aux = flex(k.detach(), q.detach(), values, score_mod=score_t, block_mask=mask(mask_t), scale=1.0,
                        kernel_options=options, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    o, aux = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0, kernel_options=options,
                  return_aux=AuxRequest(lse=True))
    band = Band(score_mod, mask_mod, [w for _, w in prods], table_window, causal, restricted,
                [w for _, w in key_prods], exchanged)
    return BandGrads.apply(o, aux.lse, q, k, v, band, table, *[p for p, _ in prods + key_prods])
