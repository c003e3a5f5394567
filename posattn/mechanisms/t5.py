"""T5 relative position bias (Raffel et al. 2020, §2.1): a learned scalar per head and log bucket.

    s_ij += B_h[bucket(j − i)]

Buckets: half exact (|r| < num_buckets/2, per side when bidirectional), the rest logarithmic
up to ``max_distance``, beyond which every offset shares the last bucket. Causal buckets only
distinguish the past. Shared across layers by default, as in T5.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..attention.terms import Term, Toeplitz
from ..errors import PositionError
from .base import Context, Dims, Mechanism, offsets
from .registry import register


def t5_bucket(r: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """Raffel et al.'s ``_relative_position_bucket`` for offsets r = j − i."""
    ret = torch.zeros_like(r)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (r > 0).long() * num_buckets
        dist = r.abs()
    else:
        dist = (-r).clamp(min=0)
    max_exact = num_buckets // 2
    large = max_exact + (
        torch.log(dist.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return ret + torch.where(dist < max_exact, dist, large)


@register("t5")
class T5Bias(Mechanism):
    """T5's relative position bias (Raffel et al. 2020, §2.1): s_ij += B_h[bucket(j − i)], a learned
    scalar per head and log-spaced bucket of offsets, shared across layers by default.

    Options:
        num_buckets: buckets in all (half of them per direction when bidirectional); half of
            those are exact offsets, the rest logarithmic.
        max_distance: offsets at or beyond it share the last bucket.
        bidirectional: separate buckets for the future (default: True in an encoder, False in
            a decoder, where True is refused).
        share_layers: one table for every layer (T5's choice) instead of one per layer."""

    paper = "Raffel et al. 2020 (T5), §2.1; DIET Table 2"
    equation = "s_ij += B_h[bucket(j−i)]"
    acts_on = ("score",)
    cost_class = "learned_table"
    share_layers_default = True

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], num_buckets: int = 32,
                 max_distance: int = 128, bidirectional: bool | None = None,
                 share_layers: bool = True) -> None:
        super().__init__(dims, shared)
        self.bidirectional = (not dims.causal) if bidirectional is None else bidirectional
        if self.bidirectional and dims.causal:
            raise PositionError("t5: bidirectional buckets in a causal decoder would waste the "
                                "future half; use bidirectional=False")
        if num_buckets < 4 or max_distance <= num_buckets // 2:
            raise PositionError(f"t5: need num_buckets >= 4 and max_distance > num_buckets/2, "
                                f"got {num_buckets}, {max_distance}")
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bias = nn.Embedding(num_buckets, dims.n_heads)
        nn.init.normal_(self.bias.weight, std=0.02)

    @classmethod
    def layer_shared(cls, options: dict) -> bool:
        return bool(options.get("share_layers", cls.share_layers_default))

    def start_at_zero(self) -> bool:
        """B = 0: no bias at any offset, every bucket still trained."""
        with torch.no_grad():
            self.bias.weight.zero_()
        return True

    def table(self, n: int) -> Tensor:
        """[h, 2n−1]: the bias at every offset of an n-token input."""
        b = t5_bucket(offsets(n, self.bias.weight.device), self.bidirectional,
                      self.num_buckets, self.max_distance)
        return self.bias(b).T

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        table = ctx.cached(("t5", id(self)), lambda: self.table(ctx.n))
        return [Toeplitz(table.to(q.dtype), window=self.max_distance)]
