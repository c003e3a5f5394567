"""PNG plots of pretraining runs, recipes and length sweeps (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402


def plot_run(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Training loss and held-out loss against step; held-out accuracy on the right axis."""
    train = [r for r in history if "loss" in r]
    valid = [r for r in history if "valid_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", alpha=0.7)
    ax.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy per scored token")
    right = ax.twinx()
    right.plot([r["step"] for r in valid], [r["valid_accuracy"] for r in valid], "s--", color="tab:green",
               label="held-out accuracy")
    right.set_ylabel("accuracy")
    lines = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_recipe(histories: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    """Held-out loss curves of every run of a recipe on one axis."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, history in histories.items():
        valid = [r for r in history if "valid_loss" in r]
        ax.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", ms=3, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lengths(rows: list[dict[str, Any]], path: Path, train_length: int, metric: str) -> None:
    """``metric`` against evaluation length, one line per model (log-log axes). Rows labelled
    ``model + rescaling`` share a colour per rescaling and a line style per model, so that a dozen
    lines stay apart."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bases = list(dict.fromkeys(row["label"].split(" + ")[0] for row in rows))
    kinds = list(dict.fromkeys(row["label"].partition(" + ")[2] for row in rows))
    by_kind = len(kinds) > 1 and len(bases) <= 4
    for i, row in enumerate(rows):
        points = [(int(n), v) for n, v in row[metric].items() if v is not None]
        base, _, kind = row["label"].partition(" + ")
        style = ({"color": f"C{kinds.index(kind) % 10}", "ls": ("-", "--", ":", "-.")[bases.index(base)]}
                 if by_kind else {"color": f"C{i % 10}", "ls": "-" if i < 10 else "--"})
        if points:
            ax.plot(*zip(*sorted(points)), marker="o", ms=4, label=row["label"], **style)
    ax.axvline(train_length, color="grey", ls=":", label="training length")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("evaluation context length (tokens)")
    ax.set_ylabel(metric.replace("valid_", "held-out ").replace("_", " "))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
