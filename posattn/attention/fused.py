"""Exact attention with relative-position terms in one fused C++ kernel per direction (CPU).

For learned Toeplitz tables, clipped query/key-relative terms (T5, TISA, DIET-REL, fixed,
dynamic, key-dynamic and composite convolutions, Shaw et al.), low-rank terms (segment
embeddings, causal ALiBi) and two-sided separable terms (the forget gates of an encoder) the
kernels of :mod:`.native` add the bias to each block of q·kᵀ from the terms' small inputs (a
[h, 2n − 1] table, [b, h, n, 2w + 1] bands of q·W[r], [b, h, n, r] factors u and v, [b, h, n]
vectors a, x, b, y) and reduce dS into their gradients in the same pass (kernel header:
``csrc/biased_attention.cpp``). Nothing n×n is materialised; the bands' own gradients (to q, k
and W) are autograd's, through :meth:`QueryRelative.products`.

Terms of one kind are summed; query-side (or key-side) bands with different windows are widened
to the widest first, exactly: a clipped band repeats its edge values, W[clip(r, −w, w)].
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import native
from .terms import Term


def widen(band: Tensor, window: int) -> Tensor:
    """[..., 2w + 1] -> [..., 2·window + 1] with the edge values repeated (the clipped term)."""
    w = band.shape[-1] // 2
    if w == window:
        return band
    idx = (torch.arange(-window, window + 1, device=band.device).clamp(-w, w) + w)
    return band.index_select(-1, idx)


def kernel_inputs(terms: list[Term]) -> dict[str, Tensor]:
    """``table``, ``qband``, ``kband``, ``sided``, each summed over the terms of its kind, and
    ``lowrank``, the low-rank terms' factors concatenated along the rank (Σ_t u_t·v_t =
    [u_1, u_2]·[v_1, v_2]) (every term :meth:`~Term.fusable`)."""
    grouped: dict[str, list[Tensor]] = {}
    for t in terms:
        name, x = t.kernel_input()
        grouped.setdefault(name, []).append(x)
    out = {}
    for name, xs in grouped.items():
        if name == "lowrank":
            lead = torch.broadcast_shapes(*(x.shape[:-1] for x in xs))
            out[name] = torch.cat([x.expand(*lead, x.shape[-1]) for x in xs], -1)
        elif name == "sided":  # a, x, b, y of two terms add up: separable on each side
            out[name] = sum(xs[1:], xs[0])
        else:  # tables all span 2n − 1 offsets: widening leaves them as they are
            window = max(x.shape[-1] // 2 for x in xs)
            out[name] = sum(widen(x, window) for x in xs)
    return out


class FusedBias(torch.autograd.Function):
    """softmax(q kᵀ + table + bands) v with scale 1; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, causal: bool, keep: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                table: Tensor | None, qband: Tensor | None, kband: Tensor | None,
                lowrank: Tensor | None, sided: Tensor | None) -> Tensor:
        lib = native.kernels()
        assert lib is not None, "the fused path is planned only where the kernels built"
        out, lse = lib.biased_forward(q, k, v, table, qband, kband, lowrank, sided, keep, causal, native.BLOCK)
        ctx.causal, ctx.keep = causal, keep
        ctx.save_for_backward(q, k, v, table, qband, kband, lowrank, sided, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, table, qband, kband, lowrank, sided, out, lse = ctx.saved_tensors
        lib = native.kernels()
        grads = lib.biased_backward(q, k, v, table, qband, kband, lowrank, sided, ctx.keep, out, lse, grad,
                                    ctx.causal, native.BLOCK)
        return (None, None, *grads)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, inputs: dict[str, Tensor], keep: Tensor | None,
                    causal: bool) -> Tensor:
    """Attention [b, h, n, d_v] (scale 1) with the bias of :func:`kernel_inputs`, padding keys
    (``keep`` [b, n] False) hidden."""
    b, h, n, _ = q.shape
    lowrank, sided = inputs.get("lowrank"), inputs.get("sided")
    if lowrank is not None:  # the kernel reads one [u, v] pair per (batch, head)
        lowrank = lowrank.expand(2, b, h, n, lowrank.shape[-1]).to(q.dtype)
    if sided is not None:  # ... and one (a, x, b, y)
        sided = sided.expand(4, b, h, n).to(q.dtype)
    return FusedBias.apply(causal, keep, q, k, v, inputs.get("table"), inputs.get("qband"), inputs.get("kband"),
                           lowrank, sided)
