"""Invariants of the synthetic task generators."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from posattn.errors import PositionError
from posattn.synthetic.generators import IGNORE, TASKS, TaskError, drop_overlap, generate

V = 64


def pairs_of(inputs: np.ndarray, n_pairs: int, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys [n, D, ngram] and values [n, D] from the context at the start of each row."""
    block = inputs[:, :n_pairs * (ngram + 1)].reshape(len(inputs), n_pairs, ngram + 1)
    return block[..., :ngram], block[..., ngram]


@pytest.mark.parametrize("task,ngram", [("mqar", 1), ("mqnar", 2), ("mqnar", 3)])
@pytest.mark.parametrize("random_filler", [False, True])
def test_multi_query_layout(task: str, ngram: int, random_filler: bool) -> None:
    d, length = 6, 96
    params = {"num_kv_pairs": d, "random_filler": random_filler}
    if task == "mqnar":
        params.update(ngram=ngram, key_alphabet=4)
    data = generate(task, 200, length, V, seed=3, **params)
    x, y = data.inputs.numpy(), data.labels.numpy()
    assert x.shape == y.shape == (200, length) and x.dtype == np.int64
    keys, values = pairs_of(x, d, ngram)
    context = d * (ngram + 1)
    assert ((keys >= 1) & (keys < V // 2)).all() and ((values >= V // 2) & (values < V)).all()
    if task == "mqnar":
        assert keys.max() <= 4  # key_alphabet
    for row in range(len(x)):
        assert len({tuple(k) for k in keys[row]}) == d, "keys repeat"
        assert len(set(values[row])) == d, "values repeat"
        scored = np.flatnonzero(y[row] != IGNORE)
        assert len(scored) == d, "each key is queried exactly once"
        assert (scored >= context).all()
        starts = scored - (ngram - 1)
        assert ((starts - context) % (ngram + 1) == 0).all(), "queries sit on (ngram+1)-aligned slots"
        lookup = {tuple(k): v for k, v in zip(keys[row], values[row])}
        for start, pos in zip(starts, scored):
            assert y[row, pos] == lookup[tuple(x[row, start:pos + 1])], "label is the queried key's value"
        if not random_filler:
            unqueried = np.ones(length, bool)
            unqueried[:context] = False
            for s in starts:
                unqueried[s:s + ngram] = False
            assert (x[row, unqueried] == 0).all()


def test_mqar_query_gaps_follow_a_power_law() -> None:
    """Zoology's gaps: p(g) ∝ (g+1)^(a-1); with a = 0.01 small gaps dominate, large ones still occur."""
    data = generate("mqar", 2000, 512, V, seed=0, num_kv_pairs=1)
    gaps = (np.flatnonzero(data.labels.numpy() != IGNORE) % 512 - 2) // 2
    space = (512 - 2) // 2
    p = np.arange(1, space + 1, dtype=float) ** -0.99
    p /= p.sum()
    expected_small = p[:8].sum()
    assert abs((gaps < 8).mean() - expected_small) < 0.04
    assert gaps.max() > space // 2


@pytest.mark.parametrize("task,ngram", [("ar", 1), ("nar", 2), ("nar", 4)])
def test_single_query_fills_context_and_queries_at_the_end(task: str, ngram: int) -> None:
    length = 41
    params = {"ngram": ngram} if task == "nar" else {}
    data = generate(task, 100, length, 256, seed=1, **params)
    x, y = data.inputs.numpy(), data.labels.numpy()
    d = (length - ngram) // (ngram + 1)
    keys, values = pairs_of(x, d, ngram)
    assert (np.flatnonzero((y != IGNORE).any(0)) == [length - 1]).all()
    for row in range(len(x)):
        lookup = {tuple(k): v for k, v in zip(keys[row], values[row])}
        assert len(lookup) == d
        assert y[row, -1] == lookup[tuple(x[row, length - ngram:])]


def test_nar_keys_are_ambiguous_token_by_token_with_a_small_alphabet() -> None:
    """With key_alphabet 3 and 2-grams, single tokens repeat across keys: only the N-gram identifies one."""
    data = generate("mqnar", 50, 64, V, seed=0, num_kv_pairs=6, ngram=2, key_alphabet=3)
    keys, _ = pairs_of(data.inputs.numpy(), 6, 2)
    assert all(len(set(k[:, 1])) < 6 for k in keys)
    assert all(len({tuple(r) for r in k}) == 6 for k in keys)


def test_selective_copy_targets_are_the_content_in_order() -> None:
    k, length = 5, 40
    data = generate("selective_copy", 100, length, 20, seed=2, num_tokens=k)
    x, y = data.inputs.numpy(), data.labels.numpy()
    context = length - k
    for row in range(len(x)):
        content = x[row, :context][x[row, :context] != 0]
        assert len(content) == k and (content >= 2).all()
        assert x[row, context] == 1, "separator"
        assert (y[row, :context] == IGNORE).all()
        assert (y[row, context:] == content).all(), "targets are the content tokens in order"
        assert (x[row, context + 1:] == content[:-1]).all(), "teacher forcing"


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_and_splits_disjoint(task: str) -> None:
    a = generate(task, 64, 48, V, seed=5)
    b = generate(task, 64, 48, V, seed=5)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    test = generate(task, 64, 48, V, seed=5, split="test")
    valid = generate(task, 64, 48, V, seed=5, split="valid")
    rows = lambda d: {r.tobytes() for r in d.inputs.numpy()}  # noqa: E731
    assert not rows(a) & rows(test) and not rows(a) & rows(valid) and not rows(valid) & rows(test)


def test_drop_overlap_removes_training_examples_from_a_small_task_space() -> None:
    train = generate("ar", 500, 5, 6, seed=0, num_kv_pairs=1)   # 2 keys x 3 values: few distinct rows
    test = generate("ar", 500, 5, 6, seed=0, split="test", num_kv_pairs=1)
    kept = drop_overlap(test, train)
    seen = {r.tobytes() for r in train.inputs.numpy()}
    assert len(kept) < len(test)
    assert not any(r.tobytes() in seen for r in kept.inputs.numpy())


@pytest.mark.parametrize("call,message", [
    (lambda: generate("mqar", 1, 16, V, 0, num_kv_pairs=8), "too short"),
    (lambda: generate("mqar", 1, 512, 16, 0, num_kv_pairs=20), "only 7 exist"),
    (lambda: generate("copy", 1, 16, V, 0), "valid tasks: mqar"),
    (lambda: generate("mqar", 1, 16, V, 0, ngram=2), "valid: num_kv_pairs"),
    (lambda: generate("mqnar", 1, 64, V, 0, key_alphabet=100), "key_alphabet"),
    (lambda: generate("selective_copy", 1, 10, V, 0, num_tokens=8), "too short"),
    (lambda: generate("mqar", 1, 16, V, 0, split="dev"), "valid splits"),
])
def test_bad_parameters_raise_clear_errors(call, message: str) -> None:
    with pytest.raises(TaskError, match=message) as info:
        call()
    assert isinstance(info.value, PositionError)
