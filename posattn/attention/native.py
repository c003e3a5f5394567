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
once per environment into torch's extensions folder (``TORCH_EXTENSIONS_DIR``), in a folder keyed by
everything that changes the binary or where its sources lie (:func:`build_key`), so two environments,
or two checkouts sharing one, never rebuild each other's; a build takes 1-3 minutes on 2 cores
(80-175 s measured on a busy 2-core machine). The build, and a wait for another process's build,
each say so on stderr with the time taken. Where they cannot be built, one warning says why and the
pure-PyTorch paths run.
``POSATTN_NATIVE=0`` turns them off.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import sys
import threading
import time
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
STAMP = "posattn.built"   # in the build folder: the _digest() of the sources last built there
TICK = 30.0               # seconds between the "still building / still waiting" lines


def enabled() -> bool:
    """Whether the kernels may be used here: not turned off, a CPU they are compiled for, and not
    inside ``torch.compile`` (dynamo cannot trace a C++ extension: each call would split the graph;
    the compiled step uses the torch paths, which the compiler fuses instead)."""
    if torch.compiler.is_compiling():
        return False
    return (os.environ.get("POSATTN_NATIVE", "1") != "0"
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def kernels() -> ModuleType | None:
    """The compiled module, or None (with one warning) where it cannot be built or is turned off;
    None while ``torch.compile`` traces (see :func:`enabled`), answered before the cached build, so
    that dynamo never traces through the cache (it warns each compiled run that it did)."""
    return None if torch.compiler.is_compiling() else _kernels()


@functools.cache
def _kernels() -> ModuleType | None:
    """:func:`kernels` outside ``torch.compile``: built or loaded once per process."""
    if not enabled():
        return None
    try:
        build = _build_directory()
        with _exclusive(build):
            if (build / STAMP).is_file() and (build / STAMP).read_text() == _digest():
                return _load(build)
            with _announce("building posattn's fused CPU kernels", "(first use in this environment, about 1-3 "
                           "minutes)", "built"):
                module = _load(build)
            (build / STAMP).write_text(_digest())
            return module
    except Exception as e:  # no compiler, no ninja, no writable cache: fall back, say why once
        warnings.warn(f"posattn: the fused CPU kernels could not be built ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); using the PyTorch "
                      f"backward (slower for learned position tables). POSATTN_NATIVE=0 silences this.",
                      stacklevel=3)
        return None


def _load(build: Path) -> ModuleType:
    """Compile (if torch finds the sources or flags changed) and import the module from ``build``."""
    from torch.utils.cpp_extension import load

    return load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=[*FLAGS, _digest()],
                extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)


@contextlib.contextmanager
def _announce(doing: str, note: str, done: str) -> Iterator[None]:
    """Say on stderr that ``doing`` starts (with ``note``), every :data:`TICK` seconds that it goes
    on, and when it ends (``done``), with the time taken: a first run is never silent for minutes."""
    start, stop = time.monotonic(), threading.Event()

    def tick() -> None:
        while not stop.wait(TICK):
            _say(f"... still {doing} ({time.monotonic() - start:.0f} s so far)")

    _say(f"{doing} {note}...")
    ticker = threading.Thread(target=tick, name="posattn-build-ticker", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
    _say(f"fused CPU kernels {done} in {time.monotonic() - start:.0f} s")


def _say(line: str) -> None:
    print(f"posattn: {line}", file=sys.stderr, flush=True)


def _digest() -> str:
    """A define naming the content of every file in ``csrc/``: torch rebuilds when its sources or
    flags change, and this makes a change to the shared header ``kernels.h`` one too."""
    files = sorted(CSRC.glob("*.[ch]*"))
    return "-DPOSATTN_CSRC=" + hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def build_key() -> str:
    """The build folder's name: Python and torch versions (readable), and a hash of everything else
    that changes the binary or where it must live: the environment (``sys.prefix``), the torch
    installation, the compiler (``CXX``), the machine, and the folder of the sources. torch's build
    file names the sources by absolute path and rebuilds, silently, when that path changes: two
    checkouts sharing a folder rebuilt each other's kernels at every alternation (about 100 s each
    on a busy 2-core machine, inside whichever call loaded them first)."""
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    parts = [sys.prefix, sys.version, torch.__version__, str(Path(torch.__file__).parent),
             os.environ.get("CXX", "c++"), platform.machine(), " ".join(FLAGS), str(CSRC.resolve())]
    env = hashlib.sha1("\0".join(parts).encode()).hexdigest()[:12]
    return f"{NAME}-{python}-torch{torch.__version__}-{env}"


def _build_directory() -> Path:
    """Where the kernels are built: a folder per :func:`build_key` in torch's extensions folder
    (``TORCH_EXTENSIONS_DIR`` where set)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    build = Path(root) / build_key()
    build.mkdir(parents=True, exist_ok=True)
    return build


@contextlib.contextmanager
def _exclusive(build: Path) -> Iterator[None]:
    """Hold an OS lock on ``build`` while torch builds or loads there; say so while another process
    holds it (it is building the kernels).

    torch guards a build with a plain ``lock`` file and waits for it to vanish, forever: a build
    that was killed leaves it behind and every later process hangs. An ``flock`` dies with its
    process, and while this process holds it no other posattn build runs, so a ``lock`` file
    found then is stale and removed."""
    with open(build / "posattn.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with _announce("waiting for another process to build the fused CPU kernels", f"(in {build})",
                           "ready"):
                fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes or the process dies
        (build / "lock").unlink(missing_ok=True)
        yield
