"""Pretraining: resume equals uninterrupted, batch splitting does not change the trajectory, errors."""
from __future__ import annotations

import json

import pytest
import torch

from posattn.errors import PositionError
from posattn.experiments.config import ConfigError
from posattn.experiments.executors import LocalExecutor
from posattn.models.io import load
from posattn.pretrain.config import load as load_config
from posattn.pretrain.config import parse
from posattn.pretrain.run import CHECKPOINT, pretrain
from posattn.text.corpus import build_corpus

from .conftest import make_documents, read_weights, tiny


class Interrupt(Exception):
    pass


def stop_at(n):
    def hook(step):
        if step == n:
            raise Interrupt
    return hook


@pytest.mark.parametrize("objective,mechanisms", [("mlm", ["absolute"]), ("clm", ["rope", "cat"])])
def test_resume_after_interruption_matches_uninterrupted(corpus, tmp_path, objective, mechanisms):
    # dropout > 0: the resumed run must also restore the dropout RNG stream
    cfg = parse(tiny(corpus, objective=objective, mechanisms=mechanisms, dropout=0.1))
    whole = pretrain(cfg, tmp_path / "whole", progress=False)
    with pytest.raises(Interrupt):
        pretrain(cfg, tmp_path / "cut", progress=False, on_step=stop_at(3))  # killed after step 3, checkpoint at 2
    state = torch.load(tmp_path / "cut" / CHECKPOINT, weights_only=True)["loop"]
    assert state["step"] == 2
    resumed = pretrain(cfg, tmp_path / "cut", progress=False)
    a, b = read_weights(tmp_path / "whole"), read_weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["valid_loss"] == whole["valid_loss"]
    steps = [r["step"] for r in map(json.loads, (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines())
             if "loss" in r]
    assert steps == list(range(1, 7)), "metrics of steps past the checkpoint are rewritten, not duplicated"
    assert (tmp_path / "cut" / "loss.png").stat().st_size > 0
    assert pretrain(cfg, tmp_path / "cut", progress=False) == resumed  # a finished run is not trained again


def test_gradient_accumulation_matches_one_big_batch(corpus, tmp_path):
    one = pretrain(parse(tiny(corpus, batch_size=8)), tmp_path / "one", progress=False)
    acc = pretrain(parse(tiny(corpus, batch_size=8, grad_accum=4)), tmp_path / "acc", progress=False)
    a, b = read_weights(tmp_path / "one"), read_weights(tmp_path / "acc")
    assert all(torch.allclose(a[k], b[k], atol=2e-5) for k in a)
    assert acc["valid_loss"] == pytest.approx(one["valid_loss"], abs=1e-4)


def test_learning_goes_down_and_model_folder_loads(corpus, tmp_path):
    # the text is random words from a list of 27: the masked-LM loss falls from ln 64 towards ln 27
    result = pretrain(parse(tiny(corpus, steps=60, eval_every=60, log_every=10, batch_size=16, lr=1e-2)),
                      tmp_path / "r", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[0] > 3.9 and losses[-1] < losses[0] - 0.15
    assert 0 <= result["data_fraction"] < 1 and result["tokens_per_s"] > 0
    model = load(tmp_path / "r" / "model")
    assert model.cfg.vocab_size == 64 and (tmp_path / "r" / "model" / "tokenizer.json").exists()


def test_corrupt_checkpoint_is_refused_and_kept(corpus, tmp_path):
    cfg = parse(tiny(corpus))
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(PositionError, match="unreadable"):
        pretrain(cfg, tmp_path / "r", progress=False)
    assert (tmp_path / "r" / CHECKPOINT).read_bytes() == b"not a checkpoint"


def test_a_checkpoint_carrying_a_pickle_payload_is_refused_unrun(corpus, tmp_path):
    from runtime.payload import plant

    marker = tmp_path / "marker"
    path = plant(tmp_path / "r", marker)
    before = path.read_bytes()
    with pytest.raises(PositionError, match="unreadable .*objects other than tensors and plain data"):
        pretrain(parse(tiny(corpus)), tmp_path / "r", progress=False)
    assert not marker.exists() and path.read_bytes() == before
    assert not (tmp_path / "r" / "model").exists()


HOLD_AT_STEP_3 = """
import json, sys, time
from pathlib import Path
import torch
from posattn.pretrain.config import parse
from posattn.pretrain.run import pretrain
torch.set_num_threads(1)
cfg, (out, ready, go) = json.loads(sys.argv[1]), map(Path, sys.argv[2:5])
def hold(step):
    if step == 3:
        ready.touch()
        while not go.exists():
            time.sleep(0.02)
pretrain(parse(cfg), out, progress=False, on_step=hold)
"""


def test_a_second_process_on_a_run_folder_is_refused_and_the_first_finishes(corpus, tmp_path):
    """Two real processes on one run folder: the second gets one PositionError naming the folder and
    the first's pid and writes nothing; the first ends with the weights of an undisturbed run."""
    import subprocess
    import sys

    from runtime.holder import python_env, wait_for

    cfg, out, ready, go = tiny(corpus), tmp_path / "r", tmp_path / "ready", tmp_path / "go"
    straight = pretrain(parse(cfg), tmp_path / "straight", progress=False)
    first = subprocess.Popen([sys.executable, "-c", HOLD_AT_STEP_3, json.dumps(cfg), str(out), str(ready), str(go)],
                             env=python_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(ready, first)
        files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        with pytest.raises(PositionError, match=rf"{out} is in use by another run \(process {first.pid}\)"):
            pretrain(parse(cfg), out, progress=False)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == files
    finally:
        go.touch()
        assert first.wait(120) == 0, first.stderr.read()
    a, b = read_weights(tmp_path / "straight"), read_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "result.json").read_text())["valid_loss"] == straight["valid_loss"]


def test_a_truncated_model_folder_is_rewritten_from_the_checkpoint(corpus, tmp_path):
    """Killed after its final checkpoint, before result.json, with model.safetensors cut short: the
    rerun rewrites model/ from the checkpoint before it writes result.json, and so does a rerun of
    a finished run whose model/ was damaged or removed; without the checkpoint it refuses clearly."""
    import shutil

    cfg = parse(tiny(corpus))
    whole = pretrain(cfg, tmp_path / "whole", progress=False)
    out = tmp_path / "r"
    with pytest.raises(Interrupt):
        pretrain(cfg, out, progress=False, on_step=stop_at(cfg.steps))
    weights = out / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert pretrain(cfg, out, progress=False)["valid_loss"] == whole["valid_loss"]
    a, b = read_weights(tmp_path / "whole"), read_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load(out / "model") is not None

    weights.write_bytes(weights.read_bytes()[:100])          # finished run, damaged afterwards
    pretrain(cfg, out, progress=False)
    shutil.rmtree(out / "model")                               # ... or removed
    pretrain(cfg, out, progress=False)
    b = read_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a) and (out / "model" / "tokenizer.json").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".model")]   # no temporary folder left

    (out / CHECKPOINT).unlink()
    shutil.rmtree(out / "model")
    with pytest.raises(PositionError, match="model is missing or damaged and .*checkpoint.pt does not hold"):
        pretrain(cfg, out, progress=False)


def test_changed_config_or_corpus_is_refused(corpus, tmp_path):
    with pytest.raises(Interrupt):
        pretrain(parse(tiny(corpus)), tmp_path / "r", progress=False, on_step=stop_at(2))
    before = (tmp_path / "r" / CHECKPOINT).read_bytes()
    with pytest.raises(PositionError, match=r"different config \(lr: 0.003 -> 0.01\)"):
        pretrain(parse(tiny(corpus, lr=0.01)), tmp_path / "r", progress=False)
    other = build_corpus(make_documents(seed=1), tmp_path / "other", vocab_size=64)
    with pytest.raises(PositionError, match=rf"different config \(corpus: '{corpus.folder}' -> '{other.folder}'; "
                                            rf"corpus_fingerprint: '{corpus.fingerprint}' -> '{other.fingerprint}'\)"):
        pretrain(parse({**tiny(corpus), "corpus": str(other.folder)}), tmp_path / "r", progress=False)
    assert (tmp_path / "r" / CHECKPOINT).read_bytes() == before


def test_config_errors_are_listed_together(corpus):
    with pytest.raises(ConfigError) as e:
        parse({"objective": "mlmm", "steps": 0, "lrr": 1, "model": {"widht": 3}, "warmup": -5, "betas": [0.9]})
    text = str(e.value)
    for part in ("unknown key(s) lrr; valid keys: name, objective,", "objective: must be 'mlm' or 'clm', got 'mlmm'",
                 "steps: must be greater than or equal to 1, got 0", "model: unknown key(s) widht; valid keys: d_model",
                 "warmup: must be greater than or equal to 0, got -5", "betas: must have at least 2 item(s)"):
        assert part in text
    with pytest.raises(ConfigError, match="mechanisms\\[0\\]: unknown mechanism 'rope2'"):
        parse({"mechanisms": ["rope2"]})
    with pytest.raises(ConfigError, match="not divisible by n_heads"):      # checked once the keys are valid
        parse({"model": {"d_model": 30, "n_heads": 4}})
    with pytest.raises(ConfigError) as e:
        load_config({"name": "r", "runs": [{"label": "a", "steps": 0}, {"label": "b", "lr": 5}]})
    assert "run 'a'):\n  - steps: must be greater" in str(e.value) and "run 'b'):\n  - lr: must be less than 1" in \
        str(e.value)
    with pytest.raises(ConfigError, match="built-in recipes"):
        load_config("no_such_recipe")


def test_recipes_ship_and_validate():
    for name in ("cat_lm", "chang_mlm"):
        recipe, runs = load_config(name)
        assert recipe == name and len(runs) >= 6
        assert len({label for label, _ in runs}) == len(runs)


def test_batch_not_divisible_is_refused(corpus, tmp_path):
    with pytest.raises(PositionError, match="multiple of processes × grad_accum"):
        pretrain(parse(tiny(corpus, batch_size=6, grad_accum=4)), tmp_path / "r", progress=False)


def test_background_data_workers_change_nothing(corpus, tmp_path):
    pretrain(parse(tiny(corpus, data_workers=0)), tmp_path / "w0", progress=False)
    pretrain(parse(tiny(corpus, data_workers=2)), tmp_path / "w2", progress=False)
    a, b = read_weights(tmp_path / "w0"), read_weights(tmp_path / "w2")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_recipe_in_two_worker_processes_equals_one_run_after_another(corpus, tmp_path):
    """``posattn pretrain RECIPE --workers 2``: the same weights and summary as the serial run."""
    from posattn.pretrain.recipe import run_recipe

    runs = [("abs", parse(tiny(corpus))), ("rope", parse(tiny(corpus, mechanisms=["rope"])))]
    serial = run_recipe("r", runs, tmp_path / "serial", progress=False)
    both = run_recipe("r", runs, tmp_path / "both", progress=False, executor=LocalExecutor(2))
    assert [r["label"] for r in both] == ["abs", "rope"]
    assert [r["valid_loss"] for r in both] == [r["valid_loss"] for r in serial]
    for label, _ in runs:
        a, b = read_weights(tmp_path / "serial" / label), read_weights(tmp_path / "both" / label)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "both" / "report.md").exists()


def test_recipe_workers_share_one_default_corpus(corpus, tmp_path, monkeypatch):
    """The default corpus is built once, before the workers start: three workers each building it
    trained three runs on three corpora that replaced each other in one folder."""
    from posattn.pretrain import run as pretrain_module
    from posattn.pretrain.recipe import run_recipe
    from posattn.text.corpus import open_corpus
    from posattn.text.sources import split_of

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pretrain_module, "load_documents", lambda: make_documents(60))  # this process only
    cfg = {**tiny(corpus), "corpus": "default", "steps": 2, "eval_every": 2, "checkpoint_every": 2}
    run_recipe("r", [("abs", parse(cfg)), ("t5", parse({**cfg, "mechanisms": ["t5"]}))], tmp_path / "out",
               progress=False, executor=LocalExecutor(2))
    built = open_corpus(pretrain_module.DEFAULT_CORPUS)
    assert built.meta["splits"]["train"]["documents"] == sum(split_of(d) == "train" for d in make_documents(60))
    for label in ("abs", "t5"):
        record = json.loads((tmp_path / "out" / label / "pretrain.json").read_text())
        assert record["corpus_fingerprint"] == built.fingerprint


def test_a_recipe_trained_in_parts_reports_every_finished_run(corpus, tmp_path):
    """``posattn pretrain RECIPE --runs LABEL...``: only those runs train; the summary grows."""
    from posattn.pretrain.recipe import run_recipe

    runs = [("abs", parse(tiny(corpus))), ("rope", parse(tiny(corpus, mechanisms=["rope"])))]
    first = run_recipe("r", runs, tmp_path, progress=False, only=["rope"])
    assert [r["label"] for r in first] == ["rope"] and not (tmp_path / "abs").exists()
    assert json.loads((tmp_path / "results.json").read_text())[0]["label"] == "rope"
    run_recipe("r", runs, tmp_path, progress=False, only=["abs"])
    summary = json.loads((tmp_path / "results.json").read_text())
    assert [r["label"] for r in summary] == ["abs", "rope"]  # the recipe's order, both finished
    assert summary[1]["valid_loss"] == first[0]["valid_loss"]
    with pytest.raises(PositionError, match="no run labelled t5 in recipe 'r'; its runs: abs, rope"):
        run_recipe("r", runs, tmp_path, progress=False, only=["t5", "abs"])
    with pytest.raises(PositionError, match="is a single run"):
        run_recipe("one", [("one", parse(tiny(corpus)))], tmp_path / "one", progress=False, only=["one"])


def test_compiled_training_matches_eager(corpus, tmp_path):
    """``compile='dynamo'`` (graph capture, no code generation): the same held-out loss and weights."""
    cfg = parse(tiny(corpus, objective="clm", mechanisms=["alibi"], dropout=0.0))
    eager = pretrain(cfg, tmp_path / "eager", progress=False)
    fast = pretrain(cfg, tmp_path / "fast", progress=False, compile="dynamo")
    assert fast["valid_loss"] == pytest.approx(eager["valid_loss"], rel=1e-5)
    a, b = read_weights(tmp_path / "eager"), read_weights(tmp_path / "fast")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6, msg=key)
    with pytest.raises(PositionError, match="--compile: mode 'fastest' is not one of"):
        pretrain(cfg, tmp_path / "bad", progress=False, compile="fastest")


def test_cli_compile_and_log_to_reach_the_run(corpus, tmp_path):
    """``posattn pretrain --compile dynamo --log-to tensorboard``: the run trains through the compiled
    step (the same loss as eager) and mirrors its metrics rows as TensorBoard scalars."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from posattn.cli import main

    cfg = tiny(corpus, objective="clm", mechanisms=["alibi"], dropout=0.0)
    (tmp_path / "cfg.yaml").write_text(__import__("yaml").safe_dump(cfg))
    eager = pretrain(parse(cfg), tmp_path / "eager", progress=False)
    assert main(["pretrain", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "run"), "--compile", "dynamo",
                 "--log-to", "tensorboard", "--no-progress", "--device", "cpu"]) in (0, None)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["valid_loss"] == pytest.approx(eager["valid_loss"], rel=1e-5)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in events.Scalars("valid_loss")] == [r["step"] for r in rows if "valid_loss" in r]
