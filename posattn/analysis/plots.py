"""Matplotlib figures (Agg backend, PNG files) for the analyses."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from numpy.typing import NDArray  # noqa: E402


def _grid(count: int, size: float = 2.4, cols: int | None = None):  # noqa: ANN202 - (fig, axes)
    cols = cols or min(count, 4 if count <= 8 else 6)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.axis("off")
    return fig, list(axes.flat)


def _save(fig, path: Path) -> Path:  # noqa: ANN001 - a matplotlib Figure
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def toeplitz_figure(p: NDArray, cosine_offsets: NDArray, adjacent: NDArray, r2: float, title: str, path: Path) -> Path:
    """P = E_P E_Pᵀ heatmap (TISA Fig 1), mean cosine by offset, adjacent-position cosine."""
    fig, ax = plt.subplots(1, 3, figsize=(14, 4.2))
    lo, hi = np.percentile(p, [1, 99])  # a few large-norm positions would wash out the rest
    im = ax[0].imshow(p, cmap="viridis", vmin=lo, vmax=hi)
    fig.colorbar(im, ax=ax[0], fraction=0.046)
    ax[0].set_title(f"{title}\nP = E_P E_Pᵀ, Toeplitz R² = {r2:.3f}")
    ax[0].set_xlabel("position j")
    ax[0].set_ylabel("position i")
    ax[1].plot(np.arange(len(cosine_offsets)), cosine_offsets)
    ax[1].set_xlabel("offset r")
    ax[1].set_ylabel("mean cos(e_i, e_{i+r})")
    ax[1].set_title("cosine by offset")
    ax[2].plot(np.arange(len(adjacent)), adjacent)
    ax[2].set_xlabel("position i")
    ax[2].set_ylabel("cos(e_i, e_{i+1})")
    ax[2].set_title("adjacent-position cosine")
    return _save(fig, path)


def sections_figure(scores: NDArray, r2: NDArray, layer: int, rows: list[int], half: int, path: Path) -> Path:
    """Sections F̂_P[i, i + r], |r| ≤ half, for several i, one panel per head (TISA Fig 3 left, Fig 6)."""
    h, n = scores.shape[0], scores.shape[-1]
    fig, axes = _grid(h)
    for head, ax in enumerate(axes[:h]):
        for i in rows:
            r = np.arange(max(-half, -i), min(half, n - 1 - i) + 1)
            ax.plot(r, scores[head, i, i + r], lw=1, label=f"i={i}")
        ax.set_title(f"L{layer} H{head}  R²={r2[head]:.2f}", fontsize=8)
        ax.axvline(0, color="grey", lw=0.5)
        ax.tick_params(labelsize=6)
    axes[0].legend(fontsize=5)
    fig.suptitle(f"layer {layer}: sections through F̂_P (x: r = j − i)", fontsize=9)
    return _save(fig, path)


def heatmaps_figure(mats: NDArray, titles: list[str], suptitle: str, path: Path, cmap: str = "RdBu_r") -> Path:
    """One heatmap per matrix of ``[m, a, b]`` (F̂_P per head, DIET-ABS P_Q P_Kᵀ, segment tables)."""
    fig, axes = _grid(len(mats))
    for mat, title, ax in zip(mats, titles, axes):
        lim = float(np.abs(mat).max()) or 1.0
        ax.imshow(mat, cmap=cmap, vmin=-lim, vmax=lim)
        ax.set_title(title, fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(suptitle, fontsize=9)
    return _save(fig, path)


def fit_figure(r: NDArray, profiles: NDArray, fits: NDArray, errors: NDArray, layer: int, path: Path) -> Path:
    """Diagonal-mean profile vs fitted TISA function + offset, one panel per head (TISA Fig 3/6)."""
    h = profiles.shape[0]
    fig, axes = _grid(h)
    for head, ax in enumerate(axes[:h]):
        ax.plot(r, profiles[head], lw=1, label="F̂_P profile")
        ax.plot(r, fits[head], lw=1, ls="--", label="TISA fit")
        ax.set_title(f"L{layer} H{head}  R²={errors[head]:.2f}", fontsize=8)
        ax.tick_params(labelsize=6)
    axes[0].legend(fontsize=5)
    fig.suptitle(f"layer {layer}: TISA kernels fitted to F̂_P (x: r = j − i)", fontsize=9)
    return _save(fig, path)


def offsets_figure(r: NDArray, tables: NDArray, title: str, path: Path) -> Path:
    """Score added at each offset, one line per head (Chang Fig 2; TISA Fig 3 right)."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for head, row in enumerate(tables):
        ax.plot(r, row, lw=1, label=f"H{head}")
    ax.set_xlabel("r = j − i")
    ax.set_ylabel("score term")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=5, ncol=2)
    return _save(fig, path)


def depthwise_figure(weight: NDArray, title: str, path: Path) -> Path:
    """Depthwise kernels ``[channels, k]``, channels sorted by the centroid of |w| (Chang Fig 3)."""
    k = weight.shape[1]
    r = np.arange(k) - (k - 1) / 2
    centroid = (np.abs(weight) * r).sum(1) / np.maximum(np.abs(weight).sum(1), 1e-12)
    order = np.argsort(centroid)
    fig, ax = plt.subplots(figsize=(4, 6))
    lim = float(np.abs(weight).max()) or 1.0
    ax.imshow(weight[order], aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim)
    ax.set_xlabel("tap")
    ax.set_ylabel("channel (sorted)")
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def filter_figure(filters: NDArray, title: str, path: Path) -> Path:
    """CAT filter(s): ``[k]`` or ``[d, k]``."""
    fig, ax = plt.subplots(figsize=(5, 3))
    f = np.atleast_2d(filters)
    for row in f[:64]:
        ax.plot(np.arange(f.shape[1]), row, lw=0.6)
    ax.set_xlabel("tap")
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def rank_figure(series: dict[str, NDArray], bound: int | None, title: str, path: Path) -> Path:
    """Numerical rank per (layer, head) for each named model/term (DIET Fig 2/8)."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / max(len(series), 1)
    for i, (name, ranks) in enumerate(series.items()):
        flat = np.asarray(ranks).reshape(-1)
        ax.bar(np.arange(len(flat)) + i * width, flat, width=width, label=name)
    if bound is not None:
        ax.axhline(bound, color="black", ls="--", lw=1, label=f"d_h = {bound}")
    ax.set_xlabel("layer × head (row-major)")
    ax.set_ylabel("numerical rank")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def order_probe_figure(results: dict, tasks: list[str], path: Path) -> Path:
    """Zero-shot order-probe accuracy (± 1 s.e.) per model and position task, chance at 0.5."""
    fig, ax = plt.subplots(figsize=(max(5.5, 1.5 + 0.45 * len(tasks) * len(results)), 3.6))
    width = 0.8 / max(len(results), 1)
    for i, (label, r) in enumerate(results.items()):
        acc = [r["tasks"][t]["accuracy"] for t in tasks]
        err = [r["tasks"][t]["stderr"] for t in tasks]
        ax.bar(np.arange(len(tasks)) + (i - (len(results) - 1) / 2) * width, acc, width=width, yerr=err,
               capsize=2, label=label)
    ax.axhline(0.5, color="black", ls="--", lw=1, label="chance")
    ax.set_xticks(np.arange(len(tasks)), tasks)
    ax.set_ylim(0, 1)
    ax.set_ylabel("pairs where PLL(true order) is higher")
    ax.set_title("zero-shot order probe (masked-LM pseudo-log-likelihood)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    return _save(fig, path)
