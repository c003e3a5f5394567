"""Packed documents laid out apart: the slot layout shared by the mechanisms that convolve or
mix along the sequence (packed sequences).

A packed row holds several documents back to back (``Context.documents``, non-decreasing
along the row). A convolution or a block structure must not reach from one document into the
next. Rather than masking every algorithm separately, the tokens are *placed* in a longer row
of slots where each document begins a fresh span, after ``gap`` empty (zero) slots and aligned
to a multiple of ``block``: any operation that reads at most ``gap`` slots away (a convolution
with ``gap`` ≥ its reach) or works on aligned blocks then sees each document exactly as if it
ran alone, zeros standing where the sequence would have ended. The same layout, with one
document per row, places a row whose first position is not a multiple of the block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import document_rank


@dataclass(frozen=True)
class DocumentSlots:
    """Token t of row r sits at slot ``slot[r, t]`` of a row of ``size`` slots; ``token[r, s]``
    is the token at slot s (clamped to a valid index; ``filled`` says whether it is a token)."""

    slot: Tensor  # [b, n] long
    token: Tensor  # [b, size] long
    filled: Tensor  # [b, size] bool
    size: int

    @staticmethod
    def build(documents: Tensor | None, n: int, batch: int, device: torch.device, gap: int = 0,
              block: int = 1, lead: Tensor | None = None) -> DocumentSlots:
        """Each document's span: ``lead`` empty slots (per token [b, n], read at the document's
        first token; default 0), its tokens, ``gap`` empty slots, rounded up to a multiple of
        ``block``; the spans follow each other. ``documents`` None: one document per row, in the
        most slots any lead could need (with a lead, up to one block more than it needs, empty): a
        size known without reading the data, so no host sync splits a compiled step and eager and
        compiled lay a row out alike. Packed rows read their document count and size from the data
        (a host sync)."""
        one = documents is None
        rank = torch.zeros(batch, n, dtype=torch.long, device=device) if one else document_rank(documents)
        docs = 1 if one else int(rank.max()) + 1
        length = torch.zeros(batch, docs, dtype=torch.long, device=device).scatter_add_(1, rank, torch.ones_like(rank))
        index = torch.arange(n, device=device).expand(batch, n)
        start = torch.zeros_like(length).scatter_reduce_(1, rank, index, "amin", include_self=False)
        first = torch.zeros_like(length) if lead is None else lead.gather(1, start)
        span = (first + length + gap + block - 1) // block * block
        span = torch.where(length > 0, span, torch.zeros_like(span))  # ranks a shorter row lacks
        base = span.cumsum(-1) - span
        slot = (base + first - start).gather(1, rank) + index
        if one:  # a bound known before the data (exact without a lead): no host sync
            size = (n + gap + (0 if lead is None else block - 1) + block - 1) // block * block
        else:
            size = int(span.sum(-1).max())
        token = torch.zeros(batch, size, dtype=torch.long, device=device).scatter_(1, slot, index)
        filled = torch.zeros(batch, size, dtype=torch.bool, device=device).scatter_(
            1, slot, torch.ones_like(slot, dtype=torch.bool))
        return DocumentSlots(slot, token, filled, size)

    def place(self, t: Tensor, dim: int) -> Tensor:
        """Tokens along ``dim`` (the batch is dim 0) -> slots, zeros in empty slots."""
        if dim == 1 and t.is_contiguous():  # whole rows of [b·n, …]: one copy each way, no index tensor
            b, n = self.slot.shape
            rows = t.new_zeros((b * self.size,) + t.shape[2:])
            return rows.index_copy(0, self._flat(self.slot, self.size), t.flatten(0, 1)).unflatten(0, (b, self.size))
        idx = self._index(self.token, t, dim)
        mask = self._index(self.filled, t, dim, expand=False).to(t.dtype)
        return t.gather(dim, idx) * mask

    def take(self, t: Tensor, dim: int) -> Tensor:
        """Slots along ``dim`` -> the tokens' own slots."""
        if dim == 1 and t.is_contiguous():
            b, n = self.slot.shape
            return t.flatten(0, 1).index_select(0, self._flat(self.slot, self.size)).unflatten(0, (b, n))
        return t.gather(dim, self._index(self.slot, t, dim))

    @staticmethod
    def _flat(idx: Tensor, width: int) -> Tensor:
        """Row r's index i -> r·width + i, flattened."""
        return (idx + torch.arange(idx.shape[0], device=idx.device)[:, None] * width).flatten()

    @staticmethod
    def _index(idx: Tensor, t: Tensor, dim: int, expand: bool = True) -> Tensor:
        """[b, m] -> broadcast to t's shape with m along ``dim``."""
        dim = dim % t.dim()
        shape = [idx.shape[0]] + [1] * (t.dim() - 1)
        shape[dim] = idx.shape[1]
        out = idx.view(shape)
        if not expand:
            return out
        full = list(t.shape)
        full[dim] = idx.shape[1]
        return out.expand(full)
