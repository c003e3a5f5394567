"""Lightweight convolutions as relative-position score terms (Chang et al. 2021, §3).

Window k = (kernel_size − 1)/2 = 8 by default (kernel 17); offsets beyond ±k are clipped to
the edge weight, as in Shaw et al. 2018.

- ``fixed_conv``  (Eq 4):  s_ij += β_h[clip(j − i)]                        per head
- ``dynamic_conv`` (Eq 5): s_ij += q_i · W_C[clip(j − i)] / √d_h           W_C shared by heads
- ``composite``   (Eq 6):  both of the above
- ``key_dynamic_conv`` (§3.2; Huang et al. 2020): s_ij += k_j · W[clip(i − j)] / √d_h
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..attention.terms import QueryRelative, Term, Toeplitz
from ..errors import PositionError
from .base import Context, Dims, Mechanism, offsets
from .registry import register


def half_window(kernel_size: int, name: str) -> int:
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise PositionError(f"{name}: kernel_size must be a positive odd number, got {kernel_size}")
    return (kernel_size - 1) // 2


@register("fixed_conv")
class FixedConv(Mechanism):
    """Fixed lightweight convolution (Chang et al. 2021, Eq 4): s_ij += β_h[clip(j − i, −k, k)], one
    learned scalar per head and offset within the window, offsets beyond it clipped to the edge.

    Options:
        kernel_size: the window 2k + 1 (odd); offsets beyond ±k share the edge weight."""

    paper = "Chang et al. 2021, Eq 4 (= Raffel et al. 2020 without buckets)"
    equation = "s_ij += β_h[clip(j−i, −k, k)]"
    acts_on = ("score",)
    cost_class = "learned_table"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], kernel_size: int = 17) -> None:
        super().__init__(dims, shared)
        self.window = half_window(kernel_size, "fixed_conv")
        self.beta = nn.Parameter(torch.randn(dims.n_heads, kernel_size) * 0.02)

    def start_at_zero(self) -> bool:
        """β = 0: no bias at any offset, every tap still trained."""
        with torch.no_grad():
            self.beta.zero_()
        return True

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        idx = offsets(ctx.n, q.device).clamp(-self.window, self.window) + self.window
        return [Toeplitz(self.beta[:, idx].to(q.dtype), window=self.window)]


class RelativeEmbeddingConv(Mechanism):
    """Dynamic lightweight convolution from the query (or key) and W ∈ R^{(2k+1)×d_h}."""

    key_side = False
    acts_on = ("score",)
    cost_class = "relative_embedding"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], kernel_size: int = 17) -> None:
        super().__init__(dims, shared)
        self.window = half_window(kernel_size, self.name)
        self.weight = nn.Parameter(torch.randn(kernel_size, dims.head_dim) * 0.02)

    def start_at_zero(self) -> bool:
        """W = 0: the term q_i·W[r] (or k_j·W[r]) is zero while W's gradient is not."""
        with torch.no_grad():
            self.weight.zero_()
        return True

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        vec = k if self.key_side else q
        return [QueryRelative(vec, self.weight.to(vec.dtype), self.window,
                              1.0 / math.sqrt(vec.shape[-1]), key_side=self.key_side)]


@register("dynamic_conv")
class DynamicConv(RelativeEmbeddingConv):
    """Dynamic lightweight convolution (Chang et al. 2021, Eq 5; Shaw et al. 2018's relative keys):
    s_ij += q_i·W_C[clip(j − i, −k, k)]/√d_h, W_C ∈ R^{(2k+1)×d_h} shared by the heads.

    Options:
        kernel_size: the window 2k + 1 (odd); offsets beyond ±k share the edge row of W_C."""

    paper = "Chang et al. 2021, Eq 5 (= Shaw et al. 2018 relative keys)"
    equation = "s_ij += q_i·W_C[clip(j−i, −k, k)]/√d_h"


@register("key_dynamic_conv")
class KeyDynamicConv(RelativeEmbeddingConv):
    """Key-based dynamic convolution (Chang et al. 2021, §3.2; Huang et al. 2020):
    s_ij += k_j·W[clip(i − j, −k, k)]/√d_h, the relative embedding read from the key.

    Options:
        kernel_size: the window 2k + 1 (odd); offsets beyond ±k share the edge row of W."""

    paper = "Chang et al. 2021, §3.2 (= Huang et al. 2020)"
    equation = "s_ij += k_j·W[clip(i−j, −k, k)]/√d_h"
    key_side = True


@register("composite")
class Composite(Mechanism):
    """Composite convolution (Chang et al. 2021, Eq 6): the fixed and the dynamic lightweight
    convolutions together, s_ij += q_i·W_C[clip(j − i)]/√d_h + β_h[clip(j − i)].

    Options:
        kernel_size: the window 2k + 1 (odd) of both convolutions."""

    paper = "Chang et al. 2021, Eq 6"
    equation = "s_ij += q_i·W_C[clip(j−i)]/√d_h + β_h[clip(j−i)]"
    acts_on = ("score",)
    cost_class = "relative_embedding"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], kernel_size: int = 17) -> None:
        super().__init__(dims, shared)
        self.fixed = FixedConv(dims, shared, kernel_size)
        self.dynamic = DynamicConv(dims, shared, kernel_size)

    def start_at_zero(self) -> bool:
        """β = 0 and W_C = 0: both convolutions start adding nothing."""
        return self.fixed.start_at_zero() and self.dynamic.start_at_zero()

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        return self.dynamic.score_terms(q, k, ctx) + self.fixed.score_terms(q, k, ctx)
