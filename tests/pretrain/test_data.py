"""Batches: BERT masking statistics, sentence-pair packing, causal windows, determinism, sharding."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from posattn.pretrain.data import IGNORE, Batches, mlm_instances
from posattn.text.tokenizer import special_ids


def batches(corpus, objective="mlm", length=32, batch_size=64, seed=0):
    return Batches(corpus.splits["train"], objective, length, batch_size, seed, special_ids(corpus.tokenizer),
                   corpus.vocab_size)


def test_instances_stay_inside_one_document_and_fit(corpus):
    split = corpus.splits["train"]
    inst = mlm_instances(split, 32, np.random.default_rng(0))
    doc_of = np.searchsorted(split.sentences[np.asarray(split.documents[1:]) - 1, 1], inst[:, 0], side="left")
    doc_end = split.sentences[np.asarray(split.documents[1:]) - 1, 1][doc_of]
    assert (inst[:, 3] <= doc_end).all() and (inst[:, 1] <= inst[:, 2]).all()
    assert ((inst[:, 1] - inst[:, 0]) + (inst[:, 3] - inst[:, 2]) <= 32 - 3).all()
    assert (inst[:, 1] > inst[:, 0]).all()


def test_masking_follows_bert(corpus):
    data = batches(corpus, batch_size=512)
    b, total = data.batch(0)
    assert total == b.targets
    sp = special_ids(corpus.tokenizer)
    original = torch.where(b.labels != IGNORE, b.labels, b.input_ids)
    special = torch.isin(original, torch.tensor(sp.all()))
    chosen = b.labels != IGNORE
    assert not (chosen & special).any(), "special tokens are never masked"
    rate = chosen.sum() / (~special).sum()
    assert abs(rate - 0.15) < 0.01
    became_mask = (b.input_ids == sp.mask) & chosen
    kept = (b.input_ids == original) & chosen
    other = chosen & ~became_mask & ~kept
    n = chosen.sum()
    assert abs(became_mask.sum() / n - 0.8) < 0.03
    # 10% random (a random token equals the original 1/V of the time) and 10% kept
    assert abs(other.sum() / n - 0.1) < 0.03 and abs(kept.sum() / n - 0.1) < 0.03
    assert not torch.isin(b.input_ids[other], torch.tensor(sp.all())).any()


def test_pairs_layout(corpus):
    b, _ = batches(corpus, batch_size=16).batch(3)
    sp = special_ids(corpus.tokenizer)
    for ids, seg, keep in zip(b.input_ids, b.segment_ids, b.attention_mask):
        n = int(keep.sum())
        assert ids[0] == sp.cls and ids[n - 1] == sp.sep and (ids[n:] == sp.pad).all()
        seps = (ids[:n] == sp.sep).nonzero().flatten().tolist()
        assert len(seps) in (1, 2)
        assert (seg[:seps[0] + 1] == 0).all() and (seg[seps[0] + 1:n] == 1).all() and (seg[n:] == 0).all()


def test_causal_windows_shift_by_one(corpus):
    b, total = batches(corpus, "clm", 24, 8).batch(2)
    assert b.input_ids.shape == (8, 24)
    assert torch.equal(b.input_ids[:, 1:], b.labels[:, :-1])
    assert b.targets == total == 8 * 24


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_step_batches_are_deterministic_and_rank_slices_agree(corpus, objective):
    (a, total), (b, _) = batches(corpus, objective, seed=3).batch(5), batches(corpus, objective, seed=3).batch(5)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.input_ids, batches(corpus, objective, seed=4).batch(5)[0].input_ids)
    slices = [batches(corpus, objective, seed=3).batch(5, rank, 4) for rank in range(4)]
    assert all(t == total for _, t in slices)
    for field in ("input_ids", "labels", "segment_ids", "attention_mask"):
        assert torch.equal(torch.cat([getattr(s, field) for s, _ in slices]), getattr(a, field))
    parts = [a.shard(i, 4) for i in range(4)]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), a.input_ids)


def test_epochs_wrap_with_new_instances(corpus):
    data = batches(corpus, batch_size=8)
    per_epoch = data.units_per_epoch()
    steps = per_epoch // 8 + 2  # crosses into epoch 1
    epochs = {e for e, _ in data.indices(steps)}
    assert epochs == {1}
    units0, _ = data.epoch_plan(0)
    units1, _ = data.epoch_plan(1)
    assert not np.array_equal(units0[: len(units1)], units1[: len(units0)])
