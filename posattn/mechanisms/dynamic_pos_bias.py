"""Dynamic position bias (Liu et al. 2022, SwinV2, "continuous relative position bias";
x-transformers' ``DynamicPositionBias``): a small MLP maps the signed distance to one bias per
head,

    s_ij += G(δ_ij)_h,   δ_ij = i − j   (or sign(i − j)·log(1 + |i − j|) with ``log_distance``)
    G = Linear(hidden → H) ∘ [SiLU ∘ (LayerNorm) ∘ Linear(hidden → hidden)]^{depth−1}
        ∘ SiLU ∘ (LayerNorm) ∘ Linear(1 → hidden)

as x-transformers builds it (SwinV2 uses a ReLU MLP over log-spaced 2-D coordinates). The MLP
is evaluated once per forward at the 2n − 1 offsets of the input and tabulated (a learned
Toeplitz table), so it extends to any length. Shared across layers by default, as in
x-transformers.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..attention.terms import Term, Toeplitz
from ..errors import PositionError
from .base import Context, Dims, Mechanism, offsets
from .registry import register


@register("dynamic_pos_bias")
class DynamicPositionBias(Mechanism):
    """Dynamic position bias: a small MLP maps the signed distance to one bias per head (SwinV2's
    continuous relative position bias, Liu et al. 2022; x-transformers DynamicPositionBias).

    Options:
        hidden: the MLP's width (None: d_model // 4, as x-transformers).
        depth: the number of hidden layers (>= 1).
        log_distance: feed sign(i−j)·log(1 + abs(i−j)) instead of i − j (SwinV2's log-spaced coordinates).
        norm: a LayerNorm after each hidden linear layer.
        share_layers: one MLP for every layer.
    """

    paper = "Liu et al. 2022 (SwinV2); x-transformers DynamicPositionBias"
    equation = "s_ij += MLP(i−j)_h"
    acts_on = ("score",)
    cost_class = "learned_table"
    share_layers_default = True

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], hidden: int | None = None, depth: int = 2,
                 log_distance: bool = False, norm: bool = False, share_layers: bool = True) -> None:
        super().__init__(dims, shared)
        width = max(dims.d_model // 4, 1) if hidden is None else hidden
        if not isinstance(width, int) or width < 1:
            raise PositionError(f"dynamic_pos_bias: hidden must be a positive integer, got {hidden!r}")
        if not isinstance(depth, int) or depth < 1:
            raise PositionError(f"dynamic_pos_bias: depth must be an integer >= 1, got {depth!r}")
        self.log_distance = log_distance
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(1 if i == 0 else width, width))
            if norm:
                layers.append(nn.LayerNorm(width))
            layers.append(nn.SiLU())
        layers.append(nn.Linear(width, dims.n_heads))
        self.mlp = nn.Sequential(*layers)

    @classmethod
    def layer_shared(cls, options: dict) -> bool:
        return bool(options.get("share_layers", cls.share_layers_default))

    def start_at_zero(self) -> bool:
        """The MLP's output layer at zero: no bias at any distance, while that layer trains (and,
        once it has moved, the layers before it)."""
        with torch.no_grad():
            self.mlp[-1].weight.zero_()
            self.mlp[-1].bias.zero_()
        return True

    def distance_input(self, n: int) -> Tensor:
        """[2n − 1, 1]: the MLP's input δ = i − j at each offset r = j − i = −(n−1) … n−1."""
        d = -offsets(n, self.mlp[0].weight.device).to(self.mlp[0].weight.dtype)
        if self.log_distance:
            d = torch.sign(d) * torch.log1p(d.abs())
        return d[:, None]

    def table(self, n: int) -> Tensor:
        """[h, 2n − 1]: the bias at every offset of an n-token input."""
        return self.mlp(self.distance_input(n)).T

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        table = ctx.cached(("dynamic_pos_bias", id(self)), lambda: self.table(ctx.n))
        return [Toeplitz(table.to(q.dtype))]
