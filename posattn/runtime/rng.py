"""The RNG state a checkpoint carries (dropout streams), as tensors only, so that it loads without
unpickling anything (:mod:`posattn.runtime.checkpoint`)."""
from __future__ import annotations

from typing import Any

import torch


def rng_state(device: torch.device) -> dict[str, torch.Tensor | None]:
    """This process's RNG state (CPU, and the CUDA device's when training there), for a checkpoint."""
    return {"rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["rng"])
    if device.type == "cuda" and state.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(state["cuda_rng"], device)
