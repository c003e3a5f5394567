"""ALiBi (Press et al. 2022): a linear distance penalty per head.

    s_ij += −m_h · |j − i|,  m_h = 2^{−8h/H} (geometric; the paper's rule for H not a power of 2)

Options beyond the paper, as the libraries people compare against have them:

- ``heads`` = k < H: only the first k heads are biased, with the slopes of a k-head model; the
  other H − k heads get no bias (x-transformers' ``alibi_num_heads``), so they may attend far;
- ``learned``: the slopes are learned, as log-slopes ℓ_h with m_h = exp(ℓ_h) > 0, starting at
  the geometric ones (x-transformers' former ``LearnedAlibiPositionalBias``);
- ``bidirectional`` (encoders): ``"symmetric"`` is −m_h·|j − i| (Press's suggestion for
  encoders, data2vec 2.0); ``"asymmetric"`` has its own slopes for each side,
  −m_h·(i − j) for j ≤ i and −m'_h·(j − i) for j > i, both learned (with fixed slopes both sides
  would be the same geometric sequence: the symmetric form).

Under a causal mask −m_h(i − j) = m_h·j − m_h·i, and the −m_h·i part is constant per row, so
the term is declared with an equivalent rank-1 ``causal_form`` (u_i = m_h, v_j = j).
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..attention.terms import LowRank, Term, Toeplitz
from ..errors import PositionError
from .base import Context, Dims, Mechanism, offsets
from .registry import register

FORMS = ("symmetric", "asymmetric")


def alibi_slopes(h: int) -> Tensor:
    """Press et al. 2022 §3: 2^{-8/H·(1..H)}, interleaving for non-powers of two."""
    def pow2(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(h).is_integer():
        return torch.tensor(pow2(h))
    p = 2 ** math.floor(math.log2(h))
    return torch.tensor(pow2(p) + pow2(2 * p)[0::2][: h - p])


@register("alibi")
class ALiBi(Mechanism):
    """ALiBi: a fixed linear penalty on the distance, one geometric slope per head (Press et al. 2022, §3).

    Options:
        heads: how many heads (the first ones) get a slope, as in a model of that many heads; the
            others are unbiased (x-transformers alibi_num_heads). None: every head.
        learned: learn the slopes (as log-slopes, starting from the geometric values).
        bidirectional: the encoder form: symmetric (one slope for both sides) or asymmetric
            (separate learned past and future slopes; encoders only, needs learned).
    """

    paper = "Press et al. 2022 (ALiBi)"
    equation = "s_ij += −m_h·|j−i|"
    acts_on = ("score",)
    cost_class = "fixed_bias"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], heads: int | None = None,
                 learned: bool = False,
                 bidirectional: Literal["symmetric", "asymmetric"] = "symmetric") -> None:
        super().__init__(dims, shared)
        self.validate({"heads": heads, "learned": learned, "bidirectional": bidirectional}, [], dims)
        self.n_biased = dims.n_heads if heads is None else heads
        self.learned, self.asymmetric = learned, bidirectional == "asymmetric"
        start = alibi_slopes(self.n_biased)
        if learned:
            self.log_slopes = nn.Parameter(start.log())
            if self.asymmetric:
                self.log_future = nn.Parameter(start.log())
        else:
            self.register_buffer("fixed", start, persistent=False)

    @classmethod
    def validate(cls, options: dict[str, Any], others: list[str], dims: Dims) -> None:
        heads, form = options.get("heads"), options.get("bidirectional", "symmetric")
        if heads is not None and not (isinstance(heads, int) and 1 <= heads <= dims.n_heads):
            raise PositionError(f"alibi: heads must be an integer in 1 … {dims.n_heads} (the model's heads), "
                                f"got {heads!r}")
        if form not in FORMS:
            raise PositionError(f"alibi: unknown bidirectional form {form!r}; valid: {', '.join(FORMS)}")
        if form == "asymmetric" and dims.causal:
            raise PositionError("alibi: bidirectional='asymmetric' sets slopes for future keys, which a causal "
                                "decoder never sees; use it in an encoder")
        if form == "asymmetric" and not options.get("learned", False):
            raise PositionError("alibi: bidirectional='asymmetric' needs learned=True (with fixed slopes both "
                                "sides have the same geometric slopes: the symmetric form)")

    def _full(self, per_biased: Tensor) -> Tensor:
        """[H] slopes: the biased heads' ones, then zeros for the unbiased heads."""
        return nn.functional.pad(per_biased, (0, self.dims.n_heads - self.n_biased))

    @property
    def slopes(self) -> Tensor:
        """m_h for every head [H] (past side; zero where a head is unbiased)."""
        return self._full(self.log_slopes.exp() if self.learned else self.fixed)

    def future_slopes(self) -> Tensor:
        """m'_h [H] for keys after the query (the past slopes unless asymmetric)."""
        return self._full(self.log_future.exp()) if self.asymmetric else self.slopes

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        n = ctx.n
        r = offsets(n, q.device).to(q.dtype)
        past, future = self.slopes.to(q.dtype), self.future_slopes().to(q.dtype)
        table = torch.where(r <= 0, past[:, None] * r, -future[:, None] * r)  # −m·|r| on each side
        pos = torch.arange(n, device=q.device, dtype=q.dtype)
        causal = LowRank(u=past[None, :, None, None].expand(1, -1, n, 1), v=pos[None, None, :, None])

        def formula(h: Tensor, r: Tensor) -> Tensor:
            """The table's entry at heads h and offsets r, computed (the same arithmetic)."""
            r = r.to(past.dtype)
            return torch.where(r <= 0, past[h] * r, -future[h] * r)

        return [Toeplitz(table, causal_form=causal, formula=formula)]
