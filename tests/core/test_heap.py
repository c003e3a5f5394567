"""posattn.heap: freed large tensors are reused instead of page-faulting fresh memory (glibc)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from posattn import heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

PROBE = """
import json, resource, sys, torch
from posattn.heap import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
faults = []
for _ in range(10):  # 64 MiB tensors, written, freed, allocated again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(1 << 24).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def probe(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**heap.child_environment(), **env})
    return json.loads(out.stdout)


@glibc
def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    pages = (1 << 26) // os.sysconf("SC_PAGE_SIZE")
    default = probe("default", MALLOC_MMAP_THRESHOLD_="65536")
    kept = probe("keep")
    assert kept["applied"] and not default["applied"]
    assert min(default["faults"]) > pages // 2  # every allocation faults its pages in again
    # the freed block is reused once the heap has grown past the aligned request (a few steps)
    assert max(kept["faults"][6:]) < pages // 20


@glibc
def test_opt_out_and_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSATTN_SYSTEM_MALLOC", "1")
    assert heap.keep_freed_memory() is False
    monkeypatch.delenv("POSATTN_SYSTEM_MALLOC")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert heap.keep_freed_memory() is True
    assert os.environ["GLIBC_TUNABLES"] == heap.TUNABLES  # inherited by workers and torchrun ranks
    assert "GLIBC_TUNABLES" not in heap.child_environment()  # memory measurements: the default
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # the user's own: kept
    heap.keep_freed_memory()
    assert heap.child_environment()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


FRAGMENT = """
import json, sys, torch
from posattn import heap
heap.keep_freed_memory()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
blocks = [torch.empty((1 << 20) * (4 + i % 7)).fill_(1.0) for i in range(60)]  # ~1.4 GB, sizes vary
keep = blocks[::6]  # live blocks spread over the heap pin it: the holes between them stay resident
del blocks
before = rss()
released = heap.release_freed_memory()
print(json.dumps({"released": released, "before": before, "after": rss(), "live": sum(b.nbytes for b in keep)}))
"""


@glibc
def test_release_gives_the_holes_of_a_kept_heap_back() -> None:
    out = subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True, text=True, check=True,
                         env=heap.child_environment())
    r = json.loads(out.stdout)
    assert r["released"]
    assert r["before"] > r["live"] + (800 << 20)      # kept: the freed blocks are still resident
    assert r["after"] < r["live"] + (400 << 20)       # released: about the live blocks (and the interpreter) remain
