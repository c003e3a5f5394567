"""Score-term structures. A mechanism declares each additive score term by its structure;
the reference path materializes every term densely (:meth:`Term.dense`), the fast path picks an
exact algorithm per structure (:mod:`posattn.attention.fast`).

Shapes: b batch, h heads, n length, d head dim. A leading size-1 dim broadcasts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def relative_index(n: int, device: torch.device) -> Tensor:
    """[n, n] index of r = j − i into a table over offsets −(n−1) … n−1 (entry r + n − 1)."""
    pos = torch.arange(n, device=device)
    return pos[None, :] - pos[:, None] + (n - 1)


class Term:
    """An additive score term s_ij += t_ij."""

    def dense(self, n: int) -> Tensor:
        """The term as a broadcastable [b|1, h|1, n, n] tensor (reference path)."""
        raise NotImplementedError


@dataclass
class Toeplitz(Term):
    """t_ij = table[h, j − i + n − 1]: one value per head and offset (T5, TISA, DIET-REL, ...).

    ``window``: the table is constant for r < −window and for r > window (clipped mechanisms):
    those entries are one value with one parameterisation (e.g. clipped copies of the edge
    weight), so the fast path may hand their summed gradient to the entries at r = ∓(window+1).
    ``causal_form``: an equivalent low-rank term that differs from this one by a per-row
    constant on the causal (j ≤ i) side, so it gives the same softmax under a causal mask.
    """

    table: Tensor  # [h, 2n − 1]
    window: int | None = None
    causal_form: "LowRank | None" = None

    def dense(self, n: int) -> Tensor:
        return self.table[:, relative_index(n, self.table.device)].unsqueeze(0)


@dataclass
class LowRank(Term):
    """t_ij = u_i · v_j: folds exactly into extra q/k dimensions (DIET-ABS, TUPE, segment)."""

    u: Tensor  # [b|1, h|1, n, r]
    v: Tensor  # [b|1, h|1, n, r]

    def dense(self, n: int) -> Tensor:
        return self.u @ self.v.transpose(-1, -2)


@dataclass
class QueryRelative(Term):
    """t_ij = scale · q_i · W[clip(j − i, −w, w) + w] (Shaw et al. 2018; Chang Eq 5).

    ``weight``: [2w + 1, d] shared by the heads, or [h, 2w + 1, d].
    ``key_side``: the key-based twin t_ij = scale · k_j · W[clip(i − j, −w, w) + w] (Huang et al.
    2020), with ``vec`` holding k instead of q.
    """

    vec: Tensor  # [b, h, n, d]
    weight: Tensor
    window: int
    scale: float
    key_side: bool = False

    def relative_embeddings(self, n: int) -> Tensor:
        """Shaw's explicit tensor a_ij = W[clip(·)], [n, n, d] or [h, n, n, d]."""
        r = relative_index(n, self.weight.device) - (n - 1)
        r = r.T if self.key_side else r
        return self.weight[..., r.clamp(-self.window, self.window) + self.window, :]

    def dense(self, n: int) -> Tensor:
        a = self.relative_embeddings(n)
        eq = "bhid,ijd->bhij" if a.dim() == 3 else "bhid,hijd->bhij"
        if self.key_side:
            eq = eq.replace("bhid,", "bhjd,")
        return torch.einsum(eq, self.vec, a) * self.scale


@dataclass
class Dense(Term):
    """Anything else: an explicit [b|1, h|1, n, n] tensor (last resort)."""

    bias: Tensor

    def dense(self, n: int) -> Tensor:
        return self.bias
