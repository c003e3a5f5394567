"""Independent jobs (sweep cells, pretraining runs) in this process or in spawned worker processes.

Every sweep command (``posattn compare``, ``finetune``, ``pretrain RECIPE``, the Table 3 script)
runs its jobs through :func:`run_jobs`, so they share one rule for threads and for errors: a
worker gets an equal share of this process's torch threads unless told otherwise, and an
exception in a worker reaches the caller as a :class:`~posattn.errors.CellError` that names the
job and carries the worker's traceback as text (some exceptions, such as a compiler error
holding a module, cannot be pickled back at all). A worker killed outright (by the OS for lack
of memory, or a signal) raises a CellError naming the jobs left unfinished; a
``multiprocessing.Pool`` waited for it forever. Conversely, workers end within seconds when the
process that started them is killed, instead of waiting on its queues forever.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterator, Sequence, TypeVar

import torch

from .errors import CellError, cell_failure

J = TypeVar("J")
R = TypeVar("R")


WATCH_SECONDS = 1.0  # how often a worker checks that the process that started it is alive


def _exit_with_parent(parent: int) -> None:
    """Worker initializer: end this worker soon after the sweep's own process dies (killed by a
    scheduler, ``kill``, the OOM killer). The pool's queues would keep it waiting forever, holding
    its memory (seen: two idle workers of a killed ``finetune``, 1.4 GB each, still there 15 minutes on)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="posattn-watch-parent", daemon=True).start()


def _in_worker(args: tuple[Callable[[J, bool], R], J, str, int]) -> R:
    fn, job, label, threads = args
    torch.set_num_threads(threads)
    try:
        return fn(job, True)
    except Exception:
        raise cell_failure(label) from None


def run_jobs(fn: Callable[[J, bool], R], jobs: Sequence[J], labels: Sequence[str], workers: int = 1,
             threads: int | None = None, ordered: bool = True) -> Iterator[R]:
    """``fn(job, in_worker)`` for every job; results in job order, or as they finish when not
    ``ordered``.

    ``workers`` ≤ 1, or a single job: here, one after another (with ``threads`` torch threads
    when given), and ``in_worker`` is False (progress bars may show). Otherwise ``workers``
    spawned processes with ``threads`` torch threads each (default: an equal share of this
    process's); ``fn`` must then be a module-level function and the jobs picklable. A failed
    job raises :class:`~posattn.errors.CellError` naming ``labels[i]``; the pool ends with the
    iteration, also on an error.
    """
    if len(labels) != len(jobs):
        raise ValueError(f"run_jobs: {len(jobs)} jobs but {len(labels)} labels")
    if workers <= 1 or len(jobs) <= 1:
        if threads is not None:
            torch.set_num_threads(threads)
        for job in jobs:
            yield fn(job, False)
        return
    share = threads or max(1, torch.get_num_threads() // workers)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_exit_with_parent, initargs=(os.getpid(),))
    futures = {pool.submit(_in_worker, (fn, job, label, share)): label for job, label in zip(jobs, labels)}
    try:
        for future in (futures if ordered else as_completed(futures)):
            yield future.result()
    except BrokenProcessPool:
        left = [label for f, label in futures.items() if not f.done() or f.exception() is not None]
        _terminate(pool)
        raise CellError(f"a worker process died (killed by the OS, e.g. for lack of memory, or by a signal) "
                        f"with {len(left)} job(s) unfinished: {', '.join(left)}; rerun the command to resume "
                        f"(finished cells are kept), with fewer workers if memory ran out") from None
    except BaseException:  # a failed job, or the caller stopped iterating: end the running siblings now
        _terminate(pool)
        raise
    pool.shutdown()  # all jobs done: let the idle workers exit, running their finalizers


def _terminate(pool: ProcessPoolExecutor) -> None:
    """End the pool now, running jobs included (as ``multiprocessing.Pool.terminate``): a failed job
    must not wait for its siblings, which may run for an hour. ``shutdown`` alone would wait.
    Only for errors: a terminated worker skips its exit finalizers, so semaphores it made (tqdm's
    lock, for one) leak, and Python warns about them at exit."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # shutdown forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
