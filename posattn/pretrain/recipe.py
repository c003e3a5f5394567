"""Run every run of a pretraining recipe in turn and summarise them (report.md, results.json, PNG).

Each run lives in ``<out>/<label>/`` and resumes or is skipped like a single ``posattn pretrain``;
the runs are the cells of :func:`posattn.experiments.sweep.run`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import PositionError
from ..experiments import sweep as sweep_runner
from ..experiments.executors import Executor, LocalExecutor
from .config import PretrainConfig
from .report import finished_run, write_summary
from .run import World, pretrain, resolve_corpus


def _run_job(job: tuple[str, PretrainConfig, Path, str, bool, str | None, tuple[str, ...]],
             in_worker: bool) -> dict[str, Any]:
    label, cfg, out, device, progress, compile, log_to = job
    pretrain(cfg, out, device=device, progress=progress and not in_worker, compile=compile, log_to=log_to)
    return finished_run(out, label)


def _read_run(job: tuple[str, PretrainConfig, Path, str, bool, str | None, tuple[str, ...]]) -> dict[str, Any] | None:
    label, _, out = job[:3]
    return finished_run(out, label)


def recipe(name: str, runs: list[tuple[str, PretrainConfig]], out: Path, device: str = "auto",
           progress: bool = True, compile: str | None = None, log_to: tuple[str, ...] = ()) -> sweep_runner.Recipe:
    """The recipe for :func:`posattn.experiments.sweep.run`: a cell is a run, its id its label. A
    finished run goes to :func:`~posattn.pretrain.run.pretrain` too, which checks that its config
    is unchanged and that its model is intact before reading its result back."""
    cells = [sweep_runner.Cell(label, f"run {label}",
                               (label, cfg, out / label, device, progress, compile, tuple(log_to)))
             for label, cfg in runs]

    def summary(results: list[dict[str, Any]], total: int, out: Path) -> None:
        if results:
            write_summary(name, results, out, total)

    return sweep_runner.Recipe(f"recipe {name!r}", cells, _run_job, _read_run, summary, unit="runs",
                               skip_finished=False)


def run_recipe(name: str, runs: list[tuple[str, PretrainConfig]], out: str | Path, *, device: str = "auto",
               progress: bool = True, executor: Executor | None = None,
               only: list[str] | None = None, compile: str | None = None,
               log_to: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Train every ``(label, config)`` into ``out/label`` (with ``only``, just those labels); write
    the recipe's summary of every finished run into ``out``; return the results of the runs trained
    (or found finished).

    ``executor``: where the runs train (default: one after another in this process); a
    :class:`~posattn.experiments.executors.LocalExecutor` with workers > 1 trains that many runs at
    once in separate processes (useful on a GPU, where one small model leaves most of the device
    idle); runs its time budget keeps from starting are left for the next invocation. ``only``
    splits a recipe over time or machines: each trains some runs, and the summary grows as
    they finish. ``compile`` and ``log_to``: as :func:`~posattn.pretrain.run.pretrain`'s."""
    out, single = Path(out), len(runs) == 1 and runs[0][0] == name
    unknown = sorted(set(only or ()) - {label for label, _ in runs})
    if only is not None and single:
        raise PositionError(f"--runs picks runs of a recipe; {name!r} is a single run")
    if unknown:
        raise PositionError(f"--runs: no run labelled {', '.join(unknown)} in recipe {name!r}; "
                            f"its runs: {', '.join(label for label, _ in runs)}")
    if single:
        return [pretrain(runs[0][1], out, device=device, progress=progress, compile=compile, log_to=tuple(log_to))]
    executor = executor or LocalExecutor()
    if not executor.in_process and any(cfg.corpus == "default" for label, cfg in runs if only is None or label in only):
        resolve_corpus("default", World())  # once, here: workers building it at once replaced each other's
    records = sweep_runner.run(recipe(name, runs, out, device, progress, compile, log_to), out, executor,
                               progress=progress, only=only)
    return [{k: v for k, v in r.items() if k != "history"} for r in records if only is None or r["label"] in only]
