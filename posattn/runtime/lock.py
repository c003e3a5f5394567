"""One writer per run folder: an exclusive ``fcntl.flock`` on ``.lock`` inside it, held while a run
or a cell writes there.

Two processes resuming one run folder (or one sweep cell) would interleave their checkpoints and
results; with the lock, the second gets one :class:`PositionError` naming the folder and the
process that holds it, and the first finishes undisturbed. The operating system releases the
lock when its holder exits, however it exits, so a killed run never leaves a stale lock behind
(the ``.lock`` file itself stays; it is empty of meaning without the lock). Within one process
the lock is reentrant: a cell runner and the training loop it calls may both take it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from posattn.errors import PositionError

LOCK = ".lock"
_held: dict[tuple[int, Path], int] = {}   # (pid, folder) -> nesting depth of this process's locks


@contextlib.contextmanager
def run_lock(folder: str | Path) -> Iterator[Path]:
    """Hold ``folder``'s lock for the block (creating the folder if needed); yields the folder.
    PositionError at once if another process holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = (os.getpid(), folder.resolve())
    if key in _held:
        _held[key] += 1
        try:
            yield folder
        finally:
            _held[key] -= 1
        return
    f = open(folder / LOCK, "a+")  # noqa: SIM115 - held open as long as the lock
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise PositionError(f"{folder} is in use by another run (process {holder}); wait for it to finish "
                            f"or use another folder; nothing was written") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        _held[key] = 1
        yield folder
    finally:
        _held.pop(key, None)
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
