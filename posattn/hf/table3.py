"""TISA Table 3 on a pretrained transformers encoder, with posattn finetune's tasks and training loop.

    posattn study table3 [--model minilm] [--tasks TASK ...] [--seeds 5] [--out DIR] [--workers N]

By default: the eight tasks of ``posattn finetune``'s offline suite, ≤ 800 training examples, 2 epochs.

Variants (TISA §5): the model as is; TISA ``supplement`` with S = 1, 3, 5 kernels; TISA
``replace`` with S = 5. As in TISA (App. C, for both 3a and 3b) every TISA variant's kernels are
initialised by regression to the model's own F̂_P (:func:`~posattn.hf.retrofit.fit_kernels`,
saved as ``fit-S<k>.npz`` and reused by reruns).
Each cell (variant, task, seed) fine-tunes a fresh ``AutoModelForSequenceClassification`` with
:func:`posattn.finetune.run.finetune` (same data, tokenisation, schedule and metrics as
``posattn finetune``; the best validation checkpoint is scored on the test split) and writes
``cells/<cell>.json``; a rerun skips finished cells. ``study.json`` records the model and the
settings every cell shares, and a run with another model or protocol is refused in that folder
(its cells and kernel fits are not that run's). ``results.json`` and ``report.md`` hold the
median and mean ± s.e. over seeds per variant and task and of the suite average (computed per seed),
and TISA's Table-3a claims (:data:`CLAIMS`) judged by :mod:`posattn.claims`; ``scores.png`` and
``suite_score.png`` plot them.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from ..analysis.hf import HFCheckpoint, resolve
from ..analysis.tisa_fit import TisaFit
from ..claims import SIGMAS, judge, parse_claims, report_row
from ..experiments import sweep as sweep_runner
from ..experiments.executors import Executor
from ..experiments.store import read_json
from ..finetune.report import plot_scores, seed_values, suite_scores
from ..finetune.run import FinetuneConfig, baseline, encoded, finetune, score
from ..finetune.tasks import OFFLINE_SUITE, TASKS
from ..markdown import table as md_table
from ..runtime.checkpoint import check_config
from ..runtime.files import atomic_path, write_json_atomic, write_text_atomic
from .retrofit import add_mechanisms, fit_kernels

STUDY = "study.json"
VARIANTS: dict[str, tuple[str, int] | None] = {
    "baseline": None, "supplement S=1": ("supplement", 1), "supplement S=3": ("supplement", 3),
    "supplement S=5": ("supplement", 5), "replace S=5": ("replace", 5)}


class Classifier(nn.Module):
    """A transformers sequence classifier in ``posattn.finetune``'s model protocol,
    ``model.classify(ids, segments, mask)`` -> logits (BERT's pooler, dropout and classifier,
    as ``BertForSequenceClassification`` computes them)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.hf = model

    def classify(self, ids: Tensor, segments: Tensor, mask: Tensor) -> Tensor:
        hidden = self.hf.base_model(input_ids=ids, token_type_ids=segments,
                                    attention_mask=mask.long()).last_hidden_state
        return self.hf.classifier(self.hf.dropout(self.hf.base_model.pooler(hidden)))


def build(folder: Path, n_labels: int, variant: tuple[str, int] | None, fit: TisaFit | None) -> Classifier:
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=n_labels)
    if variant is not None:
        mode, s = variant
        add_mechanisms(model, [{"name": "tisa", "n_kernels": s}], mode=mode, init=fit)
    return Classifier(model)


def cached_fit(folder: Path, n_kernels: int, path: Path) -> TisaFit:
    """:func:`fit_kernels` once; later runs read it back from ``path``."""
    if path.exists():
        with np.load(path) as saved:
            return TisaFit(**{k: saved[k] if saved[k].ndim else int(saved[k]) for k in saved.files})
    fit = fit_kernels(folder, n_kernels=n_kernels)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:   # a file object: savez adds no ".npz"
        np.savez(f, **asdict(fit))
    return fit


def claim_folder(out: Path, study: dict[str, Any]) -> None:
    """Record ``study`` (the model and the settings every cell shares) in ``out/study.json``; one
    error naming what differs (:func:`~posattn.runtime.checkpoint.check_config`) if the folder
    already holds another study, whose cells and kernel fits are not this run's."""
    path = out / STUDY
    if path.is_file():
        old = read_json(path)
        check_config(old if isinstance(old, dict) else {}, study, path)
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, study, indent=2)


CLAIMS = parse_claims([
    {"claim": "TISA added to a pretrained model that keeps its position embeddings improves it (Table 3a; "
              "S = 5 is best, better on 7 of 8 tasks)",
     "paper": "ALBERT base v2, GLUE dev median of 5: +0.4 average for S = 5",
     "holds": ["supplement S=5 > baseline"]},
    {"claim": "the gains are stable regardless of S (Table 3a)",
     "paper": "S = 1, 3, 5 each improve on the baseline on most tasks",
     "holds": ["supplement S=1 > baseline", "supplement S=3 > baseline"]},
], [])


def finetune_cells(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Table-3 cells in ``posattn finetune``'s cell form (label, task, seed, scores, baseline), so that
    :mod:`posattn.finetune.report` computes the same statistics and plots."""
    return [{"label": c["variant"], "task": c["task"], "seed": c["seed"], "scores": {"test": c["test"]},
             "baseline": {"test": {"score": c["majority_baseline"]}}} for c in cells]


def summarise(cells: list[dict[str, Any]], tasks: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """variant -> task (and ``Avg``, the per-seed mean over ``tasks``) -> {median, mean, se, n} of
    the test scores × 100."""
    rows = finetune_cells(cells)
    out: dict[str, dict[str, dict[str, float]]] = {}
    present = {c["variant"] for c in cells}
    for variant in [v for v in VARIANTS if v in present]:
        per = {t: list(seed_values(rows, variant, t, "test").values()) for t in tasks}
        per["Avg"] = list(suite_scores(rows, variant, tasks).values())
        out[variant] = {k: _stats(xs) for k, xs in per.items() if xs}
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return {"median": round(statistics.median(xs), 2), "mean": round(statistics.fmean(xs), 2), "se": round(se, 2),
            "n": len(xs)}


def report(cells: list[dict[str, Any]], summary: dict[str, Any], tasks: list[str], meta: dict[str, Any]) -> str:
    """``report.md``: median (mean ± s.e.) per variant and task, the suite average (``summary``, from
    :func:`summarise`), the majority class, and TISA's claims (:data:`CLAIMS`) judged on the
    per-seed suite averages."""
    rows = finetune_cells(cells)

    def cell(s: dict[str, float] | None) -> str:
        if s is None:
            return "–"
        return f"{s['median']:.1f} ({s['mean']:.1f} ± {s['se']:.1f})" if s["n"] > 1 else f"{s['median']:.1f} (1 seed)"

    titles = [TASKS[t].title for t in tasks]
    majority = {c["task"]: 100 * c["majority_baseline"] for c in cells}
    lines = [f"# TISA Table 3 on {meta['model']}", "", meta["protocol"], "",
             "Median (mean ± s.e.) over seeds; Avg is the mean over the tasks, computed per seed.", "",
             *md_table(["variant", *titles, "Avg"],
                     [[v, *(cell(per.get(t)) for t in tasks), cell(per.get("Avg"))] for v, per in summary.items()]
                     + [["majority class", *(f"{majority[t]:.1f}" if t in majority else "–" for t in tasks), ""]])]
    stats = {v: list(suite_scores(rows, v, tasks).values()) for v in summary}
    lines += [f"## TISA's claims, judged on Avg (a difference counts beyond {SIGMAS:g} s.e.)", "",
              *md_table(["claim", "paper", "ours: difference of Avg ± s.e.", "verdict"],
                      [report_row(c, *judge(c, stats)) for c in CLAIMS])]
    return "\n".join(lines)


@dataclass(frozen=True)
class Job:
    """One cell: everything a worker process needs to fine-tune and score it."""

    variant: str
    task: str
    seed: int
    folder: str
    out: str
    max_train: int
    max_eval: int
    max_len: int
    lr: float
    epochs: float

    @property
    def path(self) -> Path:
        stem = self.variant.replace(" ", "_").replace("=", "")
        return Path(self.out) / "cells" / f"{stem}-{self.task}-{self.seed}.json"


def run_cell(job: Job) -> dict[str, Any]:
    """Fine-tune and score one cell, write ``cells/<cell>.json`` and return it."""
    folder, out = Path(job.folder), Path(job.out)
    task = TASKS[job.task]
    sets = encoded(str(folder / "tokenizer.json"), job.task, None, job.max_train, job.max_eval, job.max_len)
    cfg = FinetuneConfig(lr=job.lr, epochs=job.epochs, seed=job.seed)
    variant = VARIANTS[job.variant]
    fit = cached_fit(folder, variant[1], out / f"fit-S{variant[1]}.npz") if variant else None
    torch.manual_seed(job.seed)
    clf = build(folder, task.n_outputs, variant, fit)
    outcome = finetune(clf, task, sets["train"], sets["valid"], cfg, progress=False)
    test = score(clf, task, sets["test:test"], cfg.eval_batch_size)
    cell = {"variant": job.variant, "task": job.task, "seed": job.seed, "score": test["score"], "test": test,
            "valid_score": outcome["valid_score"], "best_step": outcome["best_step"], "steps": outcome["steps"],
            "majority_baseline": baseline(task, sets["train"], sets["test:test"])["score"],
            "sizes": {k: len(v) for k, v in sets.items()}, "training": asdict(cfg)}
    write_json_atomic(job.path, cell, indent=2)
    return cell


def _cell_job(job: Job, in_worker: bool) -> dict[str, Any]:
    """:func:`run_cell` for :meth:`~posattn.experiments.executors.Executor.map` (no progress bars either way)."""
    return run_cell(job)


def _read_cell(job: Job) -> dict[str, Any] | None:
    return json.loads(job.path.read_text()) if job.path.exists() else None


def run(model: str = "minilm", tasks: list[str] | None = None, seeds: int = 5, max_train: int = 800,
        max_eval: int = 500, lr: float = 1e-4, epochs: float = 2, out: Path = Path("runs/hf/table3"),
        max_len: int = 128, executor: Executor | None = None) -> dict[str, Any]:
    """Every unfinished cell through ``executor`` (default: one after another in this process; a
    :class:`~posattn.experiments.executors.LocalExecutor` with workers gives each an equal share of
    the CPU threads), by :func:`posattn.experiments.sweep.run`; report.md and results.json are
    rewritten after every cell. Cells the executor's time budget keeps from starting are left for
    the next invocation. Returns the content of results.json."""
    tasks = tasks or list(OFFLINE_SUITE)
    folder = resolve(model)
    HFCheckpoint.open(folder)   # a damaged checkpoint is refused here, before anything is written or a worker starts
    claim_folder(out, {"model": str(Path(folder).resolve()), "max_train": max_train, "max_eval": max_eval,
                       "max_len": max_len, "lr": lr, "epochs": epochs})
    (out / "cells").mkdir(parents=True, exist_ok=True)
    for s in sorted({v[1] for v in VARIANTS.values() if v}):  # fitted once, before any worker reads them
        cached_fit(folder, s, out / f"fit-S{s}.npz")
    jobs = [Job(v, t, s, str(folder), str(out), max_train, max_eval, max_len, lr, epochs)
            for s in range(seeds) for t in tasks for v in VARIANTS]  # every variant per seed first
    protocol = (f"{len(tasks)} tasks ({', '.join(tasks)}), {seeds} seeds, ≤ {max_train} training and ≤ {max_eval} "
                f"validation/test examples, ≤ {max_len} tokens, lr {lr}, {epochs} epochs, batch 32, warmup 10% + "
                f"linear decay; TISA kernels regression-initialised (TISA App. C); test scores × 100.")
    name = folder.name if model not in ("minilm", "mpnet") else model

    def summary(records: list[dict[str, Any]], total: int, into: Path) -> None:
        write(into, records, tasks, name, str(folder), protocol, plots=True, total=total)

    cells = [sweep_runner.Cell(j.path.stem, f"cell {j.variant} × {j.task}, seed {j.seed}", j) for j in jobs]
    study = sweep_runner.Recipe(f"the Table 3 study of {name}", cells, _cell_job, _read_cell, summary,
                                summary_each_cell=True)
    return results(sweep_runner.run(study, out, executor), tasks, str(folder), protocol)


def results(cells: list[dict[str, Any]], tasks: list[str], folder: str, protocol: str) -> dict[str, Any]:
    """The study's ``results.json``: the model, the protocol, the :func:`summarise` statistics and the cells."""
    return {"model": folder, "protocol": protocol, "summary": summarise(cells, tasks), "cells": cells}


def write(out: Path, cells: list[dict[str, Any]], tasks: list[str], name: str, folder: str,
          protocol: str, plots: bool = False, total: int | None = None) -> dict[str, Any]:
    """results.json and report.md (and, with ``plots``, scores.png and suite_score.png); the report
    says it is partial when fewer than ``total`` cells are finished."""
    result = results(cells, tasks, folder, protocol)
    write_json_atomic(out / "results.json", result, indent=2)
    text = report(cells, result["summary"], tasks, {"model": name, "protocol": protocol})
    if total is not None and len(cells) < total:
        text = text.replace("\n\n", f"\n\n**Partial: {len(cells)} of {total} cells finished.** "
                                    "Rerun to finish it.\n\n", 1)
    write_text_atomic(out / "report.md", text)
    if plots:
        plot_scores(f"TISA Table 3 on {name}", list(VARIANTS), tasks, finetune_cells(cells), out)
    return result
