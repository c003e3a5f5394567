"""This process's place in a (possibly single-process) data-parallel job started by ``torchrun``.

:func:`init_world` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and
starts the process group: NCCL on CUDA, gloo on the CPU. Outside torchrun it is one process of
rank 0, and every collective below is a no-op.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from posattn.errors import PositionError
from posattn.runtime.device import resolve_device
from posattn.runtime.rng import rng_state, set_rng_state


@dataclass(frozen=True)
class World:
    """This process's rank among ``size`` processes; rank 0 (``main``) writes every file."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def gather_rng(self, device: torch.device) -> list[Any]:
        """Every rank's RNG state (its dropout stream), gathered on all ranks, for a checkpoint."""
        mine = rng_state(device)
        if self.size == 1:
            return [mine]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, mine)
        return out

    def set_rng(self, states: list[Any], device: torch.device) -> None:
        """Restore this rank's RNG state from what :meth:`gather_rng` saved."""
        if len(states) != self.size:
            raise PositionError(f"the checkpoint was written by {len(states)} processes, this run has {self.size}; "
                                f"resume with the same number of processes")
        set_rng_state(states[self.rank], device)


def init_world(device: str) -> tuple[World, torch.device]:
    """Read torchrun's environment; start the process group (NCCL on CUDA, gloo on CPU)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    world = World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", world.local_rank if size > 1 else torch.cuda.current_device())
    if size > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return world, dev
