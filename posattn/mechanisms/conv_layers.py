"""Convolutions inside the attention layer (Chang et al. 2021 §4-5; Li et al. 2024, CAT).

- ``depthwise_conv`` (Chang Eq 7): a fixed depthwise convolution of the values added to the
  attention output, o_i,c += Σ_r β_{r,c} v_{i+r,c}, r ∈ [−k, k] (r ≤ 0 in a decoder).
- ``conv_qkv`` (Chang §5): in a fraction of the heads (default half), a depthwise-separable
  convolution of the layer input (depthwise conv, then pointwise projection) replaces the
  linear Q/K and/or V projection; kernel 9 as in ConvBERT (Jiang et al. 2020). The linear
  projection's rows for those heads stay in the layer but are never computed (``own_heads``)
  and receive no gradient.
- ``cat`` (CAT: Li, Zhang, Huang, Oymak, arXiv 2407.05591): filters F_q, F_k, F_v convolved along the sequence
  with Q, K, V: Q = F_q ∗ (XW_q), i.e. (F ∗ X)W for a filter shared by channels; causal in a
  decoder, centered in an encoder; optional ℓ2 row-norm of Q and K with a learned temperature.
  Filters start as the identity (a delta at r = 0). One filter per channel by default
  (``depthwise=True``, the "short convolutions" of practice); ``depthwise=False`` shares one
  scalar filter by all channels, as in CAT's theory (Thm 1). One layer of shared filters cannot
  untangle keys of two tokens (MQNAR with bigram keys), since one scalar pair mixes the two key
  tokens identically in every channel; per-channel filters can (measured in the documentation,
  Mechanisms guide).
  ``lincat`` and ``landmark_cat`` reuse these convolutions (the ``CAT convolutions`` claim:
  one of them per model).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import PositionError
from .base import Context, Dims, Mechanism, Structure
from .conv import channels_to_heads, depthwise_conv1d, heads_to_channels
from .registry import register


def taps(kernel_size: int, causal: bool, name: str) -> int:
    """Filter length actually used: a causal filter keeps the present and the past half."""
    if kernel_size < 1:
        raise PositionError(f"{name}: kernel_size must be >= 1, got {kernel_size}")
    if causal:
        return kernel_size
    if kernel_size % 2 == 0:
        raise PositionError(f"{name}: a centered filter needs an odd kernel_size, got {kernel_size}")
    return kernel_size


def check_targets(targets: str, allowed: str, name: str) -> str:
    if not targets or any(t not in allowed for t in targets) or len(set(targets)) != len(targets):
        raise PositionError(f"{name}: targets must be letters from {allowed!r}, got {targets!r}")
    return targets


@register("depthwise_conv")
class DepthwiseConv(Mechanism):
    """Fixed depthwise convolution of the values added to the attention output (Chang et al. 2021,
    Eq 7): o_i,c += Σ_r β_{r,c} v_{i+r,c}, r ∈ [−k, k] (r ≤ 0 in a decoder).

    Options:
        kernel_size: the filter length 2k + 1 (odd); a decoder keeps the present and the k
            past taps."""

    paper = "Chang et al. 2021, Eq 7"
    equation = "o_i,c += Σ_r β_{r,c} v_{i+r,c}"
    acts_on = ("output",)
    cost_class = "convolution"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], kernel_size: int = 17) -> None:
        super().__init__(dims, shared)
        k = taps(kernel_size, False, "depthwise_conv")
        k = (k + 1) // 2 if dims.causal else k
        self.weight = nn.Parameter(torch.randn(dims.d_model, k) * 0.02)

    def start_at_zero(self) -> bool:
        """β = 0: nothing added to the output while β's gradient (through v) is not zero."""
        with torch.no_grad():
            self.weight.zero_()
        return True

    def transform_output(self, o: Tensor, v: Tensor, ctx: Context) -> Tensor:
        conv = depthwise_conv1d(heads_to_channels(v), self.weight, ctx.causal, ctx.keep, ctx.documents)
        return o + channels_to_heads(conv, self.dims.n_heads)

    def position_structures(self, n: int, ctx: Context) -> list[Structure]:
        """The value-convolution kernels β [d_model, k] (Chang Fig 3)."""
        return [Structure(self.name, "depthwise", self.weight.detach().double())]


@register("conv_qkv")
class ConvQKV(Mechanism):
    """Convolutional Q/K/V (Chang et al. 2021, §5): in a fraction of the heads a depthwise-separable
    convolution of the layer input (depthwise, then pointwise) replaces the linear projection.

    Options:
        fraction: the share of heads whose projections are convolutions (0 < fraction ≤ 1,
            rounded to whole heads; at least one).
        targets: which projections the convolution replaces, letters from "qkv".
        kernel_size: the depthwise filter length (odd in an encoder; 9 as in ConvBERT)."""

    paper = "Chang et al. 2021, §5 and Table 3"
    equation = "q,k,v (a fraction of heads) ← pointwise(depthwise_conv(x))"
    cost_class = "convolution"
    reads_layer_input = True

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], fraction: float = 0.5,
                 targets: str = "qkv", kernel_size: int = 9) -> None:
        super().__init__(dims, shared)
        self.targets = check_targets(targets, "qkv", "conv_qkv")
        self.acts_on = tuple(self.targets)
        self.n_conv = round(fraction * dims.n_heads)
        if not 0 < fraction <= 1 or self.n_conv < 1:
            raise PositionError(f"conv_qkv: fraction {fraction} of {dims.n_heads} heads leaves no "
                                f"convolutional head; use 0 < fraction <= 1 with enough heads")
        k = taps(kernel_size, dims.causal, "conv_qkv")
        width = self.n_conv * dims.head_dim
        self.depthwise = nn.ParameterDict(
            {t: nn.Parameter(torch.randn(dims.d_model, k) / math.sqrt(k)) for t in self.targets})
        self.pointwise = nn.ModuleDict({t: nn.Linear(dims.d_model, width) for t in self.targets})

    @classmethod
    def validate(cls, options: dict, others: list[str], dims: Dims) -> None:
        check_targets(options.get("targets", "qkv"), "qkv", "conv_qkv")

    def own_heads(self) -> dict[str, int]:
        return {t: self.n_conv for t in self.targets}

    def transform_qkv(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        assert ctx.x is not None
        out = {"q": q, "k": k, "v": v}
        c, h = self.n_conv, self.dims.n_heads
        for t in self.targets:  # the linear heads: all h − c of them when the layer skipped the rest
            conv = self.pointwise[t](depthwise_conv1d(ctx.x, self.depthwise[t], ctx.causal, ctx.keep, ctx.documents))
            out[t] = torch.cat([out[t][:, : h - c], channels_to_heads(conv, c).to(q.dtype)], 1)
        return out["q"], out["k"], out["v"]


@register("cat")
class CAT(Mechanism):
    """Convolution-augmented attention (Li et al. 2024, CAT, Fig 2 and Thm 1): filters convolved along
    the sequence with the projections, Q = F_q∗(XW_q), K = F_k∗(XW_k), V = F_v∗(XW_v); causal in a
    decoder, centered in an encoder, each filter starting as the identity.

    Options:
        kernel_size: the filter length (odd in an encoder; a decoder's filter reads the
            present and kernel_size − 1 past positions).
        depthwise: True: one filter per channel (the "short convolutions" of practice);
            False: one scalar filter shared by all channels, as in CAT's theory (Thm 1).
        targets: which of q, k, v are filtered, letters from "qkv".
        qk_norm: ℓ2-normalise the rows of Q and K and scale the scores by a learned
            per-head temperature."""

    paper = "Li et al. 2024 (CAT), Fig 2 and Thm 1"
    equation = "Q = F_q∗(XW_q), K = F_k∗(XW_k), V = F_v∗(XW_v)"
    incremental = "prefix"  # causal filters read earlier rows: decoding re-filters the cached projections
    claims = frozenset({"CAT convolutions"})
    cost_class = "convolution"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], kernel_size: int = 3,
                 depthwise: bool = True, targets: str = "qkv", qk_norm: bool = False) -> None:
        super().__init__(dims, shared)
        self.targets = check_targets(targets, "qkv", "cat")
        self.acts_on = tuple(t for t in "qkv" if t in targets or (qk_norm and t in "qk"))
        k = taps(kernel_size, dims.causal, "cat")
        delta = torch.zeros(k)
        delta[k - 1 if dims.causal else k // 2] = 1.0
        shape = (dims.d_model, k) if depthwise else (k,)
        self.filters = nn.ParameterDict({t: nn.Parameter(delta.expand(shape).clone()) for t in self.targets})
        self.qk_norm = qk_norm
        if qk_norm:
            self.log_temperature = nn.Parameter(torch.full((dims.n_heads, 1, 1), math.log(dims.head_dim)))

    def start_at_zero(self) -> bool:
        """Identity filters (a unit tap at the present position), CAT's own start: Q, K and V are
        the layer's own. Not with ``qk_norm`` (it changes the scores) nor in a mixer subclass."""
        if self.qk_norm or self.mixes:
            return False
        with torch.no_grad():
            for f in self.filters.values():
                f.zero_()
                f[..., f.shape[-1] - 1 if self.dims.causal else f.shape[-1] // 2] = 1.0
        return True

    def transform_qkv(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        out = {"q": q, "k": k, "v": v}
        h = self.dims.n_heads
        for t in self.targets:
            conv = depthwise_conv1d(heads_to_channels(out[t]), self.filters[t], ctx.causal, ctx.keep, ctx.documents)
            out[t] = channels_to_heads(conv, h)
        if self.qk_norm:
            out["q"] = nn.functional.normalize(out["q"], dim=-1) * self.log_temperature.exp()
            out["k"] = nn.functional.normalize(out["k"], dim=-1)
        return out["q"], out["k"], out["v"]

    def position_structures(self, n: int, ctx: Context) -> list[Structure]:
        """The filters F_q, F_k, F_v ([k] shared or [d_model, k] per channel), one per target."""
        return [Structure(f"{self.name}:{t}", "filter", f.detach().double()) for t, f in self.filters.items()]
