"""Depthwise 1-D convolution along the sequence, shared by depthwise_conv, conv_qkv and cat.

    y[t, c] = Σ_m w[c, m] · x[t + m − p, c]      (x = 0 outside the sequence and at padding)

with p = K − 1 for a causal filter (only the past and present) and p = (K − 1)/2 for a
centered one (K odd). ``weight`` is [C, K], or [K] for one filter shared by all channels.

Four exact algorithms, picked by kernel length and input (:func:`conv_method`; CPU timings in
``posattn bench --conv``): on a float32 CPU input where posattn's C++ kernels build
(:mod:`posattn.attention.native`), one vectorised pass in [b, n, C] (``native``); otherwise
shift-and-add in [b, n, C] for the shortest kernels (no transposes), grouped ``Conv1d`` for short
and medium ones; FFT for long filters in any case (O(n log n) instead of O(n·K); equal to the
direct sum up to floating-point rounding). Off the CPU, with the fast-path policy's
``compiled_conv``, the shift-and-add runs through ``torch.compile`` (``compiled``): its K
multiply-adds, the padding and their backward each become one fused kernel, where eager runs
about a dozen memory-bound kernels per filtered tensor (CAT's encoder on an H100 spent a third of
its step in them).

In a packed row (``documents``) x is also 0 outside token t's own document: each document is
convolved as if it ran alone. The tokens are placed apart with enough zero slots between
documents that no tap reaches the next one (:class:`~.documents.DocumentSlots`), so every
algorithm above serves packed rows unchanged.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import native
from ..errors import PositionError
from .documents import DocumentSlots

Method = Literal["shift", "conv1d", "fft", "native", "compiled"]
SHIFT_MAX = 4  # kernels up to this length: shift-and-add
FFT_MIN = 112  # kernels from this length: FFT


def conv_method(k: int, x: Tensor | None = None) -> Method:
    """The fastest exact algorithm for a kernel of length ``k`` (on input ``x``)."""
    if k >= FFT_MIN:
        return "fft"
    if x is not None and _native_ok(x):
        return "native"
    if k <= SHIFT_MAX and x is not None and _compiled_ok(x):
        return "compiled"
    return "shift" if k <= SHIFT_MAX else "conv1d"


def _compiled_ok(x: Tensor) -> bool:
    from ..attention.fast import policy_for  # the attention package imports the mechanisms' modules

    return x.device.type != "cpu" and policy_for(x.device).compiled_conv  # conv_compiled: eager inside a compiled step


def _native_ok(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and native.kernels() is not None


def conv_shift(x: Tensor, w: Tensor, left: int) -> Tensor:
    """Σ_m w[:, m] · x[t + m − left] as K shifted multiply-adds ([b, n, C] throughout)."""
    n, k = x.shape[1], w.shape[-1]
    xp = F.pad(x, (0, 0, left, k - 1 - left))
    y = xp[:, :n] * w[:, 0]
    for m in range(1, k):
        y = torch.addcmul(y, xp[:, m:m + n], w[:, m])
    return y


def _grouped(xt: Tensor, w: Tensor) -> Tensor:
    """Grouped ``Conv1d`` of a padded, channels-first xt [b, C, n + K − 1] with w [C, K]."""
    return F.conv1d(xt, w.unsqueeze(1), groups=w.shape[0])


def _channels_first(x: Tensor, left: int, right: int) -> Tensor:
    return F.pad(x.transpose(1, 2), (left, right)).contiguous()


class _DepthwiseConv(torch.autograd.Function):
    """Grouped ``Conv1d`` with a hand-written backward (PyTorch's CPU backward of a depthwise
    convolution takes ~5× its forward). ∂x is the same convolution of the gradient with the
    flipped filter (left ↔ K − 1 − left); ∂w[c, m] = Σ_{b,t} g[b, c, t] · x[b, c, t + m − left]
    is one grouped convolution of x with g as the kernel, batch folded into the groups."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, left: int) -> Tensor:
        xt = _channels_first(x, left, w.shape[-1] - 1 - left)
        ctx.save_for_backward(xt, w)
        ctx.left = left
        return _grouped(xt, w).transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        xt, w = ctx.saved_tensors
        (b, c, _), k, left = xt.shape, w.shape[-1], ctx.left
        gt = g.transpose(1, 2).contiguous()  # [b, C, n]
        gx = gw = None
        # under autocast the forward ran in a lower precision that the backward does not see: compute
        # in the gradient's dtype and return each gradient in its input's dtype
        if ctx.needs_input_grad[0]:
            gx = _grouped(F.pad(gt, (k - 1 - left, left)), w.flip(-1).to(gt.dtype)).transpose(1, 2).to(xt.dtype)
        if ctx.needs_input_grad[1]:
            gw = F.conv1d(xt.to(gt.dtype).view(1, b * c, -1), gt.view(b * c, 1, -1), groups=b * c)
            gw = gw.view(b, c, k).sum(0).to(w.dtype)
        return gx, gw, None


def conv_direct(x: Tensor, w: Tensor, left: int) -> Tensor:
    """The same with a grouped ``Conv1d`` (one group per channel), :class:`_DepthwiseConv`."""
    return _DepthwiseConv.apply(x, w, left)


class _NativeDepthwise(torch.autograd.Function):
    """The C++ kernel (``csrc/depthwise_conv.cpp``): forward, ∂x and ∂w each one pass in [b, n, C]."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, left: int) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.left = left
        return native.kernels().depthwise_forward(x, w, left)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w = ctx.saved_tensors
        gx, gw = native.kernels().depthwise_backward(g, x, w, ctx.left)
        return gx, gw, None


def conv_native(x: Tensor, w: Tensor, left: int) -> Tensor:
    """The same in one C++ pass per direction (float32 CPU; needs :func:`native.kernels`)."""
    if not _native_ok(x):
        raise PositionError("conv_native needs a float32 CPU input and posattn's C++ kernels "
                            "(posattn.attention.native), which are not available here")
    return _NativeDepthwise.apply(x, w.contiguous(), left)


def conv_fft(x: Tensor, w: Tensor, left: int) -> Tensor:
    """The same by FFT: y = (x ∗ flip(w))[t + K − 1 − left], zero-padded so nothing wraps."""
    n, k = x.shape[1], w.shape[-1]
    size = n + k - 1
    size = 1 << (size - 1).bit_length() if size & (size - 1) else size
    spec = torch.fft.rfft(x, size, dim=1) * torch.fft.rfft(w.flip(-1).T, size, dim=0)
    start = k - 1 - left
    return torch.fft.irfft(spec, size, dim=1)[:, start:start + n]


def conv_compiled(x: Tensor, w: Tensor, left: int) -> Tensor:
    """:func:`conv_shift` through ``torch.compile`` (one kernel forward, fused backward; one
    compiled graph per shape, as FlexAttention's). Inside a compiled step the shift-and-add
    itself: the step's compiler fuses it there."""
    if torch.compiler.is_compiling():
        return conv_shift(x, w, left)
    from ..runtime.compile import compiled_piece

    return compiled_piece(conv_shift)(x, w, left)


METHODS: dict[str, Callable[[Tensor, Tensor, int], Tensor]] = {
    "shift": conv_shift, "conv1d": conv_direct, "fft": conv_fft, "native": conv_native, "compiled": conv_compiled}


def depthwise_conv1d(x: Tensor, weight: Tensor, causal: bool, keep: Tensor | None = None,
                     documents: Tensor | None = None) -> Tensor:
    """Convolve x [b, n, C] along n; padded positions (keep False) are zeroed first; with
    ``documents`` ([b, n] ids of a packed row) no tap reads across a document boundary."""
    c, k = x.shape[-1], weight.shape[-1]
    if not causal and k % 2 == 0:
        raise PositionError(f"a centered convolution needs an odd kernel size, got {k}")
    if keep is not None:
        x = x * keep[..., None].to(x.dtype)
    w = (weight.expand(c, k) if weight.dim() == 1 else weight).to(x.dtype)
    left = k - 1 if causal else (k - 1) // 2
    if documents is None:
        return METHODS[conv_method(k, x)](x, w, left)
    slots = DocumentSlots.build(documents, x.shape[1], x.shape[0], x.device, gap=max(left, k - 1 - left))
    spread = slots.place(x, 1)
    return slots.take(METHODS[conv_method(k, spread)](spread, w, left), 1)


def heads_to_channels(t: Tensor) -> Tensor:
    """[b, h, n, d] -> [b, n, h·d]."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def channels_to_heads(t: Tensor, h: int) -> Tensor:
    """[b, n, h·d] -> [b, h, n, d]."""
    b, n, c = t.shape
    return t.view(b, n, h, c // h).transpose(1, 2)
