"""TISA Table 3 on a pretrained transformers encoder, with posattn finetune's tasks and training loop.

    python -m posattn.hf.table3 [--model minilm] [--tasks trec6 word_order] [--seeds 5] [--out DIR]

Variants (TISA §5): the model as is; TISA ``supplement`` with S = 1, 3, 5 kernels; TISA
``replace`` with S = 5. As in TISA (App. C, for both 3a and 3b) every TISA variant's kernels are
initialised by regression to the model's own F̂_P (:func:`~posattn.hf.retrofit.fit_kernels`,
saved as ``fit-S<k>.npz`` and reused by reruns).
Each cell (variant, task, seed) fine-tunes a fresh ``AutoModelForSequenceClassification`` with
:func:`posattn.finetune.run.finetune` (same data, tokenisation, schedule and metrics as
``posattn finetune``; the best validation checkpoint is scored on the test split) and writes
``cells/<cell>.json``; a rerun skips finished cells. ``results.json`` and ``report.md`` hold the
median and mean ± s.e. over seeds per variant and task.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from ..analysis.hf import resolve
from ..analysis.tisa_fit import TisaFit
from ..finetune.run import FinetuneConfig, baseline, encoded, finetune, score
from ..finetune.tasks import TASKS
from .retrofit import add_mechanisms, fit_kernels

VARIANTS: dict[str, tuple[str, int] | None] = {
    "baseline": None, "supplement S=1": ("supplement", 1), "supplement S=3": ("supplement", 3),
    "supplement S=5": ("supplement", 5), "replace S=5": ("replace", 5)}


class Classifier(nn.Module):
    """A transformers sequence classifier in ``posattn.finetune``'s model protocol:
    ``model(ids, segments, mask)`` -> hidden states, ``model.classify(hidden)`` -> logits
    (BERT's pooler, dropout and classifier, as ``BertForSequenceClassification`` computes them)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.hf = model

    def forward(self, ids: Tensor, segments: Tensor, mask: Tensor) -> Tensor:
        return self.hf.base_model(input_ids=ids, token_type_ids=segments, attention_mask=mask.long()).last_hidden_state

    def classify(self, hidden: Tensor) -> Tensor:
        return self.hf.classifier(self.hf.dropout(self.hf.base_model.pooler(hidden)))


def build(folder: Path, n_labels: int, variant: tuple[str, int] | None, fits: dict[int, Any]) -> Classifier:
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=n_labels)
    if variant is not None:
        mode, s = variant
        add_mechanisms(model, [{"name": "tisa", "n_kernels": s}], mode=mode, init=fits[s])
    return Classifier(model)


def cached_fit(folder: Path, n_kernels: int, path: Path) -> TisaFit:
    """:func:`fit_kernels` once; later runs read it back from ``path``."""
    if path.exists():
        with np.load(path) as saved:
            return TisaFit(**{k: saved[k] if saved[k].ndim else int(saved[k]) for k in saved.files})
    fit = fit_kernels(folder, n_kernels=n_kernels)
    np.savez(path, **asdict(fit))
    return fit


def summarise(cells: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """variant -> task -> {median, mean, se, n} of the test scores (× 100)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for c in cells:
        out.setdefault(c["variant"], {}).setdefault(c["task"], {"scores": []})["scores"].append(100 * c["score"])
    for tasks in out.values():
        for t in tasks.values():
            xs = t.pop("scores")
            se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
            t.update(median=round(statistics.median(xs), 2), mean=round(statistics.fmean(xs), 2), se=round(se, 2), n=len(xs))
    return out


def report(summary: dict[str, Any], tasks: list[str], meta: dict[str, Any]) -> str:
    lines = [f"# TISA Table 3 on {meta['model']} (reduced)", "", meta["protocol"], "",
             "| variant | " + " | ".join(f"{t} median | {t} mean ± s.e." for t in tasks) + " |",
             "|---|" + "---|---|" * len(tasks)]
    for variant, per in summary.items():
        cols = []
        for t in tasks:
            s = per.get(t)
            cols += ["–", "–"] if s is None else [f"{s['median']:.1f}", f"{s['mean']:.1f} ± {s['se']:.1f}"]
        lines.append(f"| {variant} | " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def run(model: str = "minilm", tasks: list[str] | None = None, seeds: int = 5, max_train: int = 1000,
        max_eval: int = 500, lr: float = 1e-4, epochs: float = 3, out: Path = Path("runs/hf/table3"),
        max_len: int = 128) -> dict[str, Any]:
    tasks = tasks or ["trec6", "word_order"]
    folder = resolve(model)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    fits = {s: cached_fit(folder, s, out / f"fit-S{s}.npz") for s in sorted({v[1] for v in VARIANTS.values() if v})}
    cells = []
    jobs = [(v, t, s) for s in range(seeds) for t in tasks for v in VARIANTS]  # every variant per seed first
    protocol = (f"{len(tasks)} tasks ({', '.join(tasks)}), {seeds} seeds, ≤ {max_train} training and ≤ {max_eval} "
                f"validation/test examples, ≤ {max_len} tokens, lr {lr}, {epochs} epochs, batch 32, warmup 10% + "
                f"linear decay; TISA kernels regression-initialised (TISA App. C); test scores × 100.")
    name = folder.name if model not in ("minilm", "mpnet") else model
    for variant, task_name, seed in tqdm(jobs, desc="table3"):
        path = out / "cells" / f"{variant.replace(' ', '_').replace('=', '')}-{task_name}-{seed}.json"
        if path.exists():
            cells.append(json.loads(path.read_text()))
            continue
        task = TASKS[task_name]
        sets = encoded(str(folder / "tokenizer.json"), task_name, None, max_train, max_eval, max_len)
        cfg = FinetuneConfig(lr=lr, epochs=epochs, seed=seed)
        torch.manual_seed(seed)
        clf = build(folder, task.n_outputs, VARIANTS[variant], fits)
        outcome = finetune(clf, task, sets["train"], sets["valid"], cfg, progress=False)
        test = score(clf, task, sets["test:test"], cfg.eval_batch_size)
        cell = {"variant": variant, "task": task_name, "seed": seed, "score": test["score"], "test": test,
                "valid_score": outcome["valid_score"], "best_step": outcome["best_step"], "steps": outcome["steps"],
                "majority_baseline": baseline(task, sets["train"], sets["test:test"])["score"],
                "sizes": {k: len(v) for k, v in sets.items()}, "training": asdict(cfg)}
        path.write_text(json.dumps(cell, indent=2))
        cells.append(cell)
        write(out, cells, tasks, name, str(folder), protocol)  # after every cell: partial results stay
    return write(out, cells, tasks, name, str(folder), protocol)


def write(out: Path, cells: list[dict[str, Any]], tasks: list[str], name: str, folder: str,
          protocol: str) -> dict[str, Any]:
    summary = summarise(cells)
    result = {"model": folder, "protocol": protocol, "summary": summary, "cells": cells}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "report.md").write_text(report(summary, tasks, {"model": name, "protocol": protocol}))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m posattn.hf.table3", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="minilm")
    p.add_argument("--tasks", nargs="+", default=["trec6", "word_order"])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--max-train", type=int, default=1000)
    p.add_argument("--max-eval", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/hf/table3"))
    a = p.parse_args(argv)
    run(a.model, a.tasks, a.seeds, a.max_train, a.max_eval, a.lr, a.epochs, a.out)
    print((a.out / "report.md").read_text())


if __name__ == "__main__":
    main()
