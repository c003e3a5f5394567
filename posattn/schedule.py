"""The learning-rate schedule of every training loop: linear warmup, then linear or cosine decay.

``posattn pretrain`` and ``posattn finetune`` decay linearly to 0 (BERT, ELECTRA: Chang et al.
Table 5); ``posattn compare`` decays on a cosine (Zoology).
"""

from __future__ import annotations

import math
from typing import Literal


def warmup_steps(warmup: float, total: int) -> int:
    """Warmup length in steps: ``warmup`` below 1 is a fraction of ``total``, else a step count."""
    return int(warmup * total) if warmup < 1 else int(warmup)


def lr_factor(step: int, total: int, warm: int, decay: Literal["linear", "cosine"] = "linear",
              floor: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    ``(step + 1) / warm`` during the ``warm`` warmup steps; then, with progress
    p = (step − warm) / (total − warm) clipped to 1, ``floor + (1 − floor)·(1 − p)`` (linear) or
    ``floor + (1 − floor)·½(1 + cos πp)`` (cosine), reaching ``floor`` at ``total``.
    """
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * shape
