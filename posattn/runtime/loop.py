"""The one training loop of posattn: ``compare``, ``pretrain`` and ``finetune`` all train here.

A caller supplies what differs between them: a step function (the batch of a step, the forward
pass and the loss; it calls ``backward`` on the loss), an evaluation, and a :class:`Plan` (steps,
learning rate per step, cadences, stopping rules). The loop owns everything else:

- **the optimizer step**: learning rate set for each step, fp16 loss scaling when asked,
  gradient-norm clipping, ``optimizer.step``, gradients cleared;
- **divergence**: a non-finite loss stops the run with :class:`Diverged` before the weights change;
- **evaluation** every ``eval_every`` steps and at the end, recorded in the history; **keep the
  best** weights by one metric and restore them at the end; **early stop** on a target value or
  after ``patience`` evaluations without improvement;
- **checkpoints** (:mod:`posattn.runtime.checkpoint`: atomic, tensors and plain data only) every
  ``checkpoint_every`` steps (default: at each evaluation) and at the end, holding the model, the
  optimizer, the loss scaler, every rank's RNG state and the loop's own state. A run started
  again with a checkpoint in place resumes from it and, since the batch of a step depends on the
  seed and the step alone (:mod:`posattn.runtime.order`), ends with the weights of an
  uninterrupted run; a checkpoint written with other settings is refused
  (:func:`~posattn.runtime.checkpoint.check_config`);
- **metrics**: training rows (mean loss, learning rate, tokens/s) every ``log_every`` steps and
  evaluation rows through :class:`~posattn.runtime.metrics.MetricsLog`; a progress bar;
- **subnormal floats** flushed to zero on the CPU while it runs
  (:func:`~posattn.runtime.device.subnormals_flushed`: sharp attention otherwise slows a step
  several times over; the evaluation functions flush their own forward passes, in or out of the loop);
- **several processes** (``torchrun``, :class:`~posattn.runtime.world.World`): rank 0 evaluates,
  logs and writes; every rank's dropout stream is checkpointed.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from posattn.errors import PositionError
from posattn.heap import RELEASE_EVERY, release_freed_memory
from posattn.runtime.checkpoint import CHECKPOINT, check_config, load_checkpoint, save_checkpoint
from posattn.runtime.device import subnormals_flushed
from posattn.runtime.lock import run_lock
from posattn.runtime.metrics import MetricsLog
from posattn.runtime.world import World

LOOP_KEYS = ("config", "model", "optimizer", "scaler", "rng", "loop")


class Diverged(PositionError, FloatingPointError):
    """The training loss became NaN or infinite; the weights of the step that produced it are not applied."""


@dataclass(frozen=True)
class Plan:
    """How one run trains: its length, learning rate, cadences and stopping rules."""

    steps: int                                   # optimizer steps of the whole run
    lr: Callable[[int], float]                   # learning rate of optimizer step s (0-based)
    eval_every: int                              # evaluate every this many steps, and at the end
    grad_clip: float = 1.0                       # clip the gradients' global norm to this (0: no clipping)
    seed: int = 0                                # seeds the dropout stream of a fresh run
    checkpoint_every: int | None = None          # checkpoint every this many steps (None: at each evaluation)
    log_every: int | None = None                 # a training row every this many steps (None: none)
    keep_best: str | None = None                 # metric (higher is better) whose best weights are restored
    target: tuple[str, float] | None = None      # stop once this metric reaches this value
    patience: int | None = None                  # stop after this many evaluations without a new best
    loss_scaling: bool = False                   # fp16: scale the loss (torch.amp.GradScaler)
    description: str = "train"                   # progress bar and error messages

    def __post_init__(self) -> None:
        if self.patience is not None and self.keep_best is None:
            raise PositionError("patience counts evaluations without a new best: it needs keep_best")


@dataclass
class LoopState:
    """Where a run stands; saved in every checkpoint (tensors and plain data only)."""

    step: int = 0
    done: bool = False
    loss: float | None = None                    # the last step's loss
    history: list[dict[str, Any]] = field(default_factory=list)   # one row per evaluation
    best: dict[str, torch.Tensor] | None = None  # weights of the best evaluation (with keep_best)
    best_score: float = -math.inf
    best_step: int = 0
    bad: int = 0                                 # evaluations since the last new best
    seconds: float = 0.0                         # wall time, summed over every resumed part
    cpu_seconds: float = 0.0                     # this process's CPU time, likewise
    train_seconds: float = 0.0                   # time inside training steps only (no evaluation, no saving)
    counters: dict[str, float] = field(default_factory=dict)  # sums of what the steps report (e.g. tokens)
    earlier: tuple[float, float] = (0.0, 0.0)    # (wall, CPU) seconds of the parts this run resumed
    resumed_at: int = 0                          # the step this call started from (0: a fresh run)

    def to_checkpoint(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("earlier", "resumed_at")}


StepFn = Callable[[int, Callable[[torch.Tensor], None]], tuple[float, Mapping[str, float]]]
EvalFn = Callable[[LoopState], dict[str, float]]


def run_loop(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, step_fn: StepFn,
             evaluate: EvalFn | None, *, device: torch.device, folder: str | Path | None = None,
             config: Mapping[str, Any] | None = None, ignore: tuple[str, ...] = (), world: World | None = None,
             log: MetricsLog | None = None, progress: bool = True, on_checkpoint: Callable[[], None] | None = None,
             on_step: Callable[[int], None] | None = None) -> LoopState:
    """Train ``model`` by ``plan`` and return the state. With a run ``folder``, its ``checkpoint.pt``
    is resumed from if it exists and written by the plan's cadence, and rank 0 holds the folder's
    lock meanwhile (:func:`~posattn.runtime.lock.run_lock`, re-entrant: a caller may hold it too).

    ``step_fn(step, backward)`` computes the loss of ``step``, calls ``backward(loss)`` (once, or once
    per micro-batch) and returns ``(loss, counts)``: the step's loss as a float (the same on every
    rank) and numbers to sum over the run (``tokens`` also feeds the tokens/s of training rows).
    ``evaluate(state)`` returns the metrics of an evaluation row (rank 0 only). ``config``: the
    settings the checkpoint must have been written with (``ignore``: keys free to change on
    resume). ``on_checkpoint``: called on rank 0 after each checkpoint (e.g. to export the model).
    ``on_step(step)``: called after every step (tests interrupt runs with it). With ``progress``, a
    resumed run says on stderr from which step.
    """
    world = world or World()
    path = None if folder is None else Path(folder) / CHECKPOINT
    locked = run_lock(folder) if folder is not None and world.main else contextlib.nullcontext()
    with locked, subnormals_flushed(device):
        return _run(model, optimizer, plan, step_fn, evaluate, device, path, config, ignore, world, log, progress,
                    on_checkpoint, on_step)


def _run(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, step_fn: StepFn, evaluate: EvalFn | None,
         device: torch.device, path: Path | None, config: Mapping[str, Any] | None, ignore: tuple[str, ...],
         world: World, log: MetricsLog | None, progress: bool, on_checkpoint: Callable[[], None] | None,
         on_step: Callable[[int], None] | None) -> LoopState:
    """:func:`run_loop` with its checkpoint ``path`` (None: no checkpoint), the folder locked."""
    config = dict(config or {})
    scaler = torch.amp.GradScaler(device.type, enabled=plan.loss_scaling)
    state = LoopState()
    if path is not None and path.exists():
        saved = load_checkpoint(path, LOOP_KEYS)
        check_config(saved["config"], config, path, ignore=ignore)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scaler.load_state_dict(saved["scaler"])
        world.set_rng(saved["rng"], device)
        state = LoopState(**saved["loop"])
        state.earlier, state.resumed_at = (state.seconds, state.cpu_seconds), state.step
        if progress and world.main and not state.done:
            print(f"{plan.description}: resuming from step {state.step} of {plan.steps} ({path})", file=sys.stderr)
    else:
        torch.manual_seed(plan.seed)
    if log is not None:
        log.resume(state.step)
    model.train()
    start, cpu, before = time.perf_counter(), time.process_time(), state.earlier

    def clock() -> None:
        state.seconds = before[0] + time.perf_counter() - start
        state.cpu_seconds = before[1] + time.process_time() - cpu

    def save() -> None:
        clock()
        rng = world.gather_rng(device)
        if path is not None and world.main:
            save_checkpoint(path, {"config": config, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                   "scaler": scaler.state_dict(), "rng": rng, "loop": state.to_checkpoint()})
        if on_checkpoint is not None and world.main:
            on_checkpoint()
        world.barrier()

    def backward(loss: torch.Tensor) -> None:
        scaler.scale(loss).backward()

    bar = tqdm(total=plan.steps, initial=state.step, desc=plan.description, leave=False, dynamic_ncols=True,
               disable=not progress or state.done or not world.main)

    def show(row: dict[str, Any]) -> None:
        if log is not None and world.main:
            log.write(row)
        bar.set_postfix({k: round(v, 4) for k, v in row.items() if k != "step" and isinstance(v, float)})

    window = {"loss": 0.0, "count": 0, "tokens": 0.0, "start": time.perf_counter()}
    while not state.done and state.step < plan.steps:
        step = state.step
        t0 = time.perf_counter()
        lr = plan.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, counts = step_fn(step, backward)
        if not math.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            raise Diverged(f"{plan.description}: the loss became {loss} at step {step}; lower the learning rate "
                           f"(now {lr:g}) or train in fp32")
        scaler.unscale_(optimizer)
        if plan.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), plan.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        state.step = step = step + 1
        state.loss = loss
        for key, value in counts.items():
            state.counters[key] = state.counters.get(key, 0) + value
        state.train_seconds += time.perf_counter() - t0
        window["loss"] += loss
        window["count"] += 1
        window["tokens"] += counts.get("tokens", 0)
        bar.update(1)
        if plan.log_every and (step % plan.log_every == 0 or step == plan.steps):
            speed = window["tokens"] / max(1e-9, time.perf_counter() - window["start"])
            show({"step": step, "loss": window["loss"] / window["count"], "lr": plan.lr(step), "tokens_per_s": speed,
                  "tokens": state.counters.get("tokens", 0), "elapsed_s": state.train_seconds})
            window.update(loss=0.0, count=0, tokens=0.0)
        evaluated = step % plan.eval_every == 0 or step >= plan.steps
        if evaluated:
            if world.main and evaluate is not None:
                row = {"step": step, **evaluate(state)}
                state.history.append(row)
                show(row)
                _judge(plan, state, row, model)
            world.barrier()
        state.done = state.done or step >= plan.steps
        if (plan.checkpoint_every is None and evaluated) or state.done or (
                plan.checkpoint_every is not None and step % plan.checkpoint_every == 0):
            save()
        if step % RELEASE_EVERY == 0:
            release_freed_memory()  # without it the heap fragments to gigabytes (posattn.heap)
        if on_step is not None:
            on_step(step)
        if window["count"] == 0:  # speed is measured over training only: evaluation and saving excluded
            window["start"] = time.perf_counter()
    bar.close()
    clock()
    if plan.keep_best is not None and state.best is not None:
        model.load_state_dict(state.best)
    return state


def _judge(plan: Plan, state: LoopState, row: dict[str, Any], model: nn.Module) -> None:
    """Keep the best weights and decide early stopping from the evaluation ``row``."""
    if plan.keep_best is not None:
        value = row[plan.keep_best]
        if value > state.best_score:
            state.best = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            state.best_score, state.best_step, state.bad = value, state.step, 0
        else:
            state.bad += 1
        if plan.patience is not None and state.bad >= plan.patience:
            state.done = True
    if plan.target is not None and row.get(plan.target[0], -math.inf) >= plan.target[1]:
        state.done = True
