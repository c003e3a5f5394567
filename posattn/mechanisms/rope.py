"""Rotary position embedding (Su et al. 2021) with position interpolation and YaRN.

    q_i ← R(i·θ) q_i,  k_j ← R(j·θ) k_j   ⇒   q_i·k_j depends on j − i only;
    θ_m = base^{−2m/d_h}, rotating the channel pairs (m, m + d_h/2) (GPT-NeoX layout).

Scaling for longer contexts, with factor s = target / trained context:
- ``"linear"`` (position interpolation, Chen et al. 2023): positions i ↦ i / s;
- ``"yarn"`` (Peng et al. 2023, Eq 17-20): per-frequency ramp between interpolation and
  extrapolation, θ'_m = (1 − γ_m) θ_m / s + γ_m θ_m with γ = clamp((L/λ_m − α)/(β − α), 0, 1),
  λ_m = 2π/θ_m, L = ``original_max_len``, and q, k both scaled by √(1/t) = 0.1 ln s + 1.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from ..errors import PositionError
from .base import Context, Dims, Mechanism
from .registry import register

Scaling = Literal["none", "linear", "yarn"]


def rope_frequencies(d: int, base: float, scaling: Scaling, factor: float, original_max_len: int,
                     beta_fast: float, beta_slow: float) -> tuple[Tensor, float]:
    """Inverse frequencies θ_m [d/2] after scaling, and the q/k magnitude factor."""
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if scaling == "none" or factor == 1.0:
        return theta.float(), 1.0
    if scaling == "linear":
        return (theta / factor).float(), 1.0
    ratio = original_max_len * theta / (2 * math.pi)  # L / λ_m: rotations in the trained context
    gamma = ((ratio - beta_slow) / (beta_fast - beta_slow)).clamp(0, 1)
    theta = (1 - gamma) * theta / factor + gamma * theta
    return theta.float(), 0.1 * math.log(factor) + 1.0


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply the rotation to x [b, h, n, d]: x·cos + swap(x)·sin, where swap exchanges the two
    halves, cos = [cos iθ, cos iθ] and sin = [−sin iθ, sin iθ] ([b|1, 1, n, d]; :func:`tables`).
    Two passes over x (a copy and a fused multiply-add) instead of six products and sums."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat([x2, x1], dim=-1), sin)


def tables(positions: Tensor, theta: Tensor, mscale: float) -> tuple[Tensor, Tensor]:
    """The [b|1, 1, n, d] tables of :func:`rotate` for ``positions`` [b|1, n]."""
    ang = positions[:, None, :, None].to(theta.dtype) * theta
    cos, sin = ang.cos() * mscale, ang.sin() * mscale
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


@register("rope")
class RoPE(Mechanism):
    paper = "Su et al. 2021 (RoFormer); Chen et al. 2023 (PI); Peng et al. 2023 (YaRN); CAT §LM"
    equation = "q_i ← R(iθ)q_i, k_j ← R(jθ)k_j"
    acts_on = ("q", "k")
    cost_class = "rotation"
    length_scalings = ("linear", "yarn")
    incremental = "rows"  # each row rotated by its own position: cached keys stay valid

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], base: float = 10000.0,
                 scaling: Scaling = "none", factor: float = 1.0, original_max_len: int | None = None,
                 beta_fast: float = 32.0, beta_slow: float = 1.0) -> None:
        super().__init__(dims, shared)
        if dims.head_dim % 2:
            raise PositionError(f"rope: head dimension must be even, got {dims.head_dim}")
        if scaling not in ("none", "linear", "yarn"):
            raise PositionError(f"rope: unknown scaling {scaling!r}; valid: none, linear, yarn")
        if factor < 1.0:
            raise PositionError(f"rope: scaling factor must be >= 1, got {factor}")
        theta, self.mscale = rope_frequencies(dims.head_dim, base, scaling, factor,
                                              original_max_len or dims.max_len, beta_fast, beta_slow)
        self.register_buffer("theta", theta, persistent=False)

    @classmethod
    def length_scaled(cls, options: dict, kind: str, factor: float, trained_len: int) -> dict:
        """Position interpolation (``linear``) or YaRN (``yarn``) by ``factor`` from the trained
        context ``trained_len`` (the module docstring's equations)."""
        if kind not in cls.length_scalings:
            raise PositionError(f"rope: unknown length scaling {kind!r}; valid: {', '.join(cls.length_scalings)}")
        return {**options, "scaling": kind, "factor": factor, "original_max_len": trained_len}

    def transform_qkv(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        cos, sin = ctx.cached(("rope", id(self)), lambda: tables(ctx.positions, self.theta, self.mscale))
        return rotate(q, cos.to(q.dtype), sin.to(q.dtype)), rotate(k, cos.to(k.dtype), sin.to(k.dtype)), v
