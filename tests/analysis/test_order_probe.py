"""Zero-shot order probe: the batched pseudo-log-likelihood equals one masked forward pass per token,
a model without positions ties every pair (exactly chance), and bad input is refused clearly."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from finetune.helpers import make_checkpoint, tokenizer  # tests/ is on sys.path (pytest's rootdir layout)
from finetune.test_position_tasks import DOCS

import posattn
from posattn.analysis.order_probe import order_probe, probe, pseudo_log_likelihoods
from posattn.finetune import offline
from posattn.finetune.batches import encode_examples
from posattn.finetune.tasks import POSITION, Example
from posattn.text.tokenizer import special_ids


def encoder(mechanisms, seed=0):
    torch.manual_seed(seed)
    return posattn.Encoder(posattn.ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                                               max_len=128, mechanisms=mechanisms)).eval()


@pytest.mark.parametrize("name", ["word_order", "sentence_order"])
def test_pseudo_log_likelihood_equals_one_forward_pass_per_masked_token(name):
    tok, task = tokenizer(), POSITION[name]
    sp = special_ids(tok)
    data = encode_examples(tok, task, offline.position_examples(name, DOCS)[:6], 128)
    model = encoder(["absolute", "t5"])
    got = pseudo_log_likelihoods(model, data, sp.mask, {sp.cls, sp.sep}, batch_tokens=50)  # many small batches
    for i, ids in enumerate(data.ids):
        ids_t, seg, mask, _ = data.batch([i])
        want = 0.0
        for t, token in enumerate(ids):
            if token in (sp.cls, sp.sep):
                continue
            masked = ids_t.clone()
            masked[0, t] = sp.mask
            with torch.no_grad():
                logits = model.mlm_logits(model(masked, seg, mask))[0, t]
            want += float(torch.log_softmax(logits, -1)[token])
        assert got[i] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("name", list(POSITION))
def test_a_model_without_positions_ties_every_pair_and_a_positional_one_does_not(name):
    tok, task = tokenizer(), POSITION[name]
    examples = offline.position_examples(name, DOCS)
    bag = probe(encoder(["none"]), tok, task, examples, 128)
    assert bag["accuracy"] == 0.5 and bag["ties"] == bag["pairs"] == len(examples) // 2
    positional = probe(encoder(["absolute"]), tok, task, examples, 128)
    assert positional["ties"] < positional["pairs"]


def test_bad_input_is_refused(tmp_path):
    tok = tokenizer()
    with pytest.raises(posattn.PositionError, match="not a position task"):
        probe(encoder(["none"]), tok, posattn.finetune.tasks.TASKS["trec6"], [], 128)
    lonely = [Example("a b c", None, 1, "g")]
    with pytest.raises(posattn.PositionError, match="in pairs"):
        probe(encoder(["none"]), tok, POSITION["word_order"], lonely, 128)
    make_checkpoint(tmp_path / "dec", kind="decoder")
    with pytest.raises(posattn.PositionError, match="not classification-capable"):
        order_probe([tmp_path / "dec"], tmp_path / "out", max_pairs=1)
    with pytest.raises(posattn.PositionError, match="unknown task"):
        order_probe([tmp_path / "dec"], tmp_path / "out", tasks=["word_order", "trec6"])
    with pytest.raises(posattn.PositionError, match="max-pairs"):
        order_probe([tmp_path / "dec"], tmp_path / "out", max_pairs=0)
    enc = make_checkpoint(tmp_path / "enc")
    with pytest.raises(posattn.PositionError, match="share a label"):
        order_probe([enc, enc / "model"], tmp_path / "out")
    assert not (tmp_path / "out").exists()   # nothing written for refused input


def test_command_probes_the_real_held_out_pairs(tmp_path, capsys):
    try:
        offline.heldout_sentences()
    except posattn.PositionError as e:
        pytest.skip(str(e))
    from posattn.cli import main
    a, b = (make_checkpoint(tmp_path / name, [mechanism], max_len=96)
            for name, mechanism in (("bag", "none"), ("abs", "absolute")))
    main(["analyze", "order-probe", str(a), str(b), "--max-pairs", "60", "--out", str(tmp_path / "out"),
          "--no-progress"])
    report = json.loads((tmp_path / "out" / "order_probe.json").read_text())
    assert (tmp_path / "out" / "order_probe.png").stat().st_size > 0
    assert set(report["models"]) == {"bag", "abs"}
    for model in report["models"].values():
        assert set(model["tasks"]) == set(POSITION)
        assert all(0 < r["pairs"] and r["pairs"] + r["dropped_too_long"] <= 60 for r in model["tasks"].values())
    assert report["models"]["bag"]["tasks"]["sentence_order"]["dropped_too_long"] > 0   # character-level pieces
    assert all(r["accuracy"] == 0.5 for r in report["models"]["bag"]["tasks"].values())
    assert "bag: word_order 0.500" in capsys.readouterr().out
    assert np.isfinite(report["models"]["abs"]["tasks"]["word_order"]["mean_delta_per_token"])


def test_checkpoints_are_named_by_their_run_folder():
    """Labels, and the default output folder of `posattn analyze order-probe`, name the run, never `model`."""
    from posattn.analysis.order_probe import default_label
    assert default_label("runs/pretrain-chang_mlm/composite/model") == "composite"
    assert default_label(Path("runs/pretrain-chang_mlm/composite")) == "composite"
