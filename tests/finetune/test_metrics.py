"""The GLUE metrics against scikit-learn and scipy, the implementations GLUE's own scorer uses."""
import numpy as np
import pytest

from posattn.finetune import metrics

sklearn_metrics = pytest.importorskip("sklearn.metrics")
stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("seed", range(5))
def test_classification_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    k = 2 + seed % 3
    gold = rng.integers(0, k, 200)
    pred = np.where(rng.random(200) < 0.6, gold, rng.integers(0, k, 200))
    assert metrics.accuracy(pred, gold) == pytest.approx(sklearn_metrics.accuracy_score(gold, pred))
    assert metrics.matthews(pred, gold) == pytest.approx(sklearn_metrics.matthews_corrcoef(gold, pred))
    if k == 2:
        assert metrics.f1(pred, gold) == pytest.approx(sklearn_metrics.f1_score(gold, pred))


def test_degenerate_cases_match_sklearn():
    gold, const = np.array([0, 1, 1, 0]), np.zeros(4, dtype=int)
    assert metrics.matthews(const, gold) == sklearn_metrics.matthews_corrcoef(gold, const) == 0
    assert metrics.f1(const, gold) == sklearn_metrics.f1_score(gold, const, zero_division=0) == 0
    assert metrics.pearson(np.ones(4), gold) == 0


@pytest.mark.parametrize("seed", range(5))
def test_correlations_match_scipy(seed):
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, 6, 100).astype(float)          # ties, as STS-B's 0-5 scores have
    pred = gold + rng.normal(0, 1.5, 100)
    pred[:10] = pred[10]                                  # ties on the prediction side too
    assert metrics.pearson(pred, gold) == pytest.approx(stats.pearsonr(pred, gold)[0])
    assert metrics.spearman(pred, gold) == pytest.approx(stats.spearmanr(pred, gold)[0])
    assert metrics.ranks(pred) == pytest.approx(stats.rankdata(pred))


def test_score_is_mean_of_metrics():
    out = metrics.compute(("f1", "accuracy"), [1, 0, 1, 1], [1, 0, 0, 1])
    assert out["accuracy"] == 0.75 and out["f1"] == pytest.approx(0.8)
    assert out["score"] == pytest.approx(0.775)
