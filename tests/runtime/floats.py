"""Reading this thread's floating-point mode from the outside: whether subnormals flush to zero."""
from __future__ import annotations

import torch

SUBNORMAL = 1e-39  # below float32's smallest normal number, 1.18e-38


def times_one(value: float) -> float:
    """``value`` stored in float32 and multiplied by one in this thread's floating-point mode."""
    return (torch.tensor([value]) * 1.0).item()
