"""Fused CPU kernels in C++ (``csrc/``), compiled on first use by ``torch.utils.cpp_extension``.

PyTorch's fused CPU attention kernels take a bias only as a materialised [b, h, n, n] tensor and
return no gradient for it, so a learned table's gradient (the anti-diagonal sums of dS) or a
clipped relative term's (band sums of dS) needs dS in memory: about a dozen passes over
[b, h, rows, n] tensors. ``csrc/biased_attention.cpp`` adds the bias from its small inputs and
reduces dS into their gradients inside a flash-style forward and backward instead (its header
explains how): :mod:`.flash_bias` uses its backward for tables, :mod:`.fused` both for tables and
query/key-relative bands. ``csrc/depthwise_conv.cpp`` is the channels-last depthwise convolution
of :mod:`posattn.mechanisms.conv`.

Needs a C++ compiler with OpenMP and a CPU with AVX2 (the kernels are compiled for it). Compiled
once per machine into torch's extensions folder (``TORCH_EXTENSIONS_DIR``, about a minute on 2
cores); where they cannot be built, one warning says why and the pure-PyTorch paths run.
``POSATTN_NATIVE=0`` turns them off.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("module.cpp", "biased_attention.cpp", "depthwise_conv.cpp")]
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

    if not _built():
        print("posattn: compiling the fused CPU kernels (once per machine, about a minute)...", file=sys.stderr,
              flush=True)
    try:
        return load(name="posattn_native", sources=[str(s) for s in SOURCES], extra_cflags=[*FLAGS, _digest()],
                    extra_ldflags=["-fopenmp"], verbose=False)
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


def _built() -> bool:
    """Whether a build of the kernels is already in torch's extensions folder (then loading is quick)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return any(Path(_get_build_directory("posattn_native", False)).glob("posattn_native*.so"))
    except Exception:  # a private helper of torch: when it moves, just say nothing
        return True
