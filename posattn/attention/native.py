"""Fused CPU kernels in C++ (``csrc/``), compiled on first use by ``torch.utils.cpp_extension``.

PyTorch's fused CPU attention kernels take a bias only as a materialised [b, h, n, n] tensor and
return no gradient for it, so a learned table's gradient (the anti-diagonal sums of dS) or a
clipped relative term's (band sums of dS) needs dS in memory: about a dozen passes over
[b, h, rows, n] tensors. ``csrc/biased_attention.cpp`` adds the bias from its small inputs and
reduces dS into their gradients inside a flash-style forward and backward instead (its header
explains how): :mod:`.flash_bias` uses its backward for tables, :mod:`.fused` both for tables and
query/key-relative bands. ``csrc/depthwise_conv.cpp`` is the channels-last depthwise convolution
of :mod:`posattn.mechanisms.conv`; ``csrc/dropout.cpp`` the counter-based dropout of :mod:`.dropout`.

Needs a C++ compiler with OpenMP and a CPU with AVX2 (the kernels are compiled for it). Compiled
once per machine into torch's extensions folder (``TORCH_EXTENSIONS_DIR``, about a minute on 2
cores); where they cannot be built, one warning says why and the pure-PyTorch paths run.
``POSATTN_NATIVE=0`` turns them off.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
NAME = "posattn_native"
SOURCES = [CSRC / name for name in ("module.cpp", "biased_attention.cpp", "depthwise_conv.cpp", "dropout.cpp")]
BLOCK = 256  # query rows per block of the attention kernels (backward at n = 512: 256 and 512 tie, 128 is 4% slower)
FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]


def enabled() -> bool:
    """Whether the kernels may be used here: not turned off, and a CPU they are compiled for."""
    return (os.environ.get("POSATTN_NATIVE", "1") != "0"
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled module, or None (with one warning) where it cannot be built or is turned off."""
    if not enabled():
        return None
    from torch.utils.cpp_extension import load

    try:
        build = _build_directory()
        if not any(build.glob(f"{NAME}*.so")):
            print("posattn: compiling the fused CPU kernels (once per machine, about a minute)...", file=sys.stderr,
                  flush=True)
        with _exclusive(build):
            return load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=[*FLAGS, _digest()],
                        extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:  # no compiler, no ninja, no writable cache: fall back, say why once
        warnings.warn(f"posattn: the fused CPU kernels could not be built ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); using the PyTorch "
                      f"backward (slower for learned position tables). POSATTN_NATIVE=0 silences this.",
                      stacklevel=2)
        return None


def _digest() -> str:
    """A define naming the content of every file in ``csrc/``: torch rebuilds when its sources or
    flags change, and this makes a change to the shared header ``kernels.h`` one too."""
    files = sorted(CSRC.glob("*.[ch]*"))
    return "-DPOSATTN_CSRC=" + hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def _build_directory() -> Path:
    """Where the kernels are built: a folder per Python and torch version in torch's extensions
    folder (``TORCH_EXTENSIONS_DIR`` where set)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    build = Path(root) / f"{NAME}-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    return build


@contextlib.contextmanager
def _exclusive(build: Path) -> Iterator[None]:
    """Hold an OS lock on ``build`` while torch builds or loads there.

    torch guards a build with a plain ``lock`` file and waits for it to vanish, forever: a build
    that was killed leaves it behind and every later process hangs. An ``flock`` dies with its
    process, and while this process holds it no other posattn build runs, so a ``lock`` file
    found then is stale and removed."""
    with open(build / "posattn.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes or the process dies
        (build / "lock").unlink(missing_ok=True)
        yield
