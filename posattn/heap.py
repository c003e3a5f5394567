"""Keep freed CPU memory in the process (glibc) so large tensors reuse it instead of page-faulting.

PyTorch's CPU allocator passes every tensor to ``malloc``. glibc serves blocks above its mmap
threshold (at most 32 MiB by default, adapted at run time) with freshly mapped pages and unmaps
them on free, so a training step that allocates the same large activations, scores and
gradients every step faults every page of them in again, and the kernel zeroes each one: at
pretraining shapes a large share of a CPU step (measured in the documentation, "How the fast
paths work").

:func:`keep_freed_memory` raises the mmap and trim thresholds with ``mallopt`` for this process,
and sets ``GLIBC_TUNABLES`` for child processes (workers, ``torchrun`` ranks) unless the user
set it. The cost: memory freed by Python stays in the process for reuse instead of going back
to the OS. Every ``posattn`` command calls it; ``POSATTN_SYSTEM_MALLOC=1`` leaves malloc as it
is. Elsewhere than glibc it does nothing.

The resident size does not stay at the step's peak, though: blocks of sizes that change from
step to step (masked-LM batches score a different number of rows each step) leave holes that
later blocks do not fit, and the heap keeps growing. :func:`release_freed_memory`
(``malloc_trim``) hands the free pages back; :func:`~posattn.pretrain.run.pretrain` calls it
every :data:`RELEASE_EVERY` steps, which bounds a long run's resident size for a small share of
its time.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

THRESHOLD = (1 << 31) - 1  # bytes: larger than any block a step allocates here
TUNABLES = f"glibc.malloc.mmap_threshold={THRESHOLD}:glibc.malloc.trim_threshold={THRESHOLD}"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
RELEASE_EVERY = 25  # training steps between two release_freed_memory() calls


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once (``release_freed_memory`` runs every few dozen steps)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (this process and its children); True when applied."""
    if os.environ.get("POSATTN_SYSTEM_MALLOC", "") not in ("", "0"):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc (macOS, Windows, musl builds without it)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = mallopt(_M_MMAP_THRESHOLD, THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, THRESHOLD) == 1
    if applied:
        os.environ.setdefault("GLIBC_TUNABLES", TUNABLES)
    return applied


def release_freed_memory() -> bool:
    """Give the free pages of every malloc arena back to the OS (glibc ``malloc_trim(0)``, which also
    releases whole free pages inside the heap); True when done. Costs a fraction of a second and
    makes the next allocations fault their pages in again, so call it every few dozen steps."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def child_environment() -> dict[str, str]:
    """``os.environ`` without the tunables this module set (for memory measurements, which need
    every large block mapped and unmapped so that the peak resident size is the step's own)."""
    return {k: v for k, v in os.environ.items() if not (k == "GLIBC_TUNABLES" and v == TUNABLES)}
