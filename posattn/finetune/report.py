"""``report.md`` and PNG plots of a ``posattn finetune`` sweep, in the papers' layout, from its cells'
result records (the sweep itself and ``posattn report`` share them: the suite's normalized config
and a summary ``{cells, cells_total, cell_seconds, cell_cpu_seconds[, wall_seconds]}``).

One row per model, one column per task (MNLI as MNLI-m and MNLI-mm), scores ×100, and the
average of the columns as the suite score. As in Chang et al. (Appendix A.2) the suite score is
computed per seed and then averaged: mean ± standard error of the mean over seeds. The median
over seeds is the statistic of TISA (Table 3) and DIET (Table 2).
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import matplotlib

from ..claims import SIGMAS, judge, parse_claims, report_row
from ..markdown import table as md_table
from ..runtime.files import write_text_atomic
from .tasks import TASKS


def columns(tasks: list[str]) -> list[tuple[str, str, str]]:
    """(task, evaluation set, column title) of every report column."""
    return [(t, s, title) for t in tasks for s, title in zip(TASKS[t].eval_sets, TASKS[t].columns())]


def seed_values(cells: list[dict], label: str, task: str, eval_set: str, key: str = "score") -> dict[int, float]:
    """Seed -> test value ×100 of one model on one column (diverged cells left out)."""
    return {c["seed"]: 100 * c["scores"][eval_set][key] for c in cells
            if c["label"] == label and c["task"] == task and c.get("scores")}


def suite_scores(cells: list[dict], label: str, tasks: list[str]) -> dict[int, float]:
    """Seed -> average over all columns, for the seeds where every column has a value."""
    per_col = [seed_values(cells, label, t, s) for t, s, _ in columns(tasks)]
    seeds = set.intersection(*(set(v) for v in per_col)) if per_col else set()
    return {s: statistics.fmean(v[s] for v in per_col) for s in sorted(seeds)}


def mean_se(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values) / math.sqrt(len(values)):.1f}"


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "–"


def summarise(name: str, config: dict[str, Any], cells: list[dict], total: int,
              **extra: Any) -> dict[str, Any]:
    """The suite's ``results.json``: its config, the cells, how many it has in all, and the
    training time they took (wall and CPU seconds summed over cells); ``extra`` keys first."""
    return {"name": name, "config": config, **extra,
            "cell_seconds": round(sum(c.get("train_seconds", 0) for c in cells), 1),
            "cell_cpu_seconds": round(sum(c.get("cpu_seconds", 0) for c in cells), 1),
            "cells_total": total, "cells": cells}


def report_text(config: dict[str, Any], summary: dict[str, Any]) -> str:
    """``report.md``: mean ± s.e. and median tables, all metrics, baselines, settings and notes."""
    cfg, cells = config, summary["cells"]
    tasks, labels = cfg["tasks"], [c["label"] for c in cfg["checkpoints"]]
    cols = columns(tasks)
    header = ["model", "params", *(title for _, _, title in cols), "Avg"]

    def row(label: str, stat: Any) -> list[str]:
        params = next((c["parameters"] for c in cells if c["label"] == label), 0)
        values = [stat(list(seed_values(cells, label, t, s).values())) for t, s, _ in cols]
        return [label, f"{params / 1e6:.2f}M", *values, stat(list(suite_scores(cells, label, tasks).values()))]

    first = {t: next((c for c in cells if c["task"] == t), {}) for t in tasks}
    chance = ["majority class", "-", *(f"{100 * first[t]['baseline'][s]['score']:.1f}" if first[t].get("baseline")
                                       else "–" for t, s, _ in cols), ""]
    seeds = cfg["seeds"]
    lines = [f"# posattn finetune: {cfg['name']}", "",
             f"Test scores ×100, {len(seeds)} seed(s) {seeds}; Avg = mean of the columns, computed per seed. "
             "Metrics: " + "; ".join(f"{TASKS[t].title} {'/'.join(TASKS[t].metrics)}" for t in tasks) +
             " (a task with two metrics scores their mean, as on the GLUE leaderboard). `–`: no finished cell.", "",
             *([f"**Partial: {len(cells)} of {summary['cells_total']} cells finished.** Avg counts only the seeds "
                "that have every column, and a claim with fewer than 2 such seeds of a row is not measured. "
                "Rerun the sweep to finish it.", ""] if len(cells) < summary.get("cells_total", len(cells)) else []),
             "## Mean ± standard error over seeds (Chang et al. layout)", "",
             *md_table(header, [row(lab, mean_se) for lab in labels] + [chance]),
             "## Median over seeds (TISA / DIET layout)", "",
             *md_table(header, [row(lab, median) for lab in labels])]
    if cfg.get("claims"):
        stats = {lab: list(suite_scores(cells, lab, tasks).values()) for lab in labels}
        rows = [report_row(c, *judge(c, stats)) for c in parse_claims(cfg["claims"], [])]
        lines += [f"## The papers' claims, judged on Avg (a difference counts beyond {SIGMAS:g} s.e.)", "",
                  *md_table(["claim", "paper", "ours: difference of Avg ± s.e.", "verdict"], rows)]
    multi = [(t, s, title) for t, s, title in cols if len(TASKS[t].metrics) > 1]
    if multi:
        rows = [[lab, *("/".join(mean_se(list(seed_values(cells, lab, t, s, m).values())).split(" ±")[0]
                                 for m in TASKS[t].metrics) for t, s, _ in multi)] for lab in labels]
        lines += ["## Every metric (means)", "",
                  *md_table(["model", *(f"{title} {'/'.join(TASKS[t].metrics)}" for t, _, title in multi)], rows)]
    lines += ["## Tasks", ""]
    for t in tasks:
        c = first[t]
        if not c:
            lines.append(f"- **{TASKS[t].title}** (`{t}`): no finished cell yet.")
            continue
        truncated = {k: v for k, v in c["truncated"].items() if v}
        sizes = ", ".join(f"{k} {v}" for k, v in c["sizes"].items())
        note = "; ".join([*c["notes"], *([f"truncated to {c['max_seq_len']} tokens (longest first): "
                                          + ", ".join(f"{v} {k}" for k, v in truncated.items())] if truncated else [])])
        tr = c["training"]
        about = TASKS[t].about.rstrip(".?") + ("?" if TASKS[t].about.endswith("?") else ".")
        lines.append(f"- **{TASKS[t].title}** (`{t}`): {about} {sizes}. lr {tr['lr']:g}, batch "
                     f"{tr['batch_size']}, {tr['epochs']:g} epochs"
                     + (f", initialised from the {cfg['intermediate'][t]} model" if t in cfg["intermediate"] else "")
                     + (f". {note}" if note else "") + ".")
    cost = [v for c in cells if c.get("eval_cost") for v in c["eval_cost"].values()]
    if cost:
        total = {k: sum(v[k] for v in cost) for k in cost[0]}
        lines += ["", f"Evaluation batches sorted by length (timed in the seed-0 cells): {total['sorted_tokens']:,} "
                      f"token positions computed for "
                      f"{total['real_tokens']:,} real tokens, in {total['sorted_seconds']:.1f} s; the same test passes "
                      f"in file order: {total['unsorted_tokens']:,} positions, {total['unsorted_seconds']:.1f} s "
                      f"({total['unsorted_seconds'] / max(total['sorted_seconds'], 1e-9):.2f}x the time)."]
    diverged = [c for c in cells if c.get("diverged")]
    wall = f"Wall time of this invocation: {summary['wall_seconds']:.0f} s; " if "wall_seconds" in summary else ""
    lines += ["", f"{wall}fine-tuning summed over {len(cells)} cells: {summary['cell_seconds']:.0f} s wall, "
                  f"{summary['cell_cpu_seconds']:.0f} s CPU (a loaded machine stretches wall time; CPU time of "
                  f"single-threaded cells is what they need)."]
    if diverged:
        lines += ["", "Diverged (left out of the means): " + "; ".join(
            f"{c['label']} {c['task']} seed {c['seed']}: {c['diverged']}" for c in diverged)]
    return "\n".join(lines) + "\n"


def write_report(config: dict[str, Any], summary: dict[str, Any], out: Path) -> Path:
    """Write :func:`report_text` into ``out/report.md``."""
    path = out / "report.md"
    write_text_atomic(path, report_text(config, summary))
    return path


def write_plots(config: dict[str, Any], summary: dict[str, Any], out: Path) -> list[Path]:
    """The sweep's :func:`plot_scores`."""
    labels = [c["label"] for c in config["checkpoints"]]
    return plot_scores(config["name"], labels, config["tasks"], summary["cells"], out)


def plot_scores(name: str, labels: list[str], tasks: list[str], cells: list[dict], out: Path) -> list[Path]:
    """``scores.png``: per-column mean ± s.e. bars per model (dotted: the majority class, from a cell's
    ``baseline``); ``suite_score.png``: the per-seed suite scores. ``cells`` in :func:`seed_values`'s form."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = columns(tasks)
    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cols) + 2), 4))
    for i, lab in enumerate(labels):
        vals = [list(seed_values(cells, lab, t, s).values()) for t, s, _ in cols]
        means = [statistics.fmean(v) if v else float("nan") for v in vals]
        errs = [statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else 0 for v in vals]
        ax.bar([j + (i - (len(labels) - 1) / 2) * width for j in range(len(cols))], means, width, yerr=errs,
               label=lab, capsize=2)
    first = {t: next((c for c in cells if c["task"] == t), {}) for t in tasks}
    for j, (t, s, _) in enumerate(cols):
        if first[t].get("baseline"):
            ax.hlines(100 * first[t]["baseline"][s]["score"], j - 0.45, j + 0.45, colors="grey", linestyles=":")
    ax.set_xticks(range(len(cols)), [title for _, _, title in cols], rotation=30)
    ax.set(ylabel="test score ×100 (dotted: majority class)", title=f"{name}: mean ± s.e. over seeds")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths = [out / "scores.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(max(4, 0.9 * len(labels) + 2), 3.5))
    for i, lab in enumerate(labels):
        vals = list(suite_scores(cells, lab, tasks).values())
        ax.scatter([i] * len(vals), vals, alpha=0.6)
        if vals:
            ax.hlines(statistics.median(vals), i - 0.3, i + 0.3, colors="black")
    ax.set_xticks(range(len(labels)), labels, rotation=30)
    ax.set(ylabel="suite score (Avg) per seed", title="suite score per seed (line: median)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(out / "suite_score.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
