"""Position embeddings added to the input: learned (BERT) and fixed sinusoids (Vaswani et al.).

    x_i ← x_i + E_P[i]
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .base import Context, Dims, Mechanism, max_len_check
from .registry import register


@register("absolute")
class Absolute(Mechanism):
    """Learned position embeddings added to the input (Devlin et al. 2019): x_i ← x_i + E_P[i],
    E_P ∈ R^{max_len×d} learned; not inductive beyond max_len.

    Options:
        max_len: rows of the learned table E_P, the longest input it can run (default: the
            model's ``max_len``)."""

    paper = "Devlin et al. 2019 (BERT); Vaswani et al. 2017"
    equation = "x_i ← x_i + E_P[i], E_P learned"
    placement = "input"
    acts_on = ("input",)
    inductive = False
    translation_invariant = False
    claims = frozenset({"input positions"})
    cost_class = "input"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], max_len: int | None = None) -> None:
        super().__init__(dims, shared)
        self.max_len = max_len or dims.max_len
        self.embedding = nn.Embedding(self.max_len, dims.d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def check(self, ctx: Context) -> None:
        max_len_check(self, ctx.positions, self.max_len)

    def embed(self, x: Tensor, ctx: Context) -> Tensor:
        return x + self.embedding(ctx.positions)

    def position_table(self, n: int) -> Tensor:
        if n > self.max_len:
            raise self.fail(f"asked for {n} positions, the absolute table has {self.max_len}")
        return self.embedding.weight[:n].detach().to(torch.float64)


def sinusoids(positions: Tensor, d: int, base: float = 10000.0, dtype: torch.dtype = torch.float32) -> Tensor:
    """Vaswani et al. 2017 §3.5: PE[p, 2i] = sin(p/base^{2i/d}), PE[p, 2i+1] = cos(·), computed in ``dtype``."""
    inv = torch.exp(-math.log(base) * torch.arange(0, d, 2, device=positions.device, dtype=dtype) / d)
    ang = positions[..., None].to(dtype) * inv
    return torch.stack([ang.sin(), ang.cos()], -1).flatten(-2)[..., :d]


@register("sinusoidal")
class Sinusoidal(Mechanism):
    """Fixed sinusoids added to the input (Vaswani et al. 2017, §3.5): defined at any position
    (inductive) but not translation invariant.

    Options:
        base: the wavelength base of the sinusoids, PE[p, 2i] = sin(p/base^{2i/d})."""

    paper = "Vaswani et al. 2017, §3.5"
    equation = "x_i ← x_i + [sin(i/10000^{2k/d}), cos(i/10000^{2k/d})]_k"
    placement = "input"
    acts_on = ("input",)
    translation_invariant = False
    claims = frozenset({"input positions"})
    cost_class = "input"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], base: float = 10000.0) -> None:
        super().__init__(dims, shared)
        self.base = base

    def embed(self, x: Tensor, ctx: Context) -> Tensor:
        return x + sinusoids(ctx.positions, x.shape[-1], self.base).to(x.dtype)

    def position_table(self, n: int) -> Tensor:
        return sinusoids(torch.arange(n), self.dims.d_model, self.base).to(torch.float64)
