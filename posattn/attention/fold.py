"""Low-rank score terms folded into q and k, exactly (every path but ``fused`` computes them so).

    s_ij += u_i · v_j   ⇔   q'_i · k'_j = scale · q_i · k_j + Σ_t u_t,i · v_t,j
    with q' = [q·scale, u_1, …], k' = [k, v_1, …]

DIET-ABS, TUPE and segment terms (:class:`~.terms.LowRank`) then ride in the attention kernel
itself, with no n×n bias.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .terms import LowRank


def round_up(x: int, m: int) -> int:
    """The least multiple of m that is at least x."""
    return -(-x // m) * m


def fold_low_rank(q: Tensor, k: Tensor, v: Tensor, terms: list[LowRank], scale: float,
                  multiple: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """q' = [q·scale, u…], k' = [k, v…], zero-padded to a multiple of ``multiple`` and at least
    v's width; v zero-padded to the same width. q'·k' = scale·q·k + Σ u·v."""
    b, h, n, _ = q.shape
    qs, ks = [q * scale], [k]
    for t in terms:
        qs.append(t.u.expand(b, h, n, -1).to(q.dtype))
        ks.append(t.v.expand(b, h, n, -1).to(k.dtype))
    q2, k2 = torch.cat(qs, -1), torch.cat(ks, -1)
    width = round_up(max(q2.shape[-1], v.shape[-1]), multiple)
    pad = width - q2.shape[-1]
    if pad:
        q2, k2 = F.pad(q2, (0, pad)), F.pad(k2, (0, pad))
    return q2, k2, F.pad(v, (0, width - v.shape[-1]))
