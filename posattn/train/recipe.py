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
from ..runtime.files import write_json_atomic
from .config import PretrainConfig
from .plots import plot_recipe
from .pretrain import METRICS, RESULT, World, pretrain, resolve_corpus


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
    splits a recipe across sessions or machines: each trains some runs, and the summary grows as
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
    finished = [{"label": label, **json.loads((out / label / RESULT).read_text())}
                for label, _ in runs if (out / label / RESULT).exists()]
    if finished:
        write_summary(name, finished, out, total=len(runs))
    return [{"label": label, **r} for (label, _), r in zip(runs_now, done) if not isinstance(r, NotStarted)]


def write_summary(name: str, results: list[dict[str, Any]], out: Path, total: int | None = None) -> None:
    """``results.json``, ``report.md`` (one row per run; marked partial when fewer than ``total``
    runs are finished) and ``valid_loss.png``."""
    write_json_atomic(out / "results.json", results, indent=2)
    clm = results[0]["objective"] == "clm"
    metric = "perplexity" if clm else "MLM accuracy"
    lines = [f"# Pretraining recipe `{name}`", "",
             f"| run | mechanisms | parameters | steps | tokens | held-out loss | held-out {metric} | tokens/s | minutes |",
             "|---|---|---|---|---|---|---|---|---|"]
    if total is not None and len(results) < total:
        lines[1:1] = ["", f"**Partial: {len(results)} of {total} runs finished.** Rerun the recipe to finish it."]
    for r in results:
        value = r["valid_perplexity"] if clm else r["valid_accuracy"]
        mechs = " + ".join(m if isinstance(m, str) else m["name"] for m in r["mechanisms"]) or "none"
        lines.append(f"| {r['label']} | {mechs} | {r['parameters']:,} | {r['steps']} | {r['tokens']:,} | "
                     f"{r['valid_loss']:.3f} | {value:.3f} | {r['tokens_per_s']:,.0f} | {r['train_seconds'] / 60:.1f} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    histories = {}
    for r in results:
        rows = (out / r["label"] / METRICS).read_text().splitlines()
        histories[r["label"]] = [json.loads(line) for line in rows if line.strip()]
    plot_recipe(histories, out / "valid_loss.png", f"{name}: held-out loss")
