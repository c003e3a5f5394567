"""Run every run of a pretraining recipe in turn and summarise them (report.md, results.json, PNG).

Each run lives in ``<out>/<label>/`` and resumes or is skipped like a single ``posattn pretrain``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..errors import PositionError
from ..experiments.executors import Executor, LocalExecutor, NotStarted
from .config import PretrainConfig
from .report import finished_run, write_summary
from .run import RESULT, World, pretrain, resolve_corpus


def _run_job(job: tuple[PretrainConfig, Path, str, bool], in_worker: bool) -> dict[str, Any]:
    cfg, out, device, progress = job
    return pretrain(cfg, out, device=device, progress=progress and not in_worker)


def _read_run(job: tuple[PretrainConfig, Path, str, bool]) -> dict[str, Any] | None:
    path = job[1] / RESULT
    return json.loads(path.read_text()) if path.exists() else None


def run_recipe(name: str, runs: list[tuple[str, PretrainConfig]], out: str | Path, *, device: str = "auto",
               progress: bool = True, executor: Executor | None = None,
               only: list[str] | None = None) -> list[dict[str, Any]]:
    """Train every ``(label, config)`` into ``out/label`` (with ``only``, just those labels); write
    the recipe's summary of every finished run into ``out``; return the results of the runs trained
    (or found finished).

    ``executor``: where the runs train (default: one after another in this process); a
    :class:`~posattn.experiments.executors.LocalExecutor` with workers > 1 trains that many runs at
    once in separate processes (useful on a GPU, where one small model leaves most of the device
    idle); runs its time budget keeps from starting are left for the next invocation. ``only``
    splits a recipe over time or machines: each trains some runs, and the summary grows as
    they finish."""
    out, single = Path(out), len(runs) == 1 and runs[0][0] == name
    unknown = sorted(set(only or ()) - {label for label, _ in runs})
    if only is not None and single:
        raise PositionError(f"--runs picks runs of a recipe; {name!r} is a single run")
    if unknown:
        raise PositionError(f"--runs: no run labelled {', '.join(unknown)} in recipe {name!r}; "
                            f"its runs: {', '.join(label for label, _ in runs)}")
    if single:
        return [pretrain(runs[0][1], out, device=device, progress=progress)]
    runs_now = [(label, cfg) for label, cfg in runs if only is None or label in only]
    executor = executor or LocalExecutor()
    jobs = [(cfg, out / label, device, progress) for label, cfg in runs_now]
    if not executor.in_process and any(cfg.corpus == "default" for _, cfg in runs_now):
        resolve_corpus("default", World())  # once, here: workers building it at once replaced each other's
    done = list(tqdm(executor.map(_run_job, jobs, [f"run {label}" for label, _ in runs_now], read=_read_run),
                     total=len(jobs), desc=f"recipe {name}", disable=not progress or executor.in_process))
    finished = [r for label, _ in runs if (r := finished_run(out / label, label)) is not None]
    if finished:
        write_summary(name, finished, out, len(runs))
    return [{"label": label, **r} for (label, _), r in zip(runs_now, done) if not isinstance(r, NotStarted)]
