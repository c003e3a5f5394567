"""Keep freed CPU memory in the process (glibc) so large tensors reuse it instead of page-faulting.

PyTorch's CPU allocator passes every tensor to ``malloc``. glibc serves blocks above its mmap
threshold (at most 32 MiB by default, adapted at run time) with freshly mapped pages and unmaps
them on free, so a training step that allocates the same large activations, scores and
gradients every step faults every page of them in again, and the kernel zeroes each one. At
pretraining shapes that is a large share of a CPU step: a one-block layer at n = 512, batch 64
(``posattn bench``, 2 threads) took 2141 ms a step with the default and 1587 ms with the
thresholds raised (−26%), with SDPA's own step and every mechanism's alike.

:func:`keep_freed_memory` raises the mmap and trim thresholds with ``mallopt`` for this process,
and sets ``GLIBC_TUNABLES`` for child processes (workers, ``torchrun`` ranks) unless the user
set it. The cost: memory freed by Python stays in the process for reuse instead of going back
to the OS, so the resident size stays near its peak. Every ``posattn`` command calls it;
``POSATTN_SYSTEM_MALLOC=1`` leaves malloc as it is. Elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

THRESHOLD = (1 << 31) - 1  # bytes: larger than any block a step allocates here
TUNABLES = f"glibc.malloc.mmap_threshold={THRESHOLD}:glibc.malloc.trim_threshold={THRESHOLD}"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (this process and its children); True when applied."""
    if os.environ.get("POSATTN_SYSTEM_MALLOC", "") not in ("", "0"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl builds without it)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = mallopt(_M_MMAP_THRESHOLD, THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, THRESHOLD) == 1
    if applied:
        os.environ.setdefault("GLIBC_TUNABLES", TUNABLES)
    return applied


def child_environment() -> dict[str, str]:
    """``os.environ`` without the tunables this module set (for memory measurements, which need
    every large block mapped and unmapped so that the peak resident size is the step's own)."""
    return {k: v for k, v in os.environ.items() if not (k == "GLIBC_TUNABLES" and v == TUNABLES)}
