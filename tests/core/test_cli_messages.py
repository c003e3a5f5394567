"""What commands say when they succeed: a finished pretraining run says it is finished (not a silent
exit 0), a causal LM is not offered for fine-tuning, ``analyze kernels`` takes a run folder as every
command does, and ``--json`` prints JSON to stdout."""
from __future__ import annotations

import json

import pytest
import torch

import posattn
from posattn import cli
from posattn.pretrain.run import RESULT

RESULT_ROW = {"steps": 3, "tokens": 96, "tokens_per_s": 1000.0, "valid_loss": 5.0, "valid_perplexity": 148.4}


@pytest.fixture
def no_training(monkeypatch):
    """``posattn pretrain`` with run_recipe replaced: it writes result.json as a finished run would."""
    def fake(name, runs, out, **kwargs):
        out.mkdir(parents=True, exist_ok=True)
        (out / RESULT).write_text(json.dumps(RESULT_ROW))
        return [RESULT_ROW]

    monkeypatch.setattr("posattn.pretrain.cli.run_recipe", fake)


def test_rerunning_a_finished_pretrain_says_so(tmp_path, capsys, no_training):
    argv = ["pretrain", "--objective", "clm", "--out", str(tmp_path / "lm"), "--no-progress"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert "already finished" not in first
    assert cli.main(argv) == 0
    again = capsys.readouterr().out
    assert f"default was already finished in {tmp_path / 'lm'}/: nothing trained" in again


@pytest.mark.parametrize("objective, offered, not_offered", [("clm", "posattn eval-lm", "fine-tuning"),
                                                             ("mlm", "fine-tuning (posattn finetune)", "eval-lm")])
def test_the_model_is_offered_for_what_it_can_do(objective, offered, not_offered, tmp_path, capsys, no_training):
    assert cli.main(["pretrain", "--objective", objective, "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert offered in last and not_offered not in last and f"{tmp_path / 'run'}/model" in last


def test_analyze_kernels_takes_a_run_folder(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = posattn.ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=16,
                              mechanisms=["t5"])
    posattn.save(posattn.Encoder(cfg), tmp_path / "pretrain-x" / "model")
    for given in (tmp_path / "pretrain-x", tmp_path / "pretrain-x" / "model"):
        assert cli.main(["analyze", "kernels", str(given), "--positions", "8", "--json",
                         "--out", str(tmp_path / "kernels")]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["figures"]


def test_json_prints_to_stdout_and_files_go_to_out(tmp_path, capsys):
    assert cli.main(["mechanisms", "--json", "--d-model", "16", "--heads", "2"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), list)
    assert cli.main(["bench", "--quick", "--threads", "1", "--repeats", "1", "--warmup", "0", "--no-memory", "-m",
                     "t5", "-n", "16", "--kinds", "op", "--device", "cpu", "--json", "--out", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "bench.json").read_text())
    assert {r["mechanism"] for r in printed} == {"sdpa", "t5"}
