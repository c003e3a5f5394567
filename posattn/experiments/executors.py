"""Executors: where a sweep's cells run. One interface, :meth:`Executor.map`, for every sweep command
(``posattn compare``, ``finetune``, ``pretrain RECIPE``, ``study table3``).

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

:class:`SlurmExecutor` runs them as a Slurm job array through submitit, on a filesystem that the
cluster's nodes share: each array task runs a shard of the cells one after another. Cells are
keyed by their content and every sweep resumes its cells, so a requeued task (submitit requeues
one that hits its time limit) or a duplicated one (the command run twice) finds the cells already
finished and skips them. Results are read back from the cells' files (``read``), falling back on
the task's returned value only for a sweep that has none, so the report is the one a single
machine writes. submitit is imported only when this executor is chosen.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from posattn.errors import CellError, PositionError, cell_failure
from posattn.experiments.config import is_int

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


class _Shard:
    """One array task's work: its jobs one after another, each as a worker runs it (the deadline
    checked before each, a failure raised as a CellError naming the job). Having ``checkpoint``
    makes submitit requeue the task when it hits its time limit; the requeued task runs the same
    shard and the sweep's resume skips the cells already finished."""

    def __init__(self, fn: Callable[[Any, bool], Any], jobs: list[Any], labels: list[str], threads: int,
                 deadline: float | None) -> None:
        self.fn, self.jobs, self.labels, self.threads, self.deadline = fn, jobs, labels, threads, deadline

    def __call__(self) -> list[Any]:
        return [_in_worker((self.fn, job, label, self.threads, self.deadline))
                for job, label in zip(self.jobs, self.labels)]

    def checkpoint(self) -> Any:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)


def _submitit() -> Any:
    """The submitit module, or one clear error saying how to install it."""
    try:
        import submitit
    except ImportError:
        raise PositionError("--executor slurm needs submitit, which is not installed: "
                            "pip install 'posattn[slurm]'") from None
    return submitit


class SlurmExecutor(Executor):
    """A Slurm job array through submitit: at most ``array_parallelism`` tasks, each running a
    shard of the jobs (job i goes to task i mod tasks, so the first cells of a sweep, its first
    seeds, spread over all tasks) with ``gpus_per_task`` GPUs, ``threads`` CPUs and
    ``time_minutes`` minutes on ``partition``; logs, submission files and returned values under
    ``folder``, which every node must see. ``cluster``: submitit's (None: Slurm where ``sbatch``
    exists, else local processes; ``"local"`` runs the array tasks as processes of this machine)."""

    POLL_SECONDS = 1.0

    def __init__(self, folder: str | Path, *, partition: str | None = None, gpus_per_task: int = 0,
                 time_minutes: int = 60, array_parallelism: int = 16, threads: int | None = None,
                 deadline: float | None = None, cluster: str | None = None) -> None:
        problems = [f"{name} must be an integer >= {low}, got {value!r}" for name, value, low in
                    [("--gpus-per-task", gpus_per_task, 0), ("--slurm-time", time_minutes, 1),
                     ("--array-parallelism", array_parallelism, 1), ("--threads", threads or 1, 1)]
                    if not is_int(value, low)]
        if problems:
            raise PositionError("slurm executor: " + "; ".join(problems))
        self.submitit = _submitit()
        self.folder, self.partition, self.gpus_per_task = Path(folder), partition, gpus_per_task
        self.time_minutes, self.array_parallelism, self.threads = time_minutes, array_parallelism, threads or 1
        self.deadline, self.cluster = deadline, cluster

    def _executor(self) -> Any:
        executor = self.submitit.AutoExecutor(folder=self.folder, cluster=self.cluster)
        if self.cluster is None and executor.cluster != "slurm":
            print(f"posattn: no Slurm on this machine (sbatch not found): submitit runs the array tasks as "
                  f"{executor.cluster} processes here", file=sys.stderr)
        executor.update_parameters(name="posattn", timeout_min=self.time_minutes, nodes=1, tasks_per_node=1,
                                   gpus_per_node=self.gpus_per_task, cpus_per_task=self.threads,
                                   slurm_partition=self.partition, slurm_array_parallelism=self.array_parallelism)
        return executor

    def map(self, fn: Callable[[J, bool], R], jobs: Sequence[J], labels: Sequence[str], *,
            read: Callable[[J], R | None] | None = None, ordered: bool = True) -> Iterator[R | NotStarted]:
        _check_labels(jobs, labels)
        if not jobs:
            return
        n = min(len(jobs), self.array_parallelism)
        shards = [list(range(i, len(jobs), n)) for i in range(n)]
        self.folder.mkdir(parents=True, exist_ok=True)
        tasks = self._executor().submit_array(
            [_Shard(fn, [jobs[i] for i in shard], [labels[i] for i in shard], self.threads, self.deadline)
             for shard in shards])
        outcomes: dict[int, Any] = {}
        pending = dict(enumerate(tasks))
        given = 0
        try:
            while pending:
                for s in [s for s, task in pending.items() if task.done()]:
                    outcomes.update(self._collect(pending.pop(s), shards[s], jobs, labels, read))
                    if not ordered:
                        yield from (outcomes[i] for i in shards[s])
                while ordered and given in outcomes:
                    yield outcomes[given]
                    given += 1
                if pending:
                    time.sleep(self.POLL_SECONDS)
        except BaseException:   # a failed task, or the caller stopped iterating: cancel the tasks left
            for task in pending.values():
                task.cancel(check=False)
            raise

    def _collect(self, task: Any, shard: list[int], jobs: Sequence[Any], labels: Sequence[str],
                 read: Callable[[Any], Any] | None) -> dict[int, Any]:
        """The outcomes of one finished array task: each job's result as its files hold it (else as
        the task returned it); a task that failed raises a CellError naming its first unfinished job."""
        found = {i: r for i in shard if read is not None and (r := read(jobs[i])) is not None}
        try:
            returned = task.result()
        except Exception as e:  # noqa: BLE001 - a failed or killed task: name the cell it left unfinished
            left = [labels[i] for i in shard if i not in found]
            if not left:
                return found
            raise CellError(f"{left[0]} failed in array task {task.job_id} (log {task.paths.stderr}); "
                            f"{len(left)} cell(s) of that task unfinished; rerun the command to resume "
                            f"(finished cells are kept). Its error:\n{e}") from None
        return {i: found.get(i, _read_back(r, jobs[i], read)) for i, r in zip(shard, returned)}


EXECUTORS = ("local", "slurm")
OPTIONS = {   # config key (the option's name with underscores) -> type; an `executor:` block uses the same keys
    "executor": str, "workers": int, "time_limit": float, "slurm_partition": str, "gpus_per_task": int,
    "slurm_time": int, "array_parallelism": int, "slurm_folder": str}
KIND_NAMES = {str: "a string", int: "an integer", float: "a number"}
SLURM_USAGE = """\
Executors: --executor local (default) runs the cells on this machine, --workers at a time.
--executor slurm submits them as a Slurm job array through submitit (pip install 'posattn[slurm]'):
each array task runs a shard of the cells on the filesystem the nodes share, and a requeued or
duplicated task skips the cells already finished, so the report is the one a single machine writes:
  posattn compare cat_fair_mqar --executor slurm --slurm-partition gpu --gpus-per-task 1"""
BLOCK_USAGE = """\
A config may hold the same settings as an `executor:` block (command-line options win):
  executor: {executor: slurm, slurm_partition: gpu, gpus_per_task: 1, slurm_time: 120, array_parallelism: 16}"""


def add_executor_options(parser: Any, workers: int = 1, block: bool = True) -> None:
    """The options that say where and how long a sweep command runs its cells (every sweep command
    adds them here, so they mean the same everywhere); :data:`SLURM_USAGE` explains them at the
    end of the command's help (and :data:`BLOCK_USAGE` for commands whose config may hold an
    ``executor:`` block, ``block``)."""
    parser.set_defaults(default_workers=workers)
    usage = f"{SLURM_USAGE}\n{BLOCK_USAGE}" if block else SLURM_USAGE
    parser.epilog = f"{parser.epilog}\n\n{usage}" if parser.epilog else usage
    parser.add_argument("--executor", choices=EXECUTORS, default=None,
                        help="where the cells run: local (this machine; default) or slurm (a Slurm job array "
                             "through submitit)")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"local: cells run at once on this machine, each in its own process (default {workers})")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="start no new cell after SECONDS (running cells finish), write the partial report, "
                             "say how many cells remain and exit 0; rerunning the command resumes. For a hard stop "
                             "as well, run under `timeout`: a killed cell resumes from its last checkpoint")
    parser.add_argument("--slurm-partition", default=None, help="slurm: the partition (default: the cluster's)")
    parser.add_argument("--gpus-per-task", type=int, default=None, help="slurm: GPUs per array task (default 0)")
    parser.add_argument("--slurm-time", type=int, default=None, metavar="MINUTES",
                        help="slurm: time limit of an array task in minutes (default 60); a task that hits it is "
                             "requeued and resumes its shard")
    parser.add_argument("--array-parallelism", type=int, default=None,
                        help="slurm: array tasks (and so shards of the cells) at most, all of which may run at "
                             "once (default 16)")
    parser.add_argument("--slurm-folder", default=None,
                        help="slurm: folder of the tasks' logs and submission files, seen by every node "
                             "(default <out>/slurm)")


def block_problems(block: Any) -> list[str]:
    """What is wrong with a config's ``executor:`` block (None: there is none); [] if nothing."""
    if block is None:
        return []
    if not isinstance(block, dict):
        return [f"executor must be a mapping of {', '.join(OPTIONS)}, got {block!r}"]
    unknown = sorted(map(str, set(block) - set(OPTIONS)))
    problems = [f"executor: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(OPTIONS)}"] if unknown else []
    for key, kind in OPTIONS.items():
        value = block.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float) if kind is float
                                                                          else kind)):
            problems.append(f"executor: {key} must be {KIND_NAMES[kind]}, got {value!r}")
    if block.get("executor") not in (None, *EXECUTORS):
        problems.append(f"executor: executor must be one of {', '.join(EXECUTORS)}, got {block['executor']!r}")
    return problems


def executor_from(args: Any, threads: int | None = None, block: dict[str, Any] | None = None,
                  out: str | Path | None = None) -> Executor:
    """The executor the parsed options of :func:`add_executor_options` ask for, over the config's
    ``executor:`` block (``block``, checked with :func:`block_problems`); its time budget starts now.
    ``threads``: torch threads per cell (None: locally, an equal share of this process's; on Slurm, 1).
    ``out``: the sweep's output folder, home of the Slurm logs unless --slurm-folder says otherwise."""
    problems = block_problems(block)
    if problems:
        raise PositionError("; ".join(problems))
    options = {k: v for k in OPTIONS if (v := getattr(args, k, None)) is not None}
    given = {**(block or {}), **options}   # the command line wins over the config
    deadline = deadline_after(given.get("time_limit"))
    if given.get("executor", "local") == "local":
        unused = sorted(k for k in options if k.startswith(("slurm_", "gpus_", "array_")))
        if unused:
            raise PositionError(f"{', '.join('--' + k.replace('_', '-') for k in unused)} apply only with "
                                f"--executor slurm")
        return LocalExecutor(given.get("workers", getattr(args, "default_workers", 1)), threads, deadline)
    if "workers" in options:
        raise PositionError("--workers applies to --executor local; on Slurm, --array-parallelism says how many "
                            "array tasks run the cells")
    folder = given.get("slurm_folder") or Path(out or ".") / "slurm"
    return SlurmExecutor(folder, partition=given.get("slurm_partition"), gpus_per_task=given.get("gpus_per_task", 0),
                         time_minutes=given.get("slurm_time", 60), array_parallelism=given.get("array_parallelism", 16),
                         threads=threads, deadline=deadline)
