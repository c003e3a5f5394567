"""A ``checkpoint.pt`` that runs code when unpickled: the file a user might copy into a run folder."""
from __future__ import annotations

from pathlib import Path

import torch


class Payload:
    """Unpickling this object calls ``open(marker, "w")``: the marker file appears iff code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant(folder: Path, marker: Path) -> Path:
    """Write a checkpoint carrying a :class:`Payload` into ``folder``; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "checkpoint.pt"
    torch.save({"config": {}, "model": {}, "step": 0, "payload": Payload(marker)}, path)
    return path
