"""A fine-tuning sweep: checkpoints × tasks × seeds, from a YAML config (its schema:
:class:`~posattn.finetune.schema.FinetuneSuiteConfig`).

Each combination is a :class:`~posattn.finetune.run.Cell` whose result lands in
``<cell store>/<id>/result.json`` (``<out>/cells`` unless the config names a shared ``cell_store``);
finished cells are never re-run, so re-running a command resumes it.
Cells of an intermediate task (MNLI) run first and keep their model; the cells they initialise
(RTE, STS-B, MRPC) run after them with the same checkpoint and seed.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..claims import parse_claims
from ..experiments import config as config_loader
from ..experiments import sweep as sweep_runner
from ..experiments.executors import Executor
from ..runtime.files import write_json_atomic
from .report import summarise, write_plots, write_report
from .run import Cell, FinetuneConfig, fingerprint, finished_cell, run_cell, task_data
from .schema import FinetuneSuiteConfig
from .tasks import TASKS

DEFAULT_CONFIG = "offline"


def schema_text() -> str:
    """The config's keys, types, defaults and meanings for ``posattn finetune --help``, from the schema."""
    return config_loader.schema_text(FinetuneSuiteConfig, "Config schema")


def builtin_configs() -> list[str]:
    """Names of the configs shipped in ``posattn/finetune/configs``."""
    return config_loader.builtin_configs("posattn.finetune")


def load_config(source: str | Path | dict | None = None) -> dict[str, Any]:
    """A raw config from a YAML path, a built-in name, a dict or None (the default ``offline`` suite)."""
    return config_loader.load_config(source, package="posattn.finetune", default=DEFAULT_CONFIG)


@dataclass(frozen=True)
class Suite:
    """A validated config: normalized settings, the checkpoints and the cells."""

    name: str
    config: dict[str, Any]
    checkpoints: list[dict[str, Any]]
    cells: list[Cell]
    keep: frozenset[str]                 # ids of cells whose model initialises others
    cell_store: str | None = None        # None: <out>/cells


def validate_config(raw: dict[str, Any]) -> Suite:
    """Check a raw config against :class:`~posattn.finetune.schema.FinetuneSuiteConfig` and expand it into
    cells; one :class:`ConfigError` lists every problem."""
    spec, problems = config_loader.check(FinetuneSuiteConfig, raw)
    config_loader.fail("finetune config", problems)
    shared = spec.training.given()
    overrides = {t: spec.task_training[t].given() if t in spec.task_training else {} for t in spec.tasks}
    caps = {"max_train": spec.max_train, "max_eval": spec.max_eval}
    cells: list[Cell] = []
    keep: set[str] = set()
    glue_dir = str(Path(spec.glue_dir).resolve()) if spec.glue_dir else None
    for ckpt in spec.checkpoints:
        fp = fingerprint(ckpt.folder)
        by_task: dict[tuple[str, int], Cell] = {}
        for t in sorted(spec.tasks, key=lambda t: t in spec.intermediate):   # sources before the cells they start
            task = TASKS[t]
            base = replace(FinetuneConfig(lr=task.lr, batch_size=task.batch_size, epochs=task.epochs),
                           **{**shared, **overrides[t]})
            for seed in spec.seeds:
                source = by_task[spec.intermediate[t], seed].id if t in spec.intermediate else None
                if source:
                    keep.add(source)
                cell = Cell(label=ckpt.row, checkpoint=str(ckpt.folder), fingerprint=fp, task=t, seed=seed,
                            training=asdict(replace(base, seed=seed)), max_train=caps["max_train"],
                            max_eval=caps["max_eval"], max_seq_len=spec.max_seq_len_of(ckpt), glue_dir=glue_dir,
                            init_from=source)
                by_task[t, seed] = cell
                cells.append(cell)
    cells.sort(key=lambda c: c.seed)    # seed by seed: a sweep stopped part way has every row on its first seeds
    config = {"name": spec.name, "tasks": spec.tasks, "seeds": spec.seeds, "glue_dir": glue_dir,
              **caps, "max_seq_len": spec.max_seq_len, "training": shared,
              "task_training": {t: v for t, v in overrides.items() if v}, "intermediate": spec.intermediate,
              "checkpoints": [{"path": str(c.folder), "label": c.row} for c in spec.checkpoints],
              "cell_store": spec.cell_store, "claims": [c.to_dict() for c in parse_claims(spec.claims, [])]}
    return Suite(config["name"], config, [{"path": str(c.folder), "label": c.row, "config": c.config}
                                          for c in spec.checkpoints], cells, frozenset(keep), spec.cell_store)


def _cell_job(job: tuple[Cell, str, str, bool, bool, str | None], in_worker: bool) -> dict:
    cell, store, device, keep, progress, compile = job
    return run_cell(cell, Path(store), device, progress and not in_worker, keep_model=keep, compile=compile)


def _read_cell(job: tuple[Cell, str, str, bool, bool, str | None]) -> dict | None:
    return finished_cell(job[0], Path(job[1]))


def recipe(suite: Suite, out: Path, device: str = "auto", progress: bool = True,
           compile: str | None = None) -> sweep_runner.Recipe:
    """The suite for :func:`posattn.experiments.sweep.run`: the cells of intermediate tasks are wave 0,
    the cells they initialise wave 1. Finished cells go to :func:`~posattn.finetune.run.run_cell` too,
    which reads them back unless a model they keep for the next wave is missing."""
    store = Path(suite.cell_store) if suite.cell_store else out / "cells"
    cells = [sweep_runner.Cell(c.id, f"cell {c.id} ({c.label}, {c.task}, seed {c.seed})",
                               (c, str(store), device, c.id in suite.keep, progress, compile),
                               wave=int(c.init_from is not None)) for c in suite.cells]
    start = time.perf_counter()

    def write_summary(results: list[dict], total: int, out: Path) -> None:
        summary = summarise(suite.name, suite.config, results, total,
                            wall_seconds=round(time.perf_counter() - start, 1))
        write_json_atomic(out / "results.json", summary)
        write_report(suite.config, summary, out)
        write_plots(suite.config, summary, out)

    return sweep_runner.Recipe(f"suite {suite.name!r}", cells, _cell_job, _read_cell, write_summary,
                               config=suite.config, cell_store=store, skip_finished=False)


def run_suite(suite: Suite, out: str | Path, executor: Executor | None = None, device: str = "auto",
              progress: bool = True, report_only: bool = False, compile: str | None = None) -> list[dict]:
    """Run every unfinished cell (intermediate sources first), then write results.json, report.md and plots;
    return the finished cells' results (:func:`posattn.experiments.sweep.run`).

    ``executor``: where the cells run (default: one after another in this process); cells its time
    budget keeps from starting are left for the next invocation and the report says it is partial.
    ``report_only``: train nothing, report the cells finished so far (a partial report says so);
    ConfigError if there are none. ``compile``: a :mod:`posattn.runtime.compile` mode for the
    training steps."""
    out = Path(out)
    plan = recipe(suite, out, device, progress, compile)      # its wall time starts now
    if not report_only:
        for key in {(c.task, c.glue_dir, c.max_train, c.max_eval) for c in suite.cells}:
            task_data(*key)                     # a bad task file fails here, before anything is written
    return sweep_runner.run(plan, out, executor, progress=progress, report_only=report_only)
