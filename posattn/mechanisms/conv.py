"""Depthwise 1-D convolution along the sequence, shared by depthwise_conv, conv_qkv and cat.

    y[t, c] = Σ_m w[c, m] · x[t + m − p, c]      (x = 0 outside the sequence and at padding)

with p = K − 1 for a causal filter (only the past and present) and p = (K − 1)/2 for a
centered one (K odd). ``weight`` is [C, K], or [K] for one filter shared by all channels.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..errors import PositionError


def depthwise_conv1d(x: Tensor, weight: Tensor, causal: bool, keep: Tensor | None = None) -> Tensor:
    """Convolve x [b, n, C] along n; padded positions (keep False) are zeroed first."""
    b, n, c = x.shape
    k = weight.shape[-1]
    if not causal and k % 2 == 0:
        raise PositionError(f"a centered convolution needs an odd kernel size, got {k}")
    if keep is not None:
        x = x * keep[..., None].to(x.dtype)
    w = weight.expand(c, k) if weight.dim() == 1 else weight
    left = k - 1 if causal else (k - 1) // 2
    xt = F.pad(x.transpose(1, 2), (left, k - 1 - left))
    return F.conv1d(xt, w.unsqueeze(1).to(x.dtype), groups=c).transpose(1, 2)


def heads_to_channels(t: Tensor) -> Tensor:
    """[b, h, n, d] -> [b, n, h·d]."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def channels_to_heads(t: Tensor, h: int) -> Tensor:
    """[b, n, h·d] -> [b, h, n, d]."""
    b, n, c = t.shape
    return t.view(b, n, h, c // h).transpose(1, 2)
