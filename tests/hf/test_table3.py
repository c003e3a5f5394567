"""The adapter that runs transformers classifiers through posattn.finetune's loop, and the summary."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

tf = pytest.importorskip("transformers")

from posattn.hf.table3 import Classifier, summarise  # noqa: E402


def test_classifier_adapter_equals_the_transformers_head():
    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(tf.BertConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                                                           intermediate_size=32, vocab_size=40, num_labels=3)).eval()
    ids = torch.randint(1, 40, (2, 7))
    seg = torch.zeros_like(ids)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 5:] = False
    clf = Classifier(model)
    theirs = model(input_ids=ids, token_type_ids=seg, attention_mask=mask.long()).logits
    torch.testing.assert_close(clf.classify(clf(ids, seg, mask)), theirs)
    assert {id(p) for p in clf.parameters()} == {id(p) for p in model.parameters()}


def test_summary_statistics():
    scores = [0.5, 0.7, 0.65]
    cells = [{"variant": "v", "task": "t", "score": s} for s in scores]
    s = summarise(cells)["v"]["t"]
    xs = [100 * x for x in scores]
    assert s["median"] == round(statistics.median(xs), 2) and s["mean"] == round(statistics.fmean(xs), 2)
    assert s["se"] == round(statistics.stdev(xs) / math.sqrt(3), 2) and s["n"] == 3
