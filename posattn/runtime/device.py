"""Where and in what precision a run computes: the device ("auto" picks CUDA when present) and
the autocast context of a precision (bf16 / fp16 / fp32; fp16 also needs loss scaling)."""
from __future__ import annotations

import contextlib

import torch

from posattn.errors import PositionError


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` picks CUDA when available, else CPU; anything else is passed to ``torch.device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def autocast(precision: str, device: torch.device) -> tuple[contextlib.AbstractContextManager, bool]:
    """The autocast context for ``precision`` on ``device`` and whether fp16 loss scaling is needed.
    ``precision`` is one of ``auto`` (bf16 on a CUDA device that supports it, else fp32), ``fp32``,
    ``bf16``, ``fp16`` (CUDA only; :mod:`posattn.pretrain.config` validates it)."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext(), False
    if precision == "fp16" and device.type != "cuda":
        raise PositionError("precision fp16 needs a CUDA device; use bf16 or fp32 on the CPU")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype), precision == "fp16"
