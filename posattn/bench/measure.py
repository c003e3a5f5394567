"""Timing (interleaved repetitions, medians) and peak memory (child processes) of cases.

Peak memory on CPU: each length's cases run in one child process started with
``MALLOC_MMAP_THRESHOLD_=65536`` (so glibc returns large freed buffers to the OS and resident
memory falls back after each step). Per case, after a warm-up inference pass, the child records
its resident set (VmRSS), resets the high-water mark by writing ``5`` to ``/proc/self/clear_refs``,
runs one step and reads ``VmHWM``: the peak extra memory of that step is VmHWM − VmRSS.
Linux only; elsewhere the memory columns stay empty. On CUDA: in process, the peak of
``torch.cuda.max_memory_allocated`` during the step above what was allocated before it.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..attention import fast
from ..heap import child_environment
from .cases import Case, CaseSpec, Sizes, make_case


def _sync() -> None:
    """Wait for queued GPU work (CUDA kernels run asynchronously)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], None]) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def time_cases(cases: list[Case], repeats: int, warmup: int,
               progress: Callable[[str], None] | None = None) -> dict[CaseSpec, dict[str, list[float]]]:
    """Seconds per training step and per inference pass, every case once per round, rounds
    rotated so no case always runs first."""
    for case in cases:
        for _ in range(warmup):
            case.train()
            case.infer()
    out: dict[CaseSpec, dict[str, list[float]]] = {c.spec: {"train": [], "infer": []} for c in cases}
    for r in range(repeats):
        order = cases[r % len(cases):] + cases[:r % len(cases)]
        for case in order:
            out[case.spec]["train"].append(_timed(case.train))
            out[case.spec]["infer"].append(_timed(case.infer))
        if progress:
            progress(f"round {r + 1}/{repeats}")
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- memory ---------------------------------------------------------------------------------------
def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak(fn: Callable[[], None]) -> float:
    """Peak extra resident memory (MB) of one call of fn."""
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return max(0, _status("VmHWM") - base) / 2 ** 20


def memory_supported() -> bool:
    return sys.platform.startswith("linux") and os.access("/proc/self/clear_refs", os.W_OK)


def child_main() -> None:
    """Child process: read a job from stdin, print one JSON line per case."""
    job = json.load(sys.stdin)
    torch.set_num_threads(job["threads"])
    sizes = Sizes(**job["sizes"])
    policy = fast.policy_for(torch.device(sizes.device), **job.get("policy", {}))
    with fast.using(policy):
        _child_cases(job, sizes)


def _child_cases(job: dict[str, Any], sizes: Sizes) -> None:
    for raw in job["cases"]:
        spec, case = CaseSpec(**raw), None
        try:
            case = make_case(spec, sizes, record=False)
            if case is None:
                continue
            case.infer()  # warm-up (lazy initialisation, thread pools)
            row = {"spec": raw, "train_mb": _peak(case.train), "infer_mb": _peak(case.infer)}
        except Exception as e:  # reported, never fatal: one case may not fit
            row = {"spec": raw, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(row), flush=True)
        del case


def measure_memory(specs: list[CaseSpec], sizes: Sizes, threads: int, timeout: float | None = None,
                   policy: dict[str, Any] | None = None) -> dict[CaseSpec, dict[str, Any]]:
    """Peak training/inference memory (MB) per case, one child process for all of ``specs``."""
    if sizes.device != "cpu":
        return _cuda_memory(specs, sizes)
    if not memory_supported() or not specs:
        return {}
    env = {**child_environment(), "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH")]))}
    job = {"threads": threads, "sizes": asdict(sizes), "cases": [asdict(s) for s in specs],
           "policy": policy or {}}
    proc = subprocess.run([sys.executable, "-c", "from posattn.bench.measure import child_main; child_main()"],
                          input=json.dumps(job), capture_output=True, text=True, env=env, timeout=timeout)
    out: dict[CaseSpec, dict[str, Any]] = {}
    for line in proc.stdout.splitlines():
        row = json.loads(line)
        out[CaseSpec(**row.pop("spec"))] = row
    if proc.returncode and not out:
        raise RuntimeError(f"memory child failed: {proc.stderr.strip()[-2000:]}")
    return out


def _cuda_peak(fn: Callable[[], None]) -> float:
    _sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    _sync()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _cuda_memory(specs: list[CaseSpec], sizes: Sizes) -> dict[CaseSpec, dict[str, Any]]:
    out: dict[CaseSpec, dict[str, Any]] = {}
    for spec in specs:
        try:
            case = make_case(spec, sizes, record=False)
            if case is None:
                continue
            case.infer()
            out[spec] = {"train_mb": _cuda_peak(case.train), "infer_mb": _cuda_peak(case.infer)}
        except Exception as e:  # reported, never fatal: one case may not fit
            out[spec] = {"error": f"{type(e).__name__}: {e}"}
        case = None
        torch.cuda.empty_cache()
    return out
