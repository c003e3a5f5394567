"""The one training loop (posattn.runtime.loop): divergence, keeping the best, early stopping,
checkpoint cadence and resume, metrics rows and their mirror, on a model small enough to reason
about (a linear regression)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from posattn.errors import PositionError
from posattn.runtime.checkpoint import load_checkpoint
from posattn.runtime.device import inference, subnormals_flushed
from posattn.runtime.loop import Diverged, Plan, run_loop
from posattn.runtime.metrics import MetricsLog
from runtime.floats import SUBNORMAL, times_one

CPU = torch.device("cpu")


def problem(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(step, backward):
        idx = torch.arange(step * 8, step * 8 + 8) % 64
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        backward(loss)
        return loss.item(), {"tokens": 8}

    def evaluate(state):
        with torch.no_grad():
            return {"loss": state.loss, "score": -nn.functional.mse_loss(model(x), y).item()}

    return model, optimizer, step_fn, evaluate


def test_diverged_loss_stops_before_the_weights_change():
    model, optimizer, step_fn, evaluate = problem()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def nan_step(step, backward):
        loss = model(torch.ones(2, 3)).sum() * math.nan
        backward(loss)
        return loss.item(), {}

    with pytest.raises(Diverged, match="the loss became nan at step 0; lower the learning rate") as info:
        run_loop(model, optimizer, Plan(steps=3, lr=lambda s: 0.1, eval_every=1), nan_step, evaluate, device=CPU,
                 progress=False)
    assert isinstance(info.value, FloatingPointError) and isinstance(info.value, PositionError)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_keep_best_restores_the_best_evaluation_and_patience_stops():
    model, optimizer, step_fn, evaluate = problem()
    scores = iter([0.5, 0.9, 0.7, 0.6, 0.95])
    weights = []

    def scripted(state):
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
        return {"score": next(scores)}

    plan = Plan(steps=10, lr=lambda s: 0.05, eval_every=1, keep_best="score", patience=2)
    state = run_loop(model, optimizer, plan, step_fn, scripted, device=CPU, progress=False)
    assert state.step == 4 and state.done             # two evaluations without a new best after step 2
    assert state.best_step == 2 and state.best_score == 0.9
    assert all(torch.equal(weights[1][k], v) for k, v in model.state_dict().items())
    with pytest.raises(PositionError, match="patience .* needs keep_best"):
        Plan(steps=1, lr=lambda s: 0.1, eval_every=1, patience=2)


def test_target_stops_early():
    model, optimizer, step_fn, _ = problem()
    plan = Plan(steps=50, lr=lambda s: 0.1, eval_every=5, target=("score", 0.5))
    state = run_loop(model, optimizer, plan, step_fn, lambda state: {"score": state.step / 10}, device=CPU,
                     progress=False)
    assert state.step == 5 and [r["step"] for r in state.history] == [5]


def test_resume_from_any_checkpoint_matches_an_uninterrupted_run(tmp_path, capsys):
    plan = Plan(steps=12, lr=lambda s: 0.05 * (1 - s / 12), eval_every=4, checkpoint_every=3, log_every=2)
    model, optimizer, step_fn, evaluate = problem()
    whole = run_loop(model, optimizer, plan, step_fn, evaluate, device=CPU, progress=False)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    class Stop(Exception):
        pass

    def stop_at(n):
        def hook(step):
            if step == n:
                raise Stop
        return hook

    model, optimizer, step_fn, evaluate = problem()
    with pytest.raises(Stop):
        run_loop(model, optimizer, plan, step_fn, evaluate, device=CPU, progress=False, folder=tmp_path,
                 config={"a": 1}, log=MetricsLog(tmp_path), on_step=stop_at(8))
    assert load_checkpoint(tmp_path / "checkpoint.pt", ("loop",))["loop"]["step"] == 6     # checkpoints every 3 steps
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [2, 4, 4, 6, 8, 8]           # training rows every 2 steps, evaluation rows every 4

    model, optimizer, step_fn, evaluate = problem(seed=5)   # another init: everything comes from the checkpoint
    log = MetricsLog(tmp_path)
    resumed = run_loop(model, optimizer, plan, step_fn, evaluate, device=CPU, progress=True,
                       folder=tmp_path, config={"a": 1}, log=log)
    assert f"train: resuming from step 6 of 12 ({tmp_path / 'checkpoint.pt'})" in capsys.readouterr().err
    assert all(torch.equal(reference[k], v) for k, v in model.state_dict().items())
    assert resumed.history == whole.history and resumed.counters == {"tokens": 96}
    assert resumed.earlier[0] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 4, 6, 8, 8, 10, 12, 12], "steps past the checkpoint logged once"
    assert rows == log.rows
    with pytest.raises(PositionError, match=r"different config \(a: 1 -> 2\)"):
        run_loop(model, optimizer, plan, step_fn, evaluate, device=CPU, progress=False,
                 folder=tmp_path, config={"a": 2})


def test_metrics_mirror_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, optimizer, step_fn, evaluate = problem()
    log = MetricsLog(tmp_path, ["tensorboard"])
    run_loop(model, optimizer, Plan(steps=4, lr=lambda s: 0.05, eval_every=2, log_every=1), step_fn, evaluate,
             device=CPU, progress=False, log=log)
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("score")] == [2, 4]
    assert [e.step for e in events.Scalars("tokens_per_s")] == [1, 2, 3, 4]
    with pytest.raises(PositionError, match="unknown destination wandb; choose from tensorboard"):
        MetricsLog(tmp_path, ["wandb"])


@pytest.mark.parametrize("earlier", [False, True])
def test_subnormals_flush_to_zero_while_the_loop_trains_then_the_mode_is_restored(earlier):
    model, optimizer, step_fn, evaluate = problem()
    seen = []

    def step(step, backward):
        seen.append(times_one(SUBNORMAL))
        return step_fn(step, backward)

    torch.set_flush_denormal(earlier)
    try:
        run_loop(model, optimizer, Plan(steps=3, lr=lambda s: 0.1, eval_every=3), step, evaluate, device=CPU,
                 progress=False)
        after = times_one(SUBNORMAL)
    finally:
        torch.set_flush_denormal(False)
    assert seen == [0.0, 0.0, 0.0]
    assert (after == 0.0) == earlier and times_one(SUBNORMAL) == pytest.approx(SUBNORMAL, rel=1e-3)


def test_subnormals_are_restored_when_the_loop_raises():
    model, optimizer, step_fn, evaluate = problem()

    def nan_step(step, backward):
        assert times_one(SUBNORMAL) == 0.0
        loss = model(torch.ones(2, 3)).sum() * math.nan
        backward(loss)
        return loss.item(), {}

    with pytest.raises(Diverged):
        run_loop(model, optimizer, Plan(steps=3, lr=lambda s: 0.1, eval_every=1), nan_step, evaluate, device=CPU,
                 progress=False)
    assert times_one(SUBNORMAL) == pytest.approx(SUBNORMAL, rel=1e-3)


def test_subnormals_are_left_alone_off_the_cpu():
    with subnormals_flushed(torch.device("meta")):
        assert times_one(SUBNORMAL) == pytest.approx(SUBNORMAL, rel=1e-3)


def test_inference_scores_in_eval_mode_without_grad_flushed_then_restores_the_model():
    """Every evaluation computes through ``inference``; the model trains again afterwards, also
    when scoring raises, and the caller's grad and float modes are back."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)).train()
    with pytest.raises(RuntimeError, match="scoring failed"):
        with inference(model, CPU):
            assert not model.training and not model[1].training
            assert not torch.is_grad_enabled() and times_one(SUBNORMAL) == 0.0
            raise RuntimeError("scoring failed")
    assert model.training and model[1].training and torch.is_grad_enabled()
    assert times_one(SUBNORMAL) == pytest.approx(SUBNORMAL, rel=1e-3)
    with inference(model.eval(), CPU):
        pass
    assert not model.training                      # a model scored in eval mode stays there
