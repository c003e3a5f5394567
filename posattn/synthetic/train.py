"""Training loop for the synthetic tasks: AdamW, warmup + cosine, clipping, early stop, resume.

The loop is deterministic: batch order comes from ``seed`` and the step number alone, and a
checkpoint holds the model, the optimizer, the RNG state and the evaluation history, so a run
resumed from any checkpoint ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from posattn import schedule
from posattn.models.transformer import scored_rows
from posattn.runtime.compile import compiled
from posattn.runtime.device import inference, resolve_device
from posattn.runtime.loop import LoopState, Plan, run_loop
from posattn.runtime.optim import adamw
from posattn.runtime.order import batch_indices
from posattn.synthetic.generators import IGNORE, TaskData


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; ``warmup`` below 1 is a fraction of ``steps``, else a step count."""

    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup: float = 0.1
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    target_accuracy: float | None = None
    eval_every: int = 100
    eval_batch_size: int = 256
    seed: int = 0

    @property
    def warmup_steps(self) -> int:
        return schedule.warmup_steps(self.warmup, self.steps)

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine decay."""
        return self.lr * schedule.lr_factor(step, self.steps, self.warmup_steps, "cosine", self.min_lr_ratio)


@dataclass
class TrainResult:
    """What a run did: steps taken, whether it hit the target, evaluation history, last loss, and
    its wall time in seconds (summed over every resumed part)."""

    steps: int
    stopped_early: bool
    valid_accuracy: float | None
    loss: float | None
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def masked_loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                scored_max: int | None = None) -> torch.Tensor:
    """Cross-entropy over the scored positions only (``labels != IGNORE``), whose logits alone
    the model computes (``model(inputs, scored=keep)``). Inside ``torch.compile`` the scored rows'
    count, a shape that depends on the data, would split the step at a host sync: there the
    model computes ``scored_max`` rows per example (a bound on any example's scored positions,
    known before training: ``model(inputs, scored=keep, scored_max=...)``, padded with unscored
    rows), or without that bound every position's logits, the unscored ones ignored
    (``ignore_index``) either way: the same mean."""
    keep = labels != IGNORE
    if torch.compiler.is_compiling():
        if scored_max is None:
            logits = model(inputs)
        else:
            logits = model(inputs, scored=keep, scored_max=scored_max)
            labels = labels.gather(1, scored_rows(keep, labels.shape, scored_max)[0])
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    return nn.functional.cross_entropy(model(inputs, scored=keep).float(), labels[keep])


def scored_bound(data: TaskData) -> int:
    """The most scored positions of any one example of ``data``: :func:`masked_loss`'s
    ``scored_max`` for a compiled step (one host sync per run, none per step)."""
    return int((data.labels != IGNORE).sum(1).max()) if len(data) else 0


def evaluate(model: nn.Module, data: TaskData, batch_size: int = 256,
             device: str | torch.device | None = None) -> float:
    """Accuracy of the argmax prediction over the scored positions of ``data``
    (:func:`~posattn.runtime.device.inference`: eval mode, no autograd, subnormals flushed on the CPU)."""
    device = device or next(model.parameters()).device
    correct = total = 0
    with inference(model, device):
        for start in range(0, len(data), batch_size):
            inputs = data.inputs[start:start + batch_size].to(device)
            labels = data.labels[start:start + batch_size].to(device)
            keep = labels != IGNORE
            predictions = model(inputs, scored=keep).argmax(-1)
            correct += int((predictions == labels[keep]).sum())
            total += int(keep.sum())
    return correct / max(1, total)


def train(model: nn.Module, data: TaskData, cfg: TrainConfig, *, valid: TaskData | None = None,
          checkpoint_dir: str | Path | None = None, device: str | torch.device = "auto",
          progress: bool = True, description: str = "train", compile: str | None = None) -> TrainResult:
    """Train ``model`` on ``data``; evaluate on ``valid``. The model maps ``(input_ids, scored=mask)``
    to the logits [k, vocab] of the k scored positions, as posattn's ``Decoder`` does.

    Every ``cfg.eval_every`` steps (and at the end) the model is evaluated on ``valid``; it stops
    once accuracy reaches ``cfg.target_accuracy``. With ``checkpoint_dir`` a checkpoint is written
    at each evaluation and an existing one is resumed from; the folder is locked meanwhile
    (:func:`~posattn.runtime.lock.run_lock`). Seed the model's initialisation yourself
    (``torch.manual_seed``) before building it. ``compile``: a :mod:`posattn.runtime.compile` mode
    for the training step's forward and backward (evaluation stays eager); the model then also
    takes ``scored_max`` (:func:`masked_loss`). The loop is
    :func:`posattn.runtime.loop.run_loop`.
    """
    device = resolve_device(device)
    model.to(device)
    optimizer = adamw(model, cfg.lr, cfg.weight_decay)
    loss_of = compiled(masked_loss, compile)
    scored_max = scored_bound(data) if compile else None

    def step_fn(step: int, backward: Callable[[torch.Tensor], None]) -> tuple[float, dict[str, float]]:
        idx = batch_indices(len(data), cfg.batch_size, step, cfg.seed)
        inputs, labels = data.inputs[idx].to(device), data.labels[idx].to(device)
        loss = loss_of(model, inputs, labels, scored_max)
        backward(loss)
        return loss.item(), {}

    def evaluation(state: LoopState) -> dict[str, float]:
        row = {"loss": state.loss}
        if valid is not None:
            row["valid_accuracy"] = evaluate(model, valid, cfg.eval_batch_size, device)
        return row

    target = ("valid_accuracy", cfg.target_accuracy) if cfg.target_accuracy is not None else None
    plan = Plan(steps=cfg.steps, lr=cfg.lr_at, eval_every=cfg.eval_every, grad_clip=cfg.grad_clip, seed=cfg.seed,
                target=target, description=description)
    state = run_loop(model, optimizer, plan, step_fn, evaluation, device=device, config=asdict(cfg),
                     folder=checkpoint_dir, progress=progress)
    last = state.history[-1] if state.history else {}
    return TrainResult(steps=state.step, stopped_early=state.step < cfg.steps,
                       valid_accuracy=last.get("valid_accuracy"), loss=state.loss, history=state.history,
                       seconds=round(state.seconds, 2))
