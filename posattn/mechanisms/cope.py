"""CoPE, contextual position encoding (Golovneva et al. 2024, "Contextual Position Encoding:
Learning to Count What's Important", §3, Eq. 3-5): positions counted by gates of the content.

    g_ij = σ(s_ij),   p_ij = Σ_{t=j}^{i} g_it,   s'_ij = s_ij + q_i·e[p_ij]
    q_i·e[p] = (p − ⌊p⌋)·q_i·e[⌈p⌉] + (1 − p + ⌊p⌋)·q_i·e[⌊p⌋]      (p clipped to npos_max − 1)

s_ij: the logits q_i·k_j/√d_h plus every other mechanism's score terms, as x-transformers' CoPE
gates them; e[0 … npos_max − 1]: learned vectors of the head dimension shared by the heads,
initialised to zero as in the paper's listing (Appendix B: ``pos_emb = zeros(1, head_dim,
npos_max)``) and x-transformers' ``CoPE``, so CoPE starts as plain attention and learns its
positions from the first gradient (∂s'/∂e[p] = q_i times the interpolation weight). As there,
the gates read the masked logits (hidden keys count 0), p is clamped to npos_max − 1 before the
interpolation, and q·e[p] is formed once per integer p and interpolated (Eq. 5). A
position counts the keys between j and i whose gate is open (e.g. sentences, not tokens), so it
depends on the content: a :class:`~posattn.attention.terms.ScoreTransform`, applied where the
scores are written out (the reference and dense paths). Gates of hidden keys (padding, the
future) count 0.

Encoders: the paper and x-transformers define CoPE for causal attention (j ≤ i). In an encoder
this module counts the gates between the two tokens on either side, p_ij = Σ_{t=min(i,j)}^{max(i,j)}
g_it, an extension the paper does not evaluate.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..attention.terms import ScoreTransform, Term
from ..errors import PositionError
from .base import Context, Dims, Mechanism
from .registry import register


def contextual_positions(gates: Tensor, rows: Tensor) -> Tensor:
    """p_ij = Σ of ``gates`` [b, h, m, n] over t from j to i inclusive (either order), for score
    rows at positions ``rows`` [b|1, m]: from one cumulative sum C along the keys,
    C_i[i] − C_i[j] + g_ij for j ≤ i and C_i[j] − C_i[i] + g_ii for j > i."""
    c = gates.cumsum(-1)
    idx = rows[:, None, :, None].expand(*gates.shape[:3], 1)
    c_ii, g_ii = c.gather(-1, idx), gates.gather(-1, idx)
    before = torch.arange(gates.shape[-1], device=gates.device) <= rows[:, None, :, None]
    return torch.where(before, c_ii - c + gates, c - c_ii + g_ii)


def interpolated(logits_int: Tensor, pos: Tensor) -> Tensor:
    """q_i·e[p_ij] from q_i·e[p] at the integers (``logits_int`` [b, h, m, npos]), linearly
    between ⌊p⌋ and ⌈p⌉."""
    lo, hi = pos.floor(), pos.ceil()
    w = pos - lo
    return logits_int.gather(-1, hi.long()) * w + logits_int.gather(-1, lo.long()) * (1 - w)


@register("cope")
class CoPE(Mechanism):
    """CoPE: contextual positions p_ij = Σ_{t=j..i} σ(q_i·k_t) count the keys the query attends
    to, and the bias q_i·e[p_ij] interpolates learned position vectors between floor(p) and ceil(p)
    (Golovneva et al. 2024); applied through the score-transform hook.

    Options:
        npos_max: number of learned position vectors e[0 … npos_max − 1]; contextual positions
            beyond npos_max − 1 share the last one.
    """

    paper = "Golovneva et al. 2024 (CoPE)"
    equation = "s_ij += q_i·e[p_ij], p_ij = Σ_{t=j..i} σ(s_it)"
    acts_on = ("score",)
    cost_class = "score_transform"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], npos_max: int = 16) -> None:
        super().__init__(dims, shared)
        self.npos_max = npos_max
        self.pos_emb = nn.Parameter(torch.zeros(npos_max, dims.head_dim))  # the paper's start (Appendix B)

    @classmethod
    def validate(cls, options: dict, others: list[str], dims: Dims) -> None:
        npos = options.get("npos_max", 16)
        if not isinstance(npos, int) or isinstance(npos, bool) or npos < 2:
            raise PositionError(f"cope: npos_max must be an integer >= 2 (learned position vectors), got {npos!r}")

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        emb = self.pos_emb.to(q.dtype)

        def transform(logits: Tensor, bias: Tensor, ok: Tensor | None, rows: Tensor) -> Tensor:
            s = logits + bias
            gates = s.sigmoid() if ok is None else s.sigmoid() * ok
            pos = contextual_positions(gates, rows).clamp(max=self.npos_max - 1)
            return s + interpolated(q @ emb.T, pos)

        return [ScoreTransform(transform, (q, emb))]
