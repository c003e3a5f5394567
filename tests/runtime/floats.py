"""Reading this thread's floating-point mode from the outside: whether subnormals flush to zero."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SUBNORMAL = 1e-39  # below float32's smallest normal number, 1.18e-38


def times_one(value: float) -> float:
    """``value`` stored in float32 and multiplied by one in this thread's floating-point mode."""
    return (torch.tensor([value]) * 1.0).item()


@contextlib.contextmanager
def modes_seen(module: torch.nn.Module) -> Iterator[list[float]]:
    """:func:`times_one` of :data:`SUBNORMAL` at every call of ``module`` while the block runs:
    0.0 where the call ran flushed, SUBNORMAL where it did not."""
    seen: list[float] = []
    handle = module.register_forward_pre_hook(lambda *_: seen.append(times_one(SUBNORMAL)))
    try:
        yield seen
    finally:
        handle.remove()
