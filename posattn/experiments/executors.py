"""Executors: where a sweep's cells run. One interface, :meth:`Executor.map`, for every sweep command
(``posattn compare``, ``finetune``, ``pretrain RECIPE``, ``posattn.hf.table3``).

``map(fn, jobs, labels, read=...)`` calls ``fn(job, in_worker)`` for every job and yields, in job
order, each job's result, or :class:`NotStarted` for a job that the time budget kept from starting.
A failed job raises :class:`~posattn.errors.CellError` naming its label and carrying the worker's
traceback as text (some exceptions, such as a compiler error holding a module, cannot be pickled
back at all).

The time budget (``deadline``, a :func:`time.time` instant): after it no new job starts; jobs
already running finish, since a cell stopped half way would waste its work (its checkpoint is
kept, but a cell in the middle of its test evaluations has none). A job past the deadline whose
result is already in its files (``read(job)``) yields that result, so a resumed sweep's finished
cells count as finished. For a hard stop as well, run the command under ``timeout``: a killed
cell resumes from its last checkpoint on the next invocation.

:class:`LocalExecutor` runs the jobs in this process or in spawned worker processes. A worker gets
an equal share of this process's torch threads unless told otherwise. A worker killed outright (by
the OS for lack of memory, or a signal) raises a CellError naming the jobs left unfinished (a
``multiprocessing.Pool`` waited for it forever); conversely, workers end within seconds when the
process that started them is killed, instead of waiting on its queues forever.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from posattn.errors import CellError, PositionError, cell_failure

J = TypeVar("J")
R = TypeVar("R")

WATCH_SECONDS = 1.0  # how often a worker checks that the process that started it is alive


@dataclass(frozen=True)
class NotStarted:
    """What :meth:`Executor.map` yields for a job the time budget kept from starting."""

    label: str


def deadline_after(seconds: float | None) -> float | None:
    """The instant ``seconds`` from now (``None``: no time budget); a negative budget is refused."""
    if seconds is None:
        return None
    if not seconds >= 0:
        raise PositionError(f"--time-limit must be a number of seconds >= 0, got {seconds!r}")
    return time.time() + seconds


def budget_note(finished: int, total: int, what: str = "cells") -> str | None:
    """The line a command prints when its time budget left ``total - finished`` jobs for a later
    invocation; None when every job is finished."""
    if finished >= total:
        return None
    return (f"time limit: {finished} of {total} {what} finished, {total - finished} remain; "
            f"rerun the same command to resume")


class Executor:
    """Runs a sweep's jobs; subclasses say where. ``deadline``: no job starts after this
    :func:`time.time` instant (None: no limit)."""

    deadline: float | None = None

    @property
    def in_process(self) -> bool:
        """True when the jobs run in this very process (so they may show progress bars and share
        what it built), False when they run in other processes or on other machines."""
        return False

    def map(self, fn: Callable[[J, bool], R], jobs: Sequence[J], labels: Sequence[str], *,
            read: Callable[[J], R | None] | None = None, ordered: bool = True) -> Iterator[R | NotStarted]:
        """``fn(job, in_worker)`` for every job: results in job order (or as they finish when not
        ``ordered``), :class:`NotStarted` for a job past the deadline whose ``read(job)`` (its
        result read back from its files, None if it has none) is None."""
        raise NotImplementedError

    def _started(self) -> bool:
        return self.deadline is None or time.time() < self.deadline


def _check_labels(jobs: Sequence[Any], labels: Sequence[str]) -> None:
    if len(labels) != len(jobs):
        raise ValueError(f"executor: {len(jobs)} jobs but {len(labels)} labels")


def _read_back(outcome: Any, job: Any, read: Callable[[Any], Any] | None) -> Any:
    """A job's outcome, with a job the deadline kept from starting replaced by its result on file, if any."""
    if isinstance(outcome, NotStarted) and read is not None:
        found = read(job)
        return outcome if found is None else found
    return outcome


def _exit_with_parent(parent: int) -> None:
    """Worker initializer: end this worker soon after the sweep's own process dies (killed by a
    scheduler, ``kill``, the OOM killer). The pool's queues would keep it waiting forever, holding
    its memory (seen: two idle workers of a killed ``finetune``, 1.4 GB each, still there 15 minutes on)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="posattn-watch-parent", daemon=True).start()


def _in_worker(args: tuple[Callable[[J, bool], R], J, str, int, float | None]) -> R | NotStarted:
    fn, job, label, threads, deadline = args
    if deadline is not None and time.time() >= deadline:
        return NotStarted(label)
    torch.set_num_threads(threads)
    try:
        return fn(job, True)
    except Exception:  # noqa: BLE001 - any failure of a cell becomes one CellError naming it
        raise cell_failure(label) from None


class LocalExecutor(Executor):
    """This machine. ``workers`` ≤ 1, or a single job: in this process, one after another (with
    ``threads`` torch threads when given), and ``in_worker`` is False (progress bars may show).
    Otherwise ``workers`` spawned processes with ``threads`` torch threads each (default: an equal
    share of this process's); ``fn`` must then be a module-level function and the jobs picklable.
    The pool ends with the iteration, also on an error."""

    def __init__(self, workers: int = 1, threads: int | None = None, deadline: float | None = None) -> None:
        if workers < 1 or (threads is not None and threads < 1):
            raise PositionError(f"--workers and --threads must be >= 1, got {workers} and {threads}")
        self.workers, self.threads, self.deadline = workers, threads, deadline

    @property
    def in_process(self) -> bool:
        return self.workers <= 1

    def map(self, fn: Callable[[J, bool], R], jobs: Sequence[J], labels: Sequence[str], *,
            read: Callable[[J], R | None] | None = None, ordered: bool = True) -> Iterator[R | NotStarted]:
        _check_labels(jobs, labels)
        if self.workers <= 1 or len(jobs) <= 1:
            if self.threads is not None:
                torch.set_num_threads(self.threads)
            for job, label in zip(jobs, labels):
                yield fn(job, False) if self._started() else _read_back(NotStarted(label), job, read)
            return
        yield from self._pool(fn, jobs, labels, read, ordered)

    def _pool(self, fn: Callable[[J, bool], R], jobs: Sequence[J], labels: Sequence[str],
              read: Callable[[J], R | None] | None, ordered: bool) -> Iterator[R | NotStarted]:
        share = self.threads or max(1, torch.get_num_threads() // self.workers)
        pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_exit_with_parent, initargs=(os.getpid(),))
        futures = {pool.submit(_in_worker, (fn, job, label, share, self.deadline)): (job, label)
                   for job, label in zip(jobs, labels)}
        try:
            for future in (futures if ordered else as_completed(futures)):
                yield _read_back(future.result(), futures[future][0], read)
        except BrokenProcessPool:
            left = [label for f, (_, label) in futures.items() if not f.done() or f.exception() is not None]
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


def add_executor_options(parser: Any, workers: int = 1) -> None:
    """The options that say where and how long a sweep command runs its cells: ``--workers`` and
    ``--time-limit`` (every sweep command adds them here, so they mean the same everywhere)."""
    parser.add_argument("--workers", type=int, default=workers,
                        help=f"cells run at once on this machine, each in its own process (default {workers})")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="start no new cell after SECONDS (running cells finish), write the partial report, "
                             "say how many cells remain and exit 0; rerunning the command resumes. For a hard stop "
                             "as well, run under `timeout`: a killed cell resumes from its last checkpoint")


def executor_from(args: Any, threads: int | None = None) -> Executor:
    """The executor the parsed options of :func:`add_executor_options` ask for; its time budget
    starts now. ``threads``: torch threads per worker (None: an equal share of this process's)."""
    return LocalExecutor(args.workers, threads, deadline_after(args.time_limit))
