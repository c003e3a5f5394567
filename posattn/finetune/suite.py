"""A fine-tuning sweep: checkpoints × tasks × seeds, from a YAML config (schema in :data:`SCHEMA`).

Each combination is a :class:`~posattn.finetune.run.Cell` whose result lands in
``<cell store>/<id>/result.json`` (``<out>/cells`` unless the config names a shared ``cell_store``);
finished cells are never re-run, so re-running a command resumes it.
Cells of an intermediate task (MNLI) run first and keep their model; the cells they initialise
(RTE, STS-B, MRPC) run after them with the same checkpoint and seed.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..claims import parse_claims
from ..errors import PositionError
from ..experiments import config as config_loader
from ..experiments import sweep as sweep_runner
from ..experiments.config import ConfigError, is_int
from ..experiments.executors import Executor, block_problems
from ..runtime.files import name_problem, write_json_atomic
from .report import summarise, write_plots, write_report
from .run import (
    Cell,
    FinetuneConfig,
    check_encoder,
    find_checkpoint,
    fingerprint,
    finished_cell,
    run_cell,
    task_data,
    tokenizer_path,
)
from .tasks import GLUE_SUITE, OFFLINE_SUITE, TASKS

DEFAULT_CONFIG = "offline"
TRAINING_KEYS = tuple(f.name for f in fields(FinetuneConfig) if f.name != "seed")
TOP_KEYS = ("name", "checkpoints", "tasks", "seeds", "glue_dir", "max_train", "max_eval", "max_seq_len",
            "training", "task_training", "intermediate", "cell_store", "claims", "executor")

SCHEMA = """\
Config schema (YAML; every key has a default):
  name: str                 sweep name; default output folder runs/finetune-<name>
  checkpoints:              list of model folders (or `posattn pretrain` run folders), each a path or
    - {{path: ..., label: ...}}   {{path, label}}; CHECKPOINT arguments on the command line replace it
  tasks: [str]              offline: {offline}
                            GLUE (need --glue-dir): {glue}, wnli
                            `offline` and `glue` expand to those suites (GLUE = Chang's eight tasks)
  seeds: [int] | int        [0, 1, 2]; an integer n means seeds 0..n-1
  glue_dir: str             folder of the official GLUE download (CoLA/, SST-2/, MNLI/, ...)
  max_train: int | null     cap on training examples per task (a fixed subset; null = all)
  max_eval: int | null      cap on validation and on each test set
  max_seq_len: int | null   tokens per input, truncated longest first (null = the model's max_len);
                            above max_len only for models whose every mechanism is inductive
  training: {{...}}           overrides for every task of: {training}
  task_training: {{task: {{...}}}}  overrides for one task
  intermediate: auto | {{task: source}}   auto: RTE, STS-B, MRPC start from MNLI when both are in the
                            sweep (Chang Table 5); {{}} turns it off
  cell_store: str | null    folder of the cells (null: <out>/cells); sweeps naming the same folder share
                            finished cells, keyed by checkpoint content, task, seed and settings
  claims: [{{claim, paper, holds: ["A > B" | "A !> B", ...]}}]   papers' rankings of rows, judged on the
                            suite scores in report.md (posattn.claims)
  executor: {{...}}           where the cells run (see Executors below)
Per-task defaults (Chang et al. 2021, Table 5): lr 3e-4 (QNLI 1e-4), batch 32 (MNLI, QQP 128),
epochs 3 (RTE, STS-B 10; MNLI, QQP 4), warmup 10% + linear decay, dropout 0.1, weight decay 0,
Adam eps 1e-6; the best validation evaluation is kept (patience: stop after that many evaluations
without improvement; null = train all epochs)."""


def schema_text() -> str:
    training = ", ".join(f"{k}={v}" for k, v in asdict(FinetuneConfig()).items() if k != "seed")
    return SCHEMA.format(offline=", ".join(OFFLINE_SUITE), glue=", ".join(GLUE_SUITE), training=training)


def builtin_configs() -> list[str]:
    """Names of the configs shipped in ``posattn/finetune/configs``."""
    return config_loader.builtin_configs("posattn.finetune")


def load_config(source: str | Path | dict | None = None) -> dict[str, Any]:
    """A raw config from a YAML path, a built-in name, a dict or None (the default ``offline`` suite)."""
    return config_loader.load_config(source, package="posattn.finetune", default=DEFAULT_CONFIG, keys=TOP_KEYS)


@dataclass(frozen=True)
class Suite:
    """A validated config: normalized settings, the checkpoints and the cells."""

    name: str
    config: dict[str, Any]
    checkpoints: list[dict[str, Any]]
    cells: list[Cell]
    keep: frozenset[str]                 # ids of cells whose model initialises others
    cell_store: str | None = None        # None: <out>/cells


def _training(overrides: Any, where: str, errors: list[str]) -> dict[str, Any]:
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        errors.append(f"{where}: must be a mapping of training keys, got {overrides!r}")
        return {}
    bad = sorted(set(overrides) - set(TRAINING_KEYS))
    if bad:
        errors.append(f"{where}: unknown key(s) {', '.join(bad)}; valid keys: {', '.join(TRAINING_KEYS)}")
    good = {k: v for k, v in overrides.items() if k in TRAINING_KEYS}
    for key, value in good.items():
        if key == "patience":
            ok = value is None or is_int(value)
        elif key in ("batch_size", "evals_per_epoch", "eval_batch_size"):
            ok = is_int(value)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
            ok = ok and (value > 0 or key in ("warmup", "weight_decay", "dropout", "grad_clip"))
        if not ok:
            errors.append(f"{where}: {key} = {value!r} is not valid")
    return good


def _tasks(raw: dict[str, Any], errors: list[str]) -> list[str]:
    given = raw.get("tasks", ["offline"])
    given = [given] if isinstance(given, str) else given
    if not isinstance(given, list) or not given:
        errors.append(f"tasks must be a non-empty list of task names, got {given!r}")
        return list(OFFLINE_SUITE)
    names: list[str] = []
    for t in given:
        expanded = {"offline": list(OFFLINE_SUITE), "glue": list(GLUE_SUITE)}.get(t, [t])
        for name in expanded:
            if name not in TASKS:
                errors.append(f"unknown task {name!r}; tasks: {', '.join(TASKS)} (or offline, glue)")
            elif name not in names:
                names.append(name)
    if any(TASKS[n].source == "glue" for n in names) and not raw.get("glue_dir"):
        errors.append(f"GLUE task(s) {', '.join(n for n in names if TASKS[n].source == 'glue')} need glue_dir "
                      f"(--glue-dir: the folder of the official GLUE download); nothing is downloaded")
    elif raw.get("glue_dir") and not Path(raw["glue_dir"]).is_dir():
        errors.append(f"glue_dir {raw['glue_dir']}: no such folder")
    return names


def _checkpoints(raw: dict[str, Any], errors: list[str]) -> list[dict[str, Any]]:
    entries = raw.get("checkpoints")
    if not isinstance(entries, list) or not entries:
        errors.append("no checkpoint: give CHECKPOINT folder(s) on the command line or a `checkpoints` list")
        return []
    out = []
    for i, entry in enumerate(entries):
        entry = {"path": entry} if isinstance(entry, (str, Path)) else entry
        if not isinstance(entry, dict) or "path" not in entry or set(entry) - {"path", "label"}:
            errors.append(f"checkpoints[{i}]: a path or {{path, label}}, got {entry!r}")
            continue
        try:
            folder = find_checkpoint(entry["path"])
            cfg = check_encoder(folder)
            tokenizer_path(folder)
        except PositionError as e:
            errors.append(f"checkpoints[{i}]: {e}")
            continue
        names = "+".join(m if isinstance(m, str) else str(m.get("name")) for m in cfg.get("mechanisms", []))
        out.append({"path": str(folder), "label": str(entry.get("label") or names or folder.name), "config": cfg})
    labels = [c["label"] for c in out]
    dupes = sorted({lab for lab in labels if labels.count(lab) > 1})
    if dupes:
        errors.append(f"checkpoints: duplicate label(s) {', '.join(dupes)}; give them distinct labels")
    return out


def _max_seq_len(raw: dict[str, Any], ckpt: dict[str, Any], errors: list[str]) -> int:
    from ..models import build_model

    cfg, asked = ckpt["config"], raw.get("max_seq_len")
    if asked is None:
        return int(cfg["max_len"])
    if not is_int(asked, 4):
        errors.append(f"max_seq_len must be an integer >= 4 or null, got {asked!r}")
        return int(cfg["max_len"])
    if asked > cfg["max_len"]:
        fixed = [m.name for m in build_model(cfg).mechanisms() if not m.inductive]
        if fixed:
            errors.append(f"max_seq_len {asked}: {ckpt['label']} was built for {cfg['max_len']} positions and "
                          f"{', '.join(fixed)} cannot go beyond them (not inductive); use at most {cfg['max_len']}")
    return int(asked)


def validate_config(raw: dict[str, Any]) -> Suite:
    """Check a raw config and expand it into cells; one :class:`ConfigError` lists every problem."""
    errors: list[str] = []
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        errors.append(f"unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(TOP_KEYS)}")
    if unsafe := name_problem(raw.get("name", DEFAULT_CONFIG), "name"):   # names the output folder
        errors.append(unsafe)
    tasks = _tasks(raw, errors)
    seeds = raw.get("seeds", [0, 1, 2])
    seeds = list(range(seeds)) if is_int(seeds) else seeds
    if not isinstance(seeds, list) or not seeds or not all(is_int(s, 0) for s in seeds):
        errors.append(f"seeds must be a positive integer or a list of integers >= 0, got {raw.get('seeds')!r}")
        seeds = [0]
    caps = {k: raw.get(k) for k in ("max_train", "max_eval")}
    for k, v in caps.items():
        if v is not None and not is_int(v, 2):
            errors.append(f"{k} must be an integer >= 2 or null, got {v!r}")
            caps[k] = None
    shared = _training(raw.get("training"), "training", errors)
    per_task = raw.get("task_training") or {}
    if not isinstance(per_task, dict):
        errors.append(f"task_training must map task names to training keys, got {per_task!r}")
        per_task = {}
    for name in sorted(set(per_task) - set(TASKS)):
        errors.append(f"task_training: unknown task {name!r}")
    overrides = {t: _training(per_task.get(t), f"task_training.{t}", errors) for t in tasks}
    intermediate = raw.get("intermediate", "auto")
    if intermediate == "auto":
        intermediate = {t: TASKS[t].init_from for t in tasks if TASKS[t].init_from in tasks}
    if not isinstance(intermediate, dict):
        errors.append(f"intermediate must be auto or a mapping task: source task, got {intermediate!r}")
        intermediate = {}
    for t, src in intermediate.items():
        if t not in tasks or src not in tasks or t == src or src in intermediate:
            errors.append(f"intermediate: {t} <- {src} needs both tasks in the sweep, distinct, and a source "
                          f"that is not itself initialised from another task")
    store = raw.get("cell_store")
    if store is not None and not (isinstance(store, str) and store):
        errors.append(f"cell_store must be a folder path or null, got {store!r}")
    claims = parse_claims(raw.get("claims"), errors)
    errors.extend(block_problems(raw.get("executor")))
    checkpoints = _checkpoints(raw, errors)
    lengths = [_max_seq_len(raw, c, errors) for c in checkpoints]
    if errors:
        raise ConfigError("invalid finetune config:\n  - " + "\n  - ".join(errors))

    cells: list[Cell] = []
    keep: set[str] = set()
    glue_dir = str(Path(raw["glue_dir"]).resolve()) if raw.get("glue_dir") else None
    for ckpt, max_len in zip(checkpoints, lengths):
        fp = fingerprint(Path(ckpt["path"]))
        by_task: dict[tuple[str, int], Cell] = {}
        for t in sorted(tasks, key=lambda t: t in intermediate):          # sources before the cells they start
            task = TASKS[t]
            base = replace(FinetuneConfig(lr=task.lr, batch_size=task.batch_size, epochs=task.epochs),
                           **{**shared, **overrides[t]})
            for seed in seeds:
                source = by_task[intermediate[t], seed].id if t in intermediate else None
                if source:
                    keep.add(source)
                cell = Cell(label=ckpt["label"], checkpoint=ckpt["path"], fingerprint=fp, task=t, seed=seed,
                            training=asdict(replace(base, seed=seed)), max_train=caps["max_train"],
                            max_eval=caps["max_eval"], max_seq_len=max_len, glue_dir=glue_dir, init_from=source)
                by_task[t, seed] = cell
                cells.append(cell)
    cells.sort(key=lambda c: c.seed)    # seed by seed: a sweep stopped part way has every row on its first seeds
    config = {"name": str(raw.get("name", DEFAULT_CONFIG)), "tasks": tasks, "seeds": seeds, "glue_dir": glue_dir,
              **caps, "max_seq_len": raw.get("max_seq_len"), "training": shared,
              "task_training": {t: v for t, v in overrides.items() if v}, "intermediate": intermediate,
              "checkpoints": [{"path": c["path"], "label": c["label"]} for c in checkpoints], "cell_store": store,
              "claims": [c.to_dict() for c in claims]}
    return Suite(config["name"], config, [{k: c[k] for k in ("path", "label", "config")} for c in checkpoints],
                 cells, frozenset(keep), store)


def _cell_job(job: tuple[Cell, str, str, bool, bool], in_worker: bool) -> dict:
    cell, store, device, keep, progress = job
    return run_cell(cell, Path(store), device, progress and not in_worker, keep_model=keep)


def _read_cell(job: tuple[Cell, str, str, bool, bool]) -> dict | None:
    return finished_cell(job[0], Path(job[1]))


def recipe(suite: Suite, out: Path, device: str = "auto", progress: bool = True) -> sweep_runner.Recipe:
    """The suite for :func:`posattn.experiments.sweep.run`: the cells of intermediate tasks are wave 0,
    the cells they initialise wave 1. Finished cells go to :func:`~posattn.finetune.run.run_cell` too,
    which reads them back unless a model they keep for the next wave is missing."""
    store = Path(suite.cell_store) if suite.cell_store else out / "cells"
    cells = [sweep_runner.Cell(c.id, f"cell {c.id} ({c.label}, {c.task}, seed {c.seed})",
                               (c, str(store), device, c.id in suite.keep, progress),
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
              progress: bool = True, report_only: bool = False) -> list[dict]:
    """Run every unfinished cell (intermediate sources first), then write results.json, report.md and plots;
    return the finished cells' results (:func:`posattn.experiments.sweep.run`).

    ``executor``: where the cells run (default: one after another in this process); cells its time
    budget keeps from starting are left for the next invocation and the report says it is partial.
    ``report_only``: train nothing, report the cells finished so far (a partial report says so);
    ConfigError if there are none."""
    out = Path(out)
    plan = recipe(suite, out, device, progress)      # its wall time starts now
    if not report_only:
        for key in {(c.task, c.glue_dir, c.max_train, c.max_eval) for c in suite.cells}:
            task_data(*key)                     # a bad task file fails here, before anything is written
    return sweep_runner.run(plan, out, executor, progress=progress, report_only=report_only)
