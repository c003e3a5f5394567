"""``convbert``: ConvBERT's mixed attention (Jiang et al. 2020), Chang et al. 2021's comparison
baseline (App. A.3), exactly as Hugging Face's ``ConvBertSelfAttention`` computes it.

With H heads, ratio r and kernel K, the layer's channels split in two halves of width d/2:

- attention half: max(1, H // r) softmax heads of size d/(2·max(1, H // r)) on the first d/2
  channels of q, k, v: a_i = softmax_j(q_i·k_j/√d_a) v_j;
- convolution half, the same number of heads: a span-based dynamic convolution. A
  depthwise-separable convolution of the layer input, k̃ = pointwise(depthwise_K(x)), gates the
  query, and one linear map gives each head its kernel
  κ_i = softmax_m(W_κ (q_i ⊙ k̃_i)) ∈ R^K; the output is c_i = Σ_m κ_{i,m} u_{i+m−(K−1)/2}, where
  u = x W_u are the last d/2 channels of v (HF's ``conv_out_layer``).

The output concatenates [a ; c] (d channels) before the layer's output projection. In a decoder
both convolutions are causal (the last K positions). The first d/2 channels' counterparts of q
and k for the convolution half (the other d/2 channels of q and k) are unused and get no
gradient. HF's ``num_groups`` belongs to ConvBERT's grouped feed-forward layer, not to the
mixer, so it is not an option here. Padded positions are zeroed before both convolutions (HF
leaves them in; equal without padding). In a packed row (``ctx.documents``) both
convolutions read zeros outside the token's own document, as at the sequence's edges.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.terms import Term
from ..errors import PositionError
from .base import Context, Dims, Mechanism, Softmax
from .conv import channels_to_heads, depthwise_conv1d, heads_to_channels
from .conv_layers import taps
from .documents import DocumentSlots
from .registry import register


@register("convbert")
class ConvBERT(Mechanism):
    """ConvBERT's mixed attention (Jiang et al. 2020; Chang et al. 2021, App. A.3), a mixer: softmax
    heads on half the channels beside span-based dynamic-convolution heads on the other half.

    Options:
        head_ratio: H // head_ratio softmax heads (at least one) and as many convolution
            heads, each half of the channels split among them.
        conv_kernel_size: the span K of the dynamic convolution and of the depthwise
            convolution that gates its kernels."""

    paper = "Jiang et al. 2020 (ConvBERT); Chang et al. 2021, App. A.3"
    equation = "[softmax(q k̃ᵀ)v ; Σ_m softmax_m(W_κ(q ⊙ sepconv(x)))·u_{i+m}]"
    acts_on = ("mixer",)
    mixes = True
    cost_class = "mixer"
    reads_layer_input = True
    takes_score_terms = False

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], head_ratio: int = 2,
                 conv_kernel_size: int = 9) -> None:
        super().__init__(dims, shared)
        if head_ratio < 1:
            raise PositionError(f"convbert: head_ratio must be >= 1, got {head_ratio}")
        self.heads = max(1, dims.n_heads // head_ratio)  # HF: at least one attention head
        self.half = dims.d_model // 2
        if dims.d_model % 2 or self.half % self.heads:
            raise PositionError(f"convbert: d_model {dims.d_model} must split into two halves "
                                f"divisible by its {self.heads} attention heads")
        self.kernel_size = taps(conv_kernel_size, dims.causal, "convbert")
        k = self.kernel_size
        self.depthwise = nn.Parameter(torch.randn(dims.d_model, k) * 0.02)
        self.pointwise = nn.Linear(dims.d_model, self.half)  # HF: pointwise conv + its bias
        self.span_kernel = nn.Linear(self.half, self.heads * k)

    def mix(self, q: Tensor, k: Tensor, v: Tensor, terms: list[Term], ctx: Context,
            softmax: Softmax) -> Tensor:
        assert ctx.x is not None
        b, h, n, _ = q.shape
        keep = None if ctx.keep is None else ctx.keep[..., None].to(q.dtype)
        half, heads, kk = self.half, self.heads, self.kernel_size
        q_a, k_a, v_all = heads_to_channels(q)[..., :half], heads_to_channels(k)[..., :half], heads_to_channels(v)
        attn = softmax(*(channels_to_heads(t, heads) for t in (q_a, k_a, v_all[..., :half])))
        key_conv = self.pointwise(depthwise_conv1d(ctx.x, self.depthwise, ctx.causal, ctx.keep, ctx.documents))
        kappa = self.span_kernel(key_conv.to(q.dtype) * q_a).view(b, n, heads, kk).softmax(-1)
        u = v_all[..., half:] if keep is None else v_all[..., half:] * keep
        left = kk - 1 if ctx.causal else (kk - 1) // 2
        slots = None
        if ctx.documents is not None:  # documents apart, zeros between: no span crosses a boundary
            slots = DocumentSlots.build(ctx.documents, n, b, u.device, gap=max(left, kk - 1 - left))
            u = slots.place(u, 1)
        spans = F.pad(u, (0, 0, left, kk - 1 - left)).unfold(1, kk, 1)  # [b, n, d/2, K]
        if slots is not None:
            spans = slots.take(spans, 1)
        conv = torch.einsum("bnhcm,bnhm->bnhc", spans.reshape(b, n, heads, half // heads, kk), kappa)
        return channels_to_heads(torch.cat([heads_to_channels(attn), conv.reshape(b, n, half)], -1), h)
