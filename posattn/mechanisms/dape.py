"""DAPE, data-adaptive positional encoding (Zheng et al. 2024, "DAPE: Data-Adaptive Positional
Encoding for Length Extrapolation", Eq. 5): the bias of another mechanism, adapted per query and
key by a small MLP across the heads that also reads the attention logits.

    s'_ij = l_ij + B_ij + f_θ([l_ij; B_ij]),   l = q·kᵀ/√d_h,   f_θ: R^{2h} → R^h

B: the bias of the mechanism named by ``bias`` (ALiBi by default, as in the paper's main
results; e.g. ``{"name": "kerple"}``), built inside DAPE, plus any other score term of the
layer. f_θ: Linear(2h, ``hidden``), LeakyReLU, Linear(``hidden``, h) at every (i, j), one per
layer: the authors' released code (``AliBi_DAPE``, ``ParallelKerpleLog_DAPE``) has the same
form, width 32, LeakyReLU at its default slope 0.01, the bias added once plainly and once
through f_θ. It reads the logits, so it is a :class:`~posattn.attention.terms.ScoreTransform` (the
reference and dense paths). A ``bias`` mechanism that adds no score term leaves nothing to
adapt: refused.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.terms import ScoreTransform, Term
from ..errors import PositionError
from .base import Context, Dims, Mechanism
from .registry import get, register


def _bias_spec(options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    spec = options.get("bias", "alibi")
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, dict) and isinstance(spec.get("name"), str):
        return spec["name"], {k: v for k, v in spec.items() if k != "name"}
    raise PositionError(f"dape: bias is a mechanism name or a dict with a 'name' key, got {spec!r}")


@register("dape")
class DAPE(Mechanism):
    """DAPE: an MLP across heads over the logits and another mechanism's bias adapts that bias to
    the data: s_ij = l_ij + B_ij + f_θ([l_ij; B_ij]) (Zheng et al. 2024); applied through the
    score-transform hook.

    Options:
        bias: the mechanism whose score term DAPE adapts (a name or a spec dict; default alibi).
        hidden: width of f_θ's hidden layer (the paper's D_DAPE).
    """

    paper = "Zheng et al. 2024 (DAPE)"
    equation = "s_ij = l_ij + B_ij + f_θ([l_ij; B_ij])"
    acts_on = ("score",)
    translation_invariant = True  # as its bias mechanism (ALiBi by default); see ``translation_invariant``
    cost_class = "score_transform"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], bias: str | dict[str, Any] = "alibi",
                 hidden: int = 32) -> None:
        super().__init__(dims, shared)
        name, options = _bias_spec({"bias": bias})
        self.inner = get(name)(dims, {}, **options)
        self.translation_invariant = self.inner.translation_invariant
        self.mlp_in = nn.Linear(2 * dims.n_heads, hidden)
        self.mlp_out = nn.Linear(hidden, dims.n_heads)

    @classmethod
    def validate(cls, options: dict, others: list[str], dims: Dims) -> None:
        hidden = options.get("hidden", 32)
        if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
            raise PositionError(f"dape: hidden must be a positive integer, got {hidden!r}")
        name, inner = _bias_spec(options)
        kind = get(name)
        if "score" not in kind.acts_on or kind.cost_class == cls.cost_class or kind.placement_for(inner) != "layer":
            raise PositionError(f"dape: adapts the score bias of another mechanism, and {name} adds none; "
                                f"give bias a mechanism with a score term (e.g. alibi, t5)")
        unknown = sorted(set(inner) - set(kind.option_names()))
        if unknown:
            raise PositionError(f"dape: bias {name} has unknown option(s) {', '.join(unknown)}; valid options: "
                                f"{', '.join(kind.option_names()) or 'none'}")
        kind.validate(inner, others, dims)

    def adapt(self, logits: Tensor, bias: Tensor) -> Tensor:
        """f_θ([l; B]) [b, h, m, n] across the heads at every (i, j)."""
        both = torch.cat([logits, bias.expand_as(logits)], 1).movedim(1, -1)  # [b, m, n, 2h]
        return self.mlp_out(F.leaky_relu(self.mlp_in(both))).movedim(-1, 1)

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        def transform(logits: Tensor, bias: Tensor, ok: Tensor | None, rows: Tensor) -> Tensor:
            return logits + bias + self.adapt(logits, bias)

        return [*self.inner.score_terms(q, k, ctx), ScoreTransform(transform, tuple(self.parameters()))]
