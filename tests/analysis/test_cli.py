"""Every ``posattn analyze`` command on a tiny posattn checkpoint and a tiny HF checkpoint."""
import importlib.util
import json

import pytest
import torch

from posattn.cli import main
from posattn.models import build_model, save

from .conftest import write_bert


@pytest.fixture
def posattn_folder(tmp_path):
    model = build_model({"kind": "encoder", "vocab_size": 40, "d_model": 16, "n_heads": 2, "n_layers": 2,
                         "max_len": 24, "mechanisms": ["absolute", "fixed_conv", "depthwise_conv", "t5"]})
    return save(model, tmp_path / "pa")


def run(capsys, *argv):
    assert main(["analyze", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


FIT = ["--kernels", "2", "--restarts", "2", "--adam-steps", "50", "--lbfgs-steps", "30"]


def test_commands_on_posattn_checkpoint(posattn_folder, tmp_path, capsys):
    out = tmp_path / "out"
    rep = run(capsys, "toeplitz", str(posattn_folder), "--out", str(out / "t"))
    assert set(rep) >= {"r2", "n_positions"} and rep["n_positions"] == 24
    assert (out / "t" / "toeplitz.png").is_file() and (out / "t" / "toeplitz.json").is_file()
    rep = run(capsys, "profiles", str(posattn_folder), "--positions", "16", "--out", str(out / "p"))
    assert len(rep["r2_per_layer_head"]) == 2 and (out / "p" / "sections_layer1.png").is_file()
    rep = run(capsys, "fit-tisa", str(posattn_folder), "--positions", "16", *FIT, "--out", str(out / "f"))
    assert (out / "f" / "tisa_model" / "model.safetensors").is_file() and len(rep["per_head"]["rmse"]) == 2
    rep = run(capsys, "fit-tisa", str(out / "f" / "tisa_model"), "--positions", "16", *FIT, "--no-model",
              "--out", str(out / "f2"))  # the built model is a valid posattn checkpoint
    assert rep["fit_r2_median"] > 0.9
    rep = run(capsys, "rank", str(posattn_folder), "--random-pair", "--d-model", "16", "--positions", "16",
              "--out", str(out / "r"))
    assert rep["models"]["random diet_abs"]["fraction_above_head_dim"] == 1.0
    assert rep["models"]["pa"]["score_rank_max"] > 8  # its Toeplitz terms (fixed_conv, t5) lift the bound too
    rep = run(capsys, "kernels", str(posattn_folder), "--positions", "16", "--out", str(out / "k"))
    kinds = {(i["mechanism"], i["kind"]) for i in rep["items"]}
    assert {("fixed_conv", "offsets"), ("t5", "offsets"), ("depthwise_conv", "depthwise")} <= kinds
    assert sum(i["mechanism"] == "t5" for i in rep["items"]) == 1  # shared across layers: shown once


def test_commands_on_hf_checkpoint(tmp_path, capsys):
    weights = write_bert(tmp_path / "hf")
    rep = run(capsys, "toeplitz", str(tmp_path / "hf"), "--out", str(tmp_path / "t"))
    assert rep["kind"] == "hf:bert" and rep["n_positions"] == 12
    rep = run(capsys, "profiles", str(tmp_path / "hf"), "--positions", "10", "--out", str(tmp_path / "p"))
    assert rep["method"] == "embedding" and rep["layer_norm"] is True
    if importlib.util.find_spec("transformers") is None:
        rep = run(capsys, "fit-tisa", str(tmp_path / "hf"), "--positions", "10", *FIT, "--no-model",
                  "--out", str(tmp_path / "f"))
        return
    rep = run(capsys, "fit-tisa", str(tmp_path / "hf"), "--positions", "10", *FIT, "--out", str(tmp_path / "f"))
    # the pretrained model itself with TISA from the fit (TISA App. C), not a fresh encoder
    from posattn.hf.retrofit import load_retrofitted

    model = load_retrofitted(tmp_path / "f" / "tisa_model")
    assert model.config.posattn_retrofit["mode"] == "replace"
    query = model.encoder.layer[1].attention.self.query.weight
    assert torch.equal(query, torch.tensor(weights["encoder.layer.1.attention.self.query.weight"]).float())
    assert model.embeddings.position_embeddings.weight.abs().max() == 0  # folded into the words, zeroed
    tisa = model.encoder.layer[1].attention.self.position_mechanisms[0]
    assert torch.allclose(tisa.a, torch.tensor(rep["per_head"]["a"][1]), atol=1e-5)


def test_one_clear_error(tmp_path, capsys):
    (tmp_path / "neither").mkdir()
    for cmd in ("toeplitz", "profiles", "fit-tisa", "kernels"):
        assert main(["analyze", cmd, str(tmp_path / "neither"), "--out", str(tmp_path / "o")]) == 2
        assert "neither a Hugging Face checkpoint" in capsys.readouterr().err
    save(build_model({"kind": "encoder", "vocab_size": 10, "d_model": 8, "n_heads": 2, "n_layers": 1,
                      "max_len": 8, "mechanisms": ["rope"]}), tmp_path / "rope")
    assert main(["analyze", "toeplitz", str(tmp_path / "rope"), "--out", str(tmp_path / "o")]) == 2
    assert "no input position embeddings" in capsys.readouterr().err
    write_bert(tmp_path / "hf")
    assert main(["analyze", "kernels", str(tmp_path / "hf"), "--out", str(tmp_path / "o")]) == 2
    assert "no learned position kernels" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing written for a refused input
