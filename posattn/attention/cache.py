"""Inference cache for position-only score biases.

A bias that depends on positions alone (Toeplitz tables: T5, TISA, DIET-REL, ALiBi; position-only
low-rank terms: DIET-ABS's P_Q P_Kᵀ, TUPE) is the same for every batch, and for every layer
that shares the mechanism's parameters. When no gradient is needed, the fast path's dense
bias comes from here: built once per length and content, reused until it changes.

The key is the *content* of the term tensors, not their identity: mechanisms rebuild their
tables every forward, so an identity key would never hit, and a parameter update must never
be served a stale bias. A lookup compares the small term tensors (O(n·r) or O(n)) with the
stored copies; the saving is the O(h·n²) bias. Least recently used entries are evicted beyond
``max_bytes`` (biases plus stored keys).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class PositionCache:
    """Content-keyed LRU store of materialized position-only biases."""

    def __init__(self, max_bytes: int = 1 << 28) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, tuple[tuple[Tensor, ...], Tensor]] = OrderedDict()
        self.hits = self.misses = 0
        self._next = 0

    def get(self, n: int, parts: Sequence[Tensor], build: Callable[[], Tensor]) -> Tensor:
        """The bias for length ``n`` and term tensors ``parts`` (built by ``build`` on a miss).
        Inside ``torch.compile`` always built: the content comparison is a host sync that would
        split a compiled step, and the compiler keeps what does not change from step to step."""
        if torch.compiler.is_compiling():
            with torch.no_grad():
                return build()
        for key, (stored, bias) in self.entries.items():
            if bias.shape[-1] == n and len(stored) == len(parts) and all(
                    s.shape == p.shape and s.dtype == p.dtype and s.device == p.device
                    and torch.equal(s, p) for s, p in zip(stored, parts)):
                self.entries.move_to_end(key)
                self.hits += 1
                return bias
        self.misses += 1
        with torch.no_grad():
            bias = build()
            stored = tuple(p.detach().clone() for p in parts)
        size = _nbytes(bias) + sum(_nbytes(s) for s in stored)
        if size > self.max_bytes:
            return bias
        self.entries[self._next] = (stored, bias)
        self._next += 1
        while sum(_nbytes(b) + sum(_nbytes(s) for s in st) for st, b in self.entries.values()) > self.max_bytes:
            self.entries.popitem(last=False)
        return bias

    def clear(self) -> None:
        self.entries.clear()
        self.hits = self.misses = 0


POSITION_CACHE = PositionCache()
