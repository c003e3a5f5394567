"""Training loop for the synthetic tasks: AdamW, warmup + cosine, clipping, early stop, resume.

The loop is deterministic: batch order comes from ``seed`` and the step number alone, and a
checkpoint holds the model, the optimizer, the RNG state and the evaluation history, so a run
resumed from any checkpoint ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from posattn import schedule
from posattn.runtime.checkpoint import (
    CHECKPOINT,
    check_config,
    load_checkpoint,
    save_checkpoint,
)
from posattn.runtime.device import resolve_device
from posattn.runtime.lock import run_lock
from posattn.runtime.optim import adamw
from posattn.runtime.order import batch_indices
from posattn.runtime.rng import rng_state, set_rng_state
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


def masked_loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the scored positions only (``labels != IGNORE``), whose logits alone
    the model computes (``model(inputs, scored=keep)``)."""
    keep = labels != IGNORE
    return nn.functional.cross_entropy(model(inputs, scored=keep).float(), labels[keep])


@torch.no_grad()
def evaluate(model: nn.Module, data: TaskData, batch_size: int = 256,
             device: str | torch.device | None = None) -> float:
    """Accuracy of the argmax prediction over the scored positions of ``data``."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = total = 0
    for start in range(0, len(data), batch_size):
        inputs = data.inputs[start:start + batch_size].to(device)
        labels = data.labels[start:start + batch_size].to(device)
        keep = labels != IGNORE
        predictions = model(inputs, scored=keep).argmax(-1)
        correct += int((predictions == labels[keep]).sum())
        total += int(keep.sum())
    model.train(was_training)
    return correct / max(1, total)


def train(model: nn.Module, data: TaskData, cfg: TrainConfig, *, valid: TaskData | None = None,
          checkpoint_dir: str | Path | None = None, device: str | torch.device = "auto",
          progress: bool = True, description: str = "train") -> TrainResult:
    """Train ``model`` on ``data``; evaluate on ``valid``. The model maps ``(input_ids, scored=mask)``
    to the logits [k, vocab] of the k scored positions, as posattn's ``Decoder`` does.

    Every ``cfg.eval_every`` steps (and at the end) the model is evaluated on ``valid``; it stops
    once accuracy reaches ``cfg.target_accuracy``. With ``checkpoint_dir`` a checkpoint is written
    at each evaluation and an existing one is resumed from; the folder is locked meanwhile
    (:func:`~posattn.runtime.lock.run_lock`). Seed the model's initialisation yourself
    (``torch.manual_seed``) before building it.
    """
    if checkpoint_dir is None:
        return _train(model, data, cfg, valid, None, resolve_device(device), progress, description)
    with run_lock(checkpoint_dir):
        return _train(model, data, cfg, valid, Path(checkpoint_dir) / CHECKPOINT, resolve_device(device), progress,
                      description)


def _train(model: nn.Module, data: TaskData, cfg: TrainConfig, valid: TaskData | None, path: Path | None,
           device: torch.device, progress: bool, description: str) -> TrainResult:
    """:func:`train` with its checkpoint ``path`` (None: no checkpoint) and device resolved."""
    model.to(device).train()
    optimizer = adamw(model, cfg.lr, cfg.weight_decay)
    step, history, done, loss_value, before = 0, [], False, None, 0.0
    torch.manual_seed(cfg.seed)
    if path is not None and path.exists():
        state = load_checkpoint(path, ("config", "model", "optimizer", "rng", "step", "history", "done", "loss"))
        check_config(state["config"], asdict(cfg), path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state, device)
        step, history, done, loss_value = state["step"], state["history"], state["done"], state["loss"]
        before = state.get("seconds", 0.0)
    start = time.perf_counter()

    def seconds() -> float:
        return before + time.perf_counter() - start

    def checkpoint() -> None:
        if path is not None:
            save_checkpoint(path, {"config": asdict(cfg), "model": model.state_dict(),
                                   "optimizer": optimizer.state_dict(), **rng_state(device), "step": step,
                                   "history": history, "done": done, "loss": loss_value, "seconds": seconds()})

    def reached(acc: float) -> bool:
        return cfg.target_accuracy is not None and acc >= cfg.target_accuracy

    bar = tqdm(total=cfg.steps, initial=step, desc=description, disable=not progress or done,
               leave=False, dynamic_ncols=True)
    while not done:
        if step < cfg.steps:
            idx = batch_indices(len(data), cfg.batch_size, step, cfg.seed)
            inputs, labels = data.inputs[idx].to(device), data.labels[idx].to(device)
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr_at(step)
            loss = masked_loss(model, inputs, labels)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss became {loss.item()} at step {step}; lower the learning rate")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            step += 1
            loss_value = loss.item()
            bar.update(1)
        if step % cfg.eval_every == 0 or step >= cfg.steps:
            entry = {"step": step, "loss": loss_value}
            if valid is not None:
                entry["valid_accuracy"] = evaluate(model, valid, cfg.eval_batch_size, device)
            history.append(entry)
            bar.set_postfix({k: round(v, 4) for k, v in entry.items() if k != "step"})
            done = step >= cfg.steps or reached(entry.get("valid_accuracy", 0.0))
            checkpoint()
    bar.close()
    last = history[-1] if history else {}
    return TrainResult(steps=step, stopped_early=step < cfg.steps, valid_accuracy=last.get("valid_accuracy"),
                       loss=loss_value, history=history, seconds=round(seconds(), 2))
