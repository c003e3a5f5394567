"""The official GLUE metrics (Wang et al. 2019, Table 1), computed with numpy.

GLUE's own evaluation uses scikit-learn and scipy; these functions give the same numbers
(tests check them against both): Matthews correlation for CoLA, accuracy, binary F1 of the
positive class (label 1: paraphrase, duplicate, spam) for MRPC and QQP, Pearson and Spearman
correlation for STS-B. A task scores each metric; its *score* (one column of the papers'
tables) is the unweighted mean of its metrics, as on the GLUE leaderboard.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Values = Sequence[float] | np.ndarray


def accuracy(pred: Values, gold: Values) -> float:
    """Fraction of exact matches."""
    return float(np.mean(np.asarray(pred) == np.asarray(gold)))


def f1(pred: Values, gold: Values) -> float:
    """F1 of the positive class (label 1); 0 when nothing is predicted or gold positive."""
    p, g = np.asarray(pred) == 1, np.asarray(gold) == 1
    tp = float(np.sum(p & g))
    return 0.0 if tp == 0 else 2 * tp / (float(np.sum(p)) + float(np.sum(g)))


def matthews(pred: Values, gold: Values) -> float:
    """Matthews correlation coefficient, multiclass form (Gorodkin 2004); 0 when undefined."""
    p, g = np.asarray(pred), np.asarray(gold)
    labels = np.union1d(p, g)
    c = np.array([[np.sum((g == a) & (p == b)) for b in labels] for a in labels], dtype=np.float64)
    t, q, n = c.sum(1), c.sum(0), c.sum()
    cov_pg = np.trace(c) * n - t @ q
    denom = np.sqrt(n * n - q @ q) * np.sqrt(n * n - t @ t)
    return 0.0 if denom == 0 else float(cov_pg / denom)


def pearson(pred: Values, gold: Values) -> float:
    """Pearson correlation; 0 when either side is constant."""
    x, y = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denom = np.sqrt((x * x).sum() * (y * y).sum())
    return 0.0 if denom == 0 else float((x * y).sum() / denom)


def ranks(x: Values) -> np.ndarray:
    """1-based ranks with ties given their average rank (scipy's ``rankdata``)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_x)) + 1]
    ends = np.r_[starts[1:], len(x)]
    out = np.empty(len(x))
    for a, b in zip(starts, ends):
        out[order[a:b]] = (a + b + 1) / 2
    return out


def spearman(pred: Values, gold: Values) -> float:
    """Spearman's rank correlation: Pearson correlation of the (tie-averaged) ranks."""
    return pearson(ranks(pred), ranks(gold))


METRICS: dict[str, Callable[[Values, Values], float]] = {
    "accuracy": accuracy, "f1": f1, "matthews": matthews, "pearson": pearson, "spearman": spearman}


def compute(names: Sequence[str], pred: Values, gold: Values) -> dict[str, float]:
    """Each named metric of ``pred`` against ``gold``, plus ``score``: their mean."""
    out = {name: METRICS[name](pred, gold) for name in names}
    out["score"] = float(np.mean(list(out.values())))
    return out
