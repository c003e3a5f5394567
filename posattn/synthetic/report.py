"""Tables (``report.md``) and plots (PNG) of a ``posattn compare`` sweep, from its cells' result records.

Everything here reads the sweep's normalized config (``Sweep.config``, also kept in the results
store's ``recipe.json``) and a list of result records, so that the sweep itself and ``posattn
report`` (records from ``results/`` and local run folders) write the same report.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import matplotlib

from posattn.claims import SIGMAS, combine, judge, parse_claims, report_row
from posattn.markdown import table as md_table
from posattn.runtime.files import write_json_atomic, write_text_atomic


def test_lengths(config: dict[str, Any]) -> dict[int, list[int]]:
    """Training length -> its sorted test lengths, from a normalized config."""
    return {int(n): list(lengths) for n, lengths in config["test_lengths"].items()}


def select_lr(results: list[dict]) -> None:
    """Mark (``selected``), per (model, width, training length), the learning rate with the best mean
    validation accuracy over seeds (a diverged cell counts as -1)."""
    groups: dict[tuple, dict[float, list[dict]]] = {}
    for r in results:
        groups.setdefault((r["label"], r["d_model"], r["train_length"]), {}).setdefault(r["lr"], []).append(r)

    def mean_valid(item: tuple[float, list[dict]]) -> float:
        return statistics.fmean(-1.0 if r["valid_accuracy"] is None else r["valid_accuracy"] for r in item[1])

    for by_lr in groups.values():
        best = max(by_lr.items(), key=mean_valid)[0]
        for lr, rs in by_lr.items():
            for r in rs:
                r["selected"] = lr == best


def _selected(results: list[dict], label: str, d_model: int, train_length: int) -> list[dict]:
    return [r for r in results if r.get("selected") and r["label"] == label
            and r["d_model"] == d_model and r["train_length"] == train_length]


def _accuracies(cells: list[dict], length: int) -> list[float]:
    return [v for v in (r["accuracy"].get(str(length)) for r in cells) if v is not None]


def seed_accuracies(results: list[dict], label: str, d_model: int, train_length: int, length: int) -> list[float]:
    """Test accuracy at ``length`` of each seed of the selected cells (empty where the model has no
    finished cell or cannot run that length): the dots of the plots, whose lines are their mean."""
    return _accuracies(_selected(results, label, d_model, train_length), length)


def plot_series(config: dict[str, Any], results: list[dict], train_length: int,
                d_model: int | None = None) -> dict[str, tuple[list[int], list[list[float]]]]:
    """Per model, the x values and per-seed accuracies of one plot: accuracy vs test length of the
    (``train_length``, ``d_model``) panel, or, with ``d_model`` None, accuracy vs width tested at
    ``train_length``."""
    n = train_length
    if d_model is None:
        xs = list(config["d_model"])
        return {label: (xs, [seed_accuracies(results, label, d, n, n) for d in xs]) for label in _labels(config)}
    xs = test_lengths(config)[n]
    return {label: (xs, [seed_accuracies(results, label, d_model, n, m) for m in xs]) for label in _labels(config)}


def _mean_seconds(cells: list[dict]) -> str:
    """Mean training wall time over the cells that trained to the end (diverged ones have none)."""
    seconds = [r["train_seconds"] for r in cells if r["train_seconds"] is not None]
    return f"{statistics.fmean(seconds):.0f}" if seconds else "–"


def _mean_std(cells: list[dict], length: int, missing: str = "n/a") -> str:
    """``mean ± std`` of the test accuracy over seeds (sample std; the mean alone for one seed);
    ``missing`` where no cell is there yet, "n/a" where the model cannot run that length."""
    if not cells:
        return missing
    values = _accuracies(cells, length)
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def _labels(config: dict[str, Any]) -> list[str]:
    return [m["label"] for m in config["models"]]


def _panel(results: list[dict], d_model: int, train_length: int) -> list[dict]:
    """The finished cells trained at ``train_length`` with width ``d_model`` (any model, lr, seed)."""
    return [r for r in results if r["d_model"] == d_model and r["train_length"] == train_length]


def _shows_width(config: dict[str, Any], results: list[dict], train_length: int) -> bool:
    """Whether training length ``train_length`` gets an accuracy-vs-width table and plot: several
    widths, one of them with a finished cell."""
    widths = config["d_model"]
    return len(widths) > 1 and any(_panel(results, d, train_length) for d in widths)


PLOT_KEY = ("Lines: mean over seeds at each model's best learning rate; dots: each seed, so that a bimodal "
            "model (some seeds solve the task, others do not) shows as separate dots rather than a middling mean.")


def length_plot(train_length: int, d_model: int) -> str:
    """The file name of the accuracy-vs-test-length plot of one (training length, width) panel."""
    return f"accuracy_vs_length_L{train_length}_d{d_model}.png"


def width_plot(train_length: int) -> str:
    """The file name of the accuracy-vs-width plot of one training length."""
    return f"accuracy_vs_width_L{train_length}.png"


def progress_table(config: dict[str, Any], results: list[dict]) -> list[str]:
    """Finished cells of a partial sweep, ``finished/in all``, per model and (training length,
    width) panel (each panel of a model has one cell per learning rate and seed), and in all
    where there are several panels."""
    labels = _labels(config)
    panels = [(n, d) for n in config["train_length"] for d in config["d_model"]]
    per_panel = len(config["training"]["lr"]) * len(config["seeds"])
    several = len(panels) > 1
    rows = []
    for label in [*labels, None]:   # None: every model
        mine = [r for r in results if label is None or r["label"] == label]
        models = len(labels) if label is None else 1
        rows.append([label or "all", *(f"{len(_panel(mine, d, n))}/{per_panel * models}" for n, d in panels),
                     *[f"{len(mine)}/{per_panel * models * len(panels)}"] * several])
    return md_table(["model", *(f"trained {n}, d {d}" for n, d in panels), *["in all"] * several], rows)


def claim_settings(config: dict[str, Any], at: dict[str, Any]) -> list[tuple[int, int, int]]:
    """(d_model, training length, test length) settings that a claim's ``at`` covers."""
    lengths, out = test_lengths(config), []
    for n in config["train_length"]:
        length = at.get("length", "train")
        m = n if length == "train" else max(lengths[n]) if length == "longest" else length
        if at.get("train_length", n) == n and m in lengths[n]:
            out += [(d, n, m) for d in config["d_model"] if at.get("d_model", d) == d]
    return out


def claim_rows(config: dict[str, Any], results: list[dict]) -> list[list[str]]:
    """One row per claim: every setting it covers judged on per-seed accuracies, then combined."""
    rows = []
    for c in parse_claims(config["claims"], [], optional=("at",)):
        verdicts, details, unmeasured, short = [], [], [], set()
        for d, n, m in claim_settings(config, c.at):
            stats = {label: _accuracies(_selected(results, label, d, n), m) for label in _labels(config)}
            verdict, lines = judge(c, stats)
            verdicts.append(verdict)
            if verdict == "not measured":   # said once for all such settings, below
                unmeasured.append(f"d={d}, trained {n}, tested {m}")
                short |= {label for r in c.holds for label in (r.left, r.right) if label in stats
                          and len(stats[label]) < 2}
            else:
                details.append(f"d={d}, trained {n}, tested {m}: " + "; ".join(lines))
        if unmeasured:
            rows_short = ", ".join(label for label in _labels(config) if label in short)
            details.append(f"not measured at {len(unmeasured)} of {len(verdicts)} setting(s) "
                           f"({'; '.join(unmeasured)}): fewer than two seeds of {rows_short}")
        rows.append(report_row(c, combine(verdicts), details))
    return rows


def report_text(config: dict[str, Any], results: list[dict], cells_total: int) -> str:
    """``report.md``: accuracy vs test length per (training length, width), accuracy vs width, the
    claims; ``results`` carry ``selected`` (:func:`select_lr`); fewer than ``cells_total`` is partial."""
    cfg, tr, all_lengths = config, config["training"], test_lengths(config)
    params = ", ".join(f"{k}={v}" for k, v in cfg["task_params"].items()) or "defaults"
    lines = [f"# posattn compare: {cfg['name']}", "",
             f"Task `{cfg['task']}` ({params}), vocabulary {cfg['vocab_size']}; "
             f"{cfg['examples']['train']} training, {cfg['examples']['valid']} validation and up to "
             f"{cfg['examples']['test']} test examples per length "
             f"(test examples also in the training set are dropped). "
             f"Up to {tr['steps']} steps of batch {tr['batch_size']}, AdamW lr {'/'.join(f'{v:g}' for v in tr['lr'])} "
             f"(best by validation accuracy), warmup {tr['warmup']} + cosine, early stop at validation accuracy "
             f"{tr['target_accuracy']}; seeds {cfg['seeds']} (mean ± sample std over seeds). "
             f"Accuracy = fraction of scored tokens "
             f"predicted exactly. `n/a` = the model cannot run that length (reasons below).", ""]
    if len(results) < cells_total:
        lines += [f"**Partial: {len(results)} of {cells_total} cells finished.** A model's learning rate is the "
                  f"best among its finished ones, the steps column has one entry per finished seed, `–` marks a "
                  f"learning rate with no finished cell, and a claim with fewer than 2 seeds of a row is not "
                  f"measured. Rerun the sweep to finish it.", "",
                  "Cells finished per model and panel (one cell per learning rate and seed):", "",
                  *progress_table(cfg, results)]
    reasons: dict[str, str] = {}
    if not results:
        lines += ["No finished cell yet: the tables and plots appear as cells are added.", ""]
    for n in cfg["train_length"] if results else []:
        lengths = all_lengths[n]
        for d in cfg["d_model"]:
            lines += [f"## Accuracy vs test length (trained at {n}, d_model {d})", ""]
            if not _panel(results, d, n):
                lines += ["No finished cell yet.", ""]
                continue
            header = ["model", "params", "lr", "steps", "train s",
                      *(f"{m} (train)" if m == n else str(m) for m in lengths)]
            rows = []
            for label in _labels(cfg):
                cells = _selected(results, label, d, n)
                if not cells:
                    continue
                for r in cells:
                    for m, why in r["not_applicable"].items():
                        reasons.setdefault(f"{label}: length {m}", why)
                rows.append([label, f"{cells[0]['parameters']:,}", f"{cells[0]['lr']:g}",
                             "/".join(str(r["steps"]) for r in cells),
                             _mean_seconds(cells),
                             *(_mean_std(cells, m) for m in lengths)])
            lines += md_table(header, rows)
            if len(lengths) > 1:   # one test length: the width plot below shows it
                lines += [f"![accuracy vs test length, trained at {n}, d_model {d}]({length_plot(n, d)})", "",
                          PLOT_KEY, ""]
            if len(tr["lr"]) > 1:
                lines += [f"Learning-rate sweep: accuracy at length {n} (mean ± std over seeds) per lr; "
                          f"the row above uses the lr with the best mean validation accuracy.", ""]
                grid = [[label, *(_mean_std([r for r in results if r["label"] == label and r["d_model"] == d
                                             and r["train_length"] == n and r["lr"] == lr], n, missing="–")
                                  for lr in tr["lr"])] for label in _labels(cfg)]
                lines += md_table(["model", *(f"lr {lr:g}" for lr in tr["lr"])], grid)
        if not _shows_width(cfg, results, n):
            continue
        lines += [f"## Accuracy vs width (trained and tested at {n})", ""]
        rows = [[label, *(_mean_std(_selected(results, label, d, n), n, missing="–") for d in cfg["d_model"])]
                for label in _labels(cfg)]
        lines += md_table(["model", *(f"d={d}" for d in cfg["d_model"])], rows)
        lines += [f"![accuracy vs width, trained and tested at {n}]({width_plot(n)})", "", PLOT_KEY, ""]
    if cfg.get("claims"):
        lines += [f"## The paper's claims, judged on test accuracy at the best lr (a difference counts beyond "
                  f"{SIGMAS:g} s.e.)", "", *md_table(["claim", "paper", "ours", "verdict"], claim_rows(cfg, results))]
    if reasons:
        lines += ["## Not applicable", ""] + [f"- {k}: {v}" for k, v in sorted(reasons.items())] + [""]
    return "\n".join(lines)


def summarise(name: str, config: dict[str, Any], results: list[dict], cells_total: int | None) -> dict[str, Any]:
    """The sweep's ``results.json``: its name and config, how many cells it has in all, and the
    finished cells' records."""
    return {"name": name, "config": config, "cells_total": cells_total, "cells": results}


def write_summary(name: str, config: dict[str, Any], results: list[dict], cells_total: int, out: Path) -> None:
    """``results.json``, ``report.md`` and the plots of the finished cells' ``results`` (marked with
    :func:`select_lr` in place) into ``out``."""
    select_lr(results)
    write_json_atomic(out / "results.json", summarise(name, config, results, cells_total))
    write_report(config, results, out, cells_total)
    write_plots(config, results, out)


def write_report(config: dict[str, Any], results: list[dict], out: Path, cells_total: int) -> Path:
    """Write :func:`report_text` into ``out/report.md``."""
    path = out / "report.md"
    write_text_atomic(path, report_text(config, results, cells_total))
    return path


def write_plots(config: dict[str, Any], results: list[dict], out: Path) -> list[Path]:
    """PNG plots: accuracy vs test length per panel with a finished cell and several test lengths,
    and accuracy vs width per training length with several widths, each model a mean line with a dot
    per seed (:data:`PLOT_KEY`); the names :func:`report_text` links."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, paths, all_lengths = config, [], test_lengths(config)

    def finish(ax: plt.Axes, title: str, xlabel: str, name: str) -> None:
        ax.set(title=title, xlabel=xlabel, ylabel="accuracy", ylim=(-0.02, 1.02))
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.figure.tight_layout()
        ax.figure.savefig(out / name, dpi=120)
        plt.close(ax.figure)
        paths.append(out / name)

    def line(ax: plt.Axes, xs: list[int], seeds: list[list[float]], label: str) -> None:
        """One model's mean line and a dot per seed in its colour; a model with no finished cell in
        the plot is named as such."""
        shown = label if any(seeds) else f"{label}: no cell yet"
        means = [statistics.fmean(v) if v else float("nan") for v in seeds]
        (drawn,) = ax.plot(xs, means, marker="o", markersize=4, label=shown)
        dots = [(x, y) for x, v in zip(xs, seeds, strict=True) for y in v]
        if dots:
            ax.scatter(*zip(*dots, strict=True), s=16, color=drawn.get_color(), alpha=0.6, linewidths=0)

    for n in cfg["train_length"]:
        lengths = all_lengths[n]
        for d in cfg["d_model"]:
            if not _panel(results, d, n) or len(lengths) == 1:
                continue
            _, ax = plt.subplots(figsize=(6, 4))
            for label, (xs, seeds) in plot_series(cfg, results, n, d).items():
                line(ax, xs, seeds, label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(m) for m in lengths])
            ax.axvline(n, color="grey", linestyle=":")
            finish(ax, f"{cfg['task']}: trained at {n}, d_model {d}", "test length", length_plot(n, d))
        if not _shows_width(cfg, results, n):
            continue
        _, ax = plt.subplots(figsize=(6, 4))
        for label, (xs, seeds) in plot_series(cfg, results, n).items():
            line(ax, xs, seeds, label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cfg["d_model"], [str(d) for d in cfg["d_model"]])
        finish(ax, f"{cfg['task']}: trained and tested at {n}", "d_model", width_plot(n))
    return paths
