"""eval-lm: perplexity against length, non-inductive mechanisms skipped with a reason, rope scaling."""
from __future__ import annotations

import json
import math

import pytest
import torch

from posattn.cli import main
from posattn.errors import PositionError
from posattn.pretrain import lm_eval
from posattn.pretrain.config import parse
from posattn.pretrain.lm_eval import length_scaled_config, length_sweep, subject, write_report
from posattn.pretrain.run import pretrain
from posattn.text.corpus import build_corpus

from .conftest import make_documents, tiny


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for label, mechs, objective in (("rope", ["rope"], "clm"), ("absolute", ["absolute"], "clm"),
                                    ("enc", ["t5"], "mlm")):
        pretrain(parse(tiny(corpus, objective=objective, mechanisms=mechs, steps=4)), root / label, progress=False)
    return root


def test_perplexity_at_every_length_and_reasons(runs):
    rows = length_sweep([subject(runs / "rope"), subject(runs / "absolute")], multipliers=[1, 2],
                        tokens=256, rope_scaling="yarn", progress=False)
    by = {r["label"]: r for r in rows}
    assert set(by) == {"rope", "rope + yarn", "absolute"}
    assert all(v is not None and math.isfinite(v) for v in by["rope"]["valid_perplexity"].values())
    assert by["absolute"]["valid_perplexity"]["64"] is None
    assert "absolute: needs 64 positions" in by["absolute"]["skipped"]["64"]
    # at the training length YaRN with factor 1 is the unscaled model
    assert by["rope + yarn"]["valid_loss"]["32"] == pytest.approx(by["rope"]["valid_loss"]["32"], rel=1e-6)
    assert by["rope + yarn"]["factor"] == {"32": 1.0, "64": 2.0}
    # beyond it the rescaled model is another function; compared on hidden states, since a model
    # trained for 4 steps attends almost uniformly and its mean loss can round to the same float
    s = subject(runs / "rope")
    ids = torch.randint(0, s.config["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(0))
    plain = lm_eval._model(s.config, s.folder, torch.device("cpu")).hidden(ids)
    yarn = lm_eval._model(length_scaled_config(s.config, "yarn", 2.0), s.folder, torch.device("cpu")).hidden(ids)
    assert (plain - yarn).abs().max() > 1e-4


def test_rope_scaling_rewrites_only_rope():
    config = {"max_len": 128, "mechanisms": ["cat", {"name": "rope", "base": 500.0}]}
    scaled = length_scaled_config(config, "linear", 4.0)
    assert scaled["mechanisms"] == ["cat", {"name": "rope", "base": 500.0, "scaling": "linear", "factor": 4.0,
                                            "original_max_len": 128}]
    assert length_scaled_config({"max_len": 8, "mechanisms": ["t5"]}, "yarn", 2.0) is None
    with pytest.raises(PositionError, match="rope: unknown length scaling 'pi'"):
        length_scaled_config(config, "pi", 2.0)


@pytest.mark.parametrize("scaling", ["ntk", "dynamic", "yarn", "llama3"])
def test_every_rope_scaling_rewrites_rope_options(scaling):
    config = {"max_len": 64, "mechanisms": [{"name": "rope", "fraction": 0.5}, "alibi"]}
    scaled = length_scaled_config(config, scaling, 3.0)
    assert scaled["mechanisms"] == [{"name": "rope", "fraction": 0.5, "scaling": scaling, "factor": 3.0,
                                     "original_max_len": 64}, "alibi"]


def test_longrope_uses_the_models_factors_and_refuses_a_model_without_them():
    factors = {"short_factor": [1.0] * 4, "long_factor": [3.0] * 4}
    config = {"max_len": 64, "mechanisms": [{"name": "rope", **factors}]}
    scaled = length_scaled_config(config, "longrope", 2.0)
    assert scaled["mechanisms"] == [{"name": "rope", **factors, "scaling": "longrope", "factor": 2.0,
                                     "original_max_len": 64}]
    with pytest.raises(PositionError, match="longrope needs the model's rope options short_factor and long_factor"):
        length_scaled_config({"max_len": 64, "mechanisms": ["rope"]}, "longrope", 2.0)


def test_new_scalings_evaluate_a_trained_model(runs):
    """ntk, dynamic and llama3 leave the model as it is at the training length (factor 1; dynamic
    below its trained length) and change it beyond."""
    s = subject(runs / "rope")
    rows = length_sweep([s], multipliers=[1], tokens=256, rope_scaling="llama3", progress=False)
    assert [r["label"] for r in rows] == ["rope", "rope + llama3"]
    assert rows[1]["valid_loss"]["32"] == pytest.approx(rows[0]["valid_loss"]["32"], rel=1e-6)
    ids = torch.randint(0, s.config["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(0))
    plain = lm_eval._model(s.config, s.folder, torch.device("cpu")).hidden(ids)
    for scaling in ("ntk", "dynamic", "llama3"):
        at_one = lm_eval._model(length_scaled_config(s.config, scaling, 1.0), s.folder, torch.device("cpu"))
        torch.testing.assert_close(at_one.hidden(ids[:, :32]), plain[:, :32])  # causal: the first 32 rows
        scaled = lm_eval._model(length_scaled_config(s.config, scaling, 2.0), s.folder, torch.device("cpu"))
        assert (scaled.hidden(ids) - plain).abs().max() > 1e-4, scaling


def test_command_writes_report_and_plots(runs, tmp_path, capsys):
    assert main(["eval-lm", str(runs / "rope"), str(runs / "enc"), "--lengths", "32", "64", "--tokens", "128",
                 "--out", str(tmp_path / "e"), "--no-progress"]) == 0
    rows = json.loads((tmp_path / "e" / "lengths.json").read_text())
    assert [r["kind"] for r in rows] == ["decoder", "encoder"]
    assert (tmp_path / "e" / "perplexity_vs_length.png").exists()
    assert (tmp_path / "e" / "mlm_loss_vs_length.png").exists()
    assert "| rope |" in capsys.readouterr().out


def test_vocabulary_mismatch_is_refused(runs, tmp_path):
    other = build_corpus(make_documents(60, seed=5), tmp_path / "other", vocab_size=48)
    with pytest.raises(PositionError, match="tokenizer differs"):
        subject(runs / "rope", other.folder)
    with pytest.raises(PositionError, match="needs --corpus"):
        subject(runs / "rope" / "model")
    write_report([], tmp_path / "empty")


def test_held_out_loss_is_computed_with_subnormals_flushed_on_the_cpu(runs):
    """eval-lm scores outside any training loop, flushed as training is
    (posattn.runtime.device.subnormals_flushed); the caller's mode is back afterwards."""
    from runtime.floats import SUBNORMAL, modes_seen, times_one

    s = subject(runs / "rope")
    model = lm_eval._model(s.config, s.folder, torch.device("cpu"))
    with modes_seen(model.tokens) as seen:
        lm_eval.score(model, s.corpus, 32, 128, torch.device("cpu"))
    assert len(seen) == 4 and set(seen) == {0.0}          # 128 tokens in 4 windows of 32
    assert times_one(SUBNORMAL) == pytest.approx(SUBNORMAL, rel=1e-3)
