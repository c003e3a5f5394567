"""Deterministic batch order: the examples of a step are a function of (seed, step) alone, so a run
resumed from any checkpoint sees the same batches as an uninterrupted one."""
from __future__ import annotations

import torch


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Example indices of ``step`` among ``n``: consecutive slices of per-epoch permutations seeded
    by ``(seed, epoch)``; a batch that crosses an epoch's end continues in the next permutation."""
    first = step * batch_size
    parts = []
    while first < (step + 1) * batch_size:
        epoch, offset = divmod(first, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        take = min(n - offset, (step + 1) * batch_size - first)
        parts.append(perm[offset:offset + take])
        first += take
    return torch.cat(parts)
