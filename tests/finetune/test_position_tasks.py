"""Position-sensitive tasks: built from held-out text only, both classes per source, and a model
without position information (``none``) sits exactly at chance on all three."""
import random

import numpy as np
import pytest
import torch

import posattn
from posattn.finetune import offline
from posattn.finetune.batches import encode_examples
from posattn.finetune.run import predict
from posattn.finetune.tasks import POSITION

from .helpers import SENTENCES, tokenizer

DOCS = [("toy/a", SENTENCES[:5] + [None] + SENTENCES[5:8]), ("toy/b", SENTENCES[7:] + SENTENCES[:3])]


def classifier(mechanisms, n_classes=2, seed=0):
    torch.manual_seed(seed)
    return posattn.Encoder(posattn.ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                                               max_len=128, mechanisms=mechanisms, n_classes=n_classes))


def test_local_shuffle_keeps_the_words_and_the_ends():
    rng = random.Random(0)
    for s in SENTENCES:
        out = offline.local_shuffle(s, rng)
        w, v = s.split(), out.split()
        assert out != s and sorted(w) == sorted(v) and w[0] == v[0] and w[-1] == v[-1]
        changed = [i for i in range(len(w)) if w[i] != v[i]]
        assert max(changed) - min(changed) < offline.WINDOW


@pytest.mark.parametrize("name", list(POSITION))
def test_both_classes_per_source_with_the_same_words(name):
    examples = offline.position_examples(name, DOCS)
    assert len(examples) % 2 == 0 and examples
    for x, y in zip(examples[::2], examples[1::2]):
        assert x.label != y.label and x.group == y.group
        assert sorted(f"{x.a} {x.b or ''}".split()) == sorted(f"{y.a} {y.b or ''}".split())
    if name == "sentence_order":   # adjacency never crosses the filtered-out sentence (None)
        assert all((x.a, x.b) != (SENTENCES[4], SENTENCES[5]) for x in examples)


@pytest.mark.parametrize("name", list(POSITION))
def test_none_model_is_exactly_at_chance_and_a_positional_one_is_not_blind(name):
    task, tok = POSITION[name], tokenizer()
    examples = offline.position_examples(name, DOCS)
    data = encode_examples(tok, task, examples, 128)
    labels = data.labels.numpy()
    for seed in range(3):
        bag = classifier(["none"], seed=seed)
        ids, seg, mask, _ = data.batch(list(range(len(data))))
        logits = bag.classify(ids, seg, mask).detach()
        assert torch.allclose(logits[::2], logits[1::2], atol=1e-5)       # blind to the order the task asks about
        assert np.mean(predict(bag, task, data, 7) == labels) == 0.5       # so exactly chance on the paired set
    positional = classifier(["absolute"])
    ids, seg, mask, _ = data.batch(list(range(len(data))))
    logits = positional.classify(ids, seg, mask).detach()
    assert not torch.allclose(logits[::2], logits[1::2], atol=1e-5)


def test_real_tasks_use_only_heldout_documents():
    sources = pytest.importorskip("posattn.text.sources")
    try:
        docs = sources.load_documents()
    except posattn.PositionError as e:
        pytest.skip(str(e))
    heldout = {f"{d.source}/{d.id}" for d in docs if sources.split_of(d) == "heldout"}
    data = offline.load_offline("word_order", docs=docs)
    groups = {e.group for split in (data.train, data.valid, data.test["test"]) for e in split}
    assert groups <= heldout and len(groups) > 50
    assert not ({e.group for e in data.train} & {e.group for e in data.test["test"]})   # split by document
    assert sum(e.label for e in data.test["test"]) * 2 == len(data.test["test"])       # balanced
