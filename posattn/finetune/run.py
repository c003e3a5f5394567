"""Fine-tuning one pretrained encoder on one task with one seed (a *cell*), resumably.

The loop follows Chang et al. 2021, Table 5: AdamW (β = 0.9/0.999, ε = 1e-6), learning rate
warmed up linearly over the first 10% of steps then decayed linearly to 0, dropout 0.1, a fresh
[CLS] pooler + classifier on the pretrained encoder (cross-entropy; mean squared error with one
output for regression). The validation split is scored ``evals_per_epoch`` times per epoch; the
best-scoring weights are kept (early stopping: with ``patience`` the run also stops after that
many evaluations without improvement) and scored on the test set(s).

As in every posattn training loop (:mod:`posattn.runtime.loop`), the batch order depends on the seed and the step alone,
and a checkpoint (model, optimizer, RNG state, best weights, history) is written atomically at
every evaluation, so a resumed run ends with the same weights as an uninterrupted one.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from .. import schedule
from ..errors import PositionError
from ..experiments.store import content_id
from ..models import build_model, save
from ..models.io import CONFIG, WEIGHTS, check_weights, read_config, unreadable_weights
from ..models.transformer import Encoder
from ..runtime.checkpoint import CHECKPOINT
from ..runtime.compile import compiled
from ..runtime.device import inference, resolve_device
from ..runtime.files import write_json_atomic
from ..runtime.lock import run_lock
from ..runtime.loop import LoopState, Plan, run_loop
from ..runtime.optim import adamw
from ..runtime.order import batch_indices
from ..text.tokenizer import FILENAME as TOKENIZER
from ..text.tokenizer import load_tokenizer
from . import metrics
from .batches import Encoded, encode_examples, eval_batches, padded_tokens
from .glue import load_glue
from .offline import load_offline
from .tasks import GLUE, TASKS, Task, TaskData, TaskError

MODEL_DIR = "model"


@dataclass(frozen=True)
class FinetuneConfig:
    """Optimisation settings of one fine-tuning run (defaults: Chang Table 5, 'otherwise' column)."""

    lr: float = 3e-4
    batch_size: int = 32
    epochs: float = 3
    warmup: float = 0.1
    weight_decay: float = 0.0
    adam_eps: float = 1e-6
    dropout: float = 0.1
    grad_clip: float = 1.0
    evals_per_epoch: int = 1
    patience: int | None = None
    eval_batch_size: int = 128
    seed: int = 0

    def total_steps(self, n: int) -> int:
        return max(1, math.ceil(self.epochs * n / self.batch_size))

    def eval_every(self, n: int) -> int:
        return max(1, math.ceil(n / self.batch_size / self.evals_per_epoch))

    def lr_at(self, step: int, total: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): linear warmup, then linear decay to 0."""
        return self.lr * schedule.lr_factor(step, total, schedule.warmup_steps(self.warmup, total))


def find_checkpoint(path: str | Path) -> Path:
    """The model folder of ``path``: a folder with config.json, or a ``posattn pretrain`` run folder (``model/``)."""
    path = Path(path)
    for folder in (path, path / MODEL_DIR):
        if (folder / CONFIG).is_file():
            return folder
    raise PositionError(f"{path}: not a posattn checkpoint (no {CONFIG} here or in {path / MODEL_DIR})")


def fingerprint(folder: Path) -> str:
    """SHA-1 of a checkpoint's config and weights: cells are keyed by content, not by path."""
    h = hashlib.sha1()
    for name in (CONFIG, WEIGHTS):
        with (folder / name).open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def tokenizer_path(folder: Path) -> Path:
    """``tokenizer.json`` beside the weights, or in the run folder above them."""
    for candidate in (folder / TOKENIZER, folder.parent / TOKENIZER):
        if candidate.is_file():
            return candidate
    raise PositionError(f"{folder}: no {TOKENIZER} in this folder or its parent; fine-tuning needs the "
                        f"tokenizer the model was pretrained with")


def check_encoder(folder: Path) -> dict[str, Any]:
    """The checkpoint's config; PositionError unless it is an encoder (the only classification-capable kind)."""
    cfg = read_config(folder)
    if cfg.get("kind") != "encoder":
        raise PositionError(f"{folder}: a {cfg.get('kind')!r} checkpoint is not classification-capable; "
                            f"fine-tuning needs an encoder ([CLS] pooling, segment ids)")
    check_weights(folder / WEIGHTS)
    return cfg


def build_classifier(folder: Path, task: Task, dropout: float, init: Path | None = None) -> Encoder:
    """The pretrained encoder of ``folder`` with a fresh pooler and classifier for ``task``.

    ``init``: a fine-tuned model folder whose encoder (and pooler) start this one instead
    (intermediate-task training); its classifier is never reused."""
    cfg = check_encoder(folder)
    model = build_model({**cfg, "n_classes": task.n_outputs, "dropout": dropout})
    source = (init or folder) / WEIGHTS
    try:
        saved = load_file(str(source))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a damaged file
        raise unreadable_weights(source, e) from None
    weights = {k: v for k, v in saved.items() if not k.startswith("classifier.")}
    own = model.state_dict()
    mismatched = [k for k, v in weights.items() if k in own and own[k].shape != v.shape]
    missing, unexpected = model.load_state_dict({k: v for k, v in weights.items() if k not in mismatched}, strict=False)
    loaded = {own[k].data_ptr() for k in weights if k in own}        # shared tensors are stored once
    missing = [k for k in missing if own[k].data_ptr() not in loaded and not k.startswith(("pooler.", "classifier."))]
    if missing or unexpected or mismatched:
        raise PositionError(f"{init or folder}: weights do not match {folder / CONFIG} (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}, wrong shape {mismatched[:3]})")
    return model  # type: ignore[return-value]


def loss_fn(task: Task, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if task.regression:
        return nn.functional.mse_loss(out[:, 0].float(), labels)
    return nn.functional.cross_entropy(out.float(), labels)


def predict(model: Encoder, task: Task, data: Encoded, batch_size: int, sort: bool = True) -> np.ndarray:
    """Predictions (class ids, or scores for regression) of every example, batches sorted by length
    (:func:`~posattn.runtime.device.inference`: eval mode, no autograd, subnormals flushed on the CPU)."""
    device = next(model.parameters()).device
    out = np.zeros(len(data), dtype=np.float64 if task.regression else np.int64)
    with inference(model, device):
        for index in eval_batches(data.lengths(), batch_size, sort):
            ids, seg, mask, _ = data.batch(index, device)
            logits = model.classify(ids, seg, mask)
            out[index] = (logits[:, 0] if task.regression else logits.argmax(-1)).cpu().numpy()
    return out


def score(model: Encoder, task: Task, data: Encoded, batch_size: int) -> dict[str, float]:
    """The task's metrics and score on ``data``."""
    return metrics.compute(task.metrics, predict(model, task, data, batch_size), data.labels.numpy())


def eval_cost(model: Encoder, task: Task, data: Encoded, batch_size: int) -> dict[str, float]:
    """Token positions computed and seconds taken by one evaluation pass, batches sorted by length
    vs in file order (measured back to back on the same model)."""
    out: dict[str, float] = {"real_tokens": sum(data.lengths())}
    for name, sort in (("sorted", True), ("unsorted", False)):
        start = time.perf_counter()
        predict(model, task, data, batch_size, sort)
        out[f"{name}_seconds"] = time.perf_counter() - start
        out[f"{name}_tokens"] = padded_tokens(data.lengths(), eval_batches(data.lengths(), batch_size, sort))
    return out


def baseline(task: Task, train: Encoded, test: Encoded) -> dict[str, float]:
    """Scores of a constant prediction: the majority training class (regression: the training mean)."""
    guess = float(train.labels.mean()) if task.regression else int(train.labels.bincount().argmax())
    return metrics.compute(task.metrics, np.full(len(test), guess), test.labels.numpy())


def finetune(model: Encoder, task: Task, train: Encoded, valid: Encoded, cfg: FinetuneConfig, *,
             checkpoint_dir: Path | None = None, device: str | torch.device = "auto", progress: bool = True,
             description: str = "finetune", compile: str | None = None) -> dict[str, Any]:
    """Fine-tune ``model`` on ``train``, keep the weights that score best on ``valid``; resumable.

    Returns steps, best step and score, the validation history, and ``earlier_seconds``: the (wall,
    CPU) seconds of the interrupted runs this one resumed, up to their last checkpoint. The
    ``checkpoint_dir`` is locked meanwhile (:func:`~posattn.runtime.lock.run_lock`). ``compile``: a
    :mod:`posattn.runtime.compile` mode for the training step (scoring stays eager). The loop is
    :func:`posattn.runtime.loop.run_loop`."""
    device = resolve_device(device)
    model.to(device)
    optimizer = adamw(model, cfg.lr, cfg.weight_decay, eps=cfg.adam_eps)
    total = cfg.total_steps(len(train))
    loss_of = compiled(lambda ids, seg, mask, labels: loss_fn(task, model.classify(ids, seg, mask), labels), compile)

    def step_fn(step: int, backward: Callable[[torch.Tensor], None]) -> tuple[float, dict[str, float]]:
        ids, seg, mask, labels = train.batch(batch_indices(len(train), cfg.batch_size, step, cfg.seed), device)
        loss = loss_of(ids, seg, mask, labels)
        backward(loss)
        return loss.item(), {}

    def evaluation(state: LoopState) -> dict[str, float]:
        return {"loss": state.loss, "valid_score": score(model, task, valid, cfg.eval_batch_size)["score"]}

    plan = Plan(steps=total, lr=lambda step: cfg.lr_at(step, total), eval_every=cfg.eval_every(len(train)),
                grad_clip=cfg.grad_clip, seed=cfg.seed, keep_best="valid_score", patience=cfg.patience,
                description=description)
    state = run_loop(model, optimizer, plan, step_fn, evaluation, device=device, config=asdict(cfg),
                     folder=checkpoint_dir, progress=progress)
    return {"steps": state.step, "total_steps": total, "stopped_early": state.step < total,
            "best_step": state.best_step, "valid_score": state.best_score, "history": state.history,
            "earlier_seconds": state.earlier}


@dataclass(frozen=True)
class Cell:
    """One fine-tuning run: a checkpoint, a task, a seed and everything else that determines its result."""

    label: str
    checkpoint: str
    fingerprint: str
    task: str
    seed: int
    training: dict[str, Any]
    max_train: int | None
    max_eval: int | None
    max_seq_len: int
    glue_dir: str | None
    init_from: str | None = None          # id of the intermediate-task cell whose model starts this one

    @property
    def id(self) -> str:
        """Stable short hash of what determines the result (the checkpoint by content, not path)."""
        key = {k: v for k, v in asdict(self).items() if k not in ("label", "checkpoint")}
        return content_id(key)


@lru_cache(maxsize=32)
def task_data(task: str, glue_dir: str | None, max_train: int | None, max_eval: int | None) -> TaskData:
    """A task's splits (cached: every checkpoint and seed of a sweep shares them)."""
    if task in GLUE:
        if glue_dir is None:
            raise TaskError(f"task {task} is a GLUE task: give --glue-dir (the folder of the official download)")
        return load_glue(task, glue_dir, max_train, max_eval)
    return load_offline(task, max_train, max_eval)


@lru_cache(maxsize=64)
def encoded(tokenizer: str, task: str, glue_dir: str | None, max_train: int | None, max_eval: int | None,
            max_len: int) -> dict[str, Encoded]:
    """Every split of a task tokenised with one tokenizer (cached per process)."""
    data, tok = task_data(task, glue_dir, max_train, max_eval), load_tokenizer(tokenizer)
    sets = {"train": data.train, "valid": data.valid, **{f"test:{k}": v for k, v in data.test.items()}}
    return {k: encode_examples(tok, data.task, v, max_len) for k, v in sets.items()}


def finished_cell(cell: Cell, store: Path) -> dict | None:
    """The result of ``cell`` if it has finished, under this sweep's label and path (the id keys the
    checkpoint by content, so another sweep may have trained it), else None."""
    path = store / cell.id / "result.json"
    if not path.exists():
        return None
    return {**json.loads(path.read_text()), "label": cell.label, "checkpoint": cell.checkpoint}


def run_cell(cell: Cell, store: Path, device: str = "auto", progress: bool = True, keep_model: bool = False,
             compile: str | None = None) -> dict:
    """Fine-tune (or resume) one cell in ``store/<id>`` and score it; a finished cell's result is read
    back, never re-run.

    ``keep_model``: also save the fine-tuned model (an intermediate task's model starts other cells).
    The cell's folder is locked meanwhile (:func:`~posattn.runtime.lock.run_lock`)."""
    with run_lock(store / cell.id):
        return _run_cell(cell, store, device, progress, keep_model, compile)


def _run_cell(cell: Cell, store: Path, device: str, progress: bool, keep_model: bool, compile: str | None) -> dict:
    """:func:`run_cell` with the cell's folder locked."""
    folder = store / cell.id
    result_path, model_dir = folder / "result.json", folder / MODEL_DIR
    done = finished_cell(cell, store)
    if done is not None and (not keep_model or (model_dir / WEIGHTS).exists()):
        return done
    task, checkpoint = TASKS[cell.task], Path(cell.checkpoint)
    data = task_data(cell.task, cell.glue_dir, cell.max_train, cell.max_eval)
    sets = encoded(str(tokenizer_path(checkpoint)), cell.task, cell.glue_dir, cell.max_train, cell.max_eval,
                   cell.max_seq_len)
    cfg = FinetuneConfig(**cell.training)
    init = store / cell.init_from / MODEL_DIR if cell.init_from else None
    torch.manual_seed(cfg.seed)
    model = build_classifier(checkpoint, task, cfg.dropout, init)
    folder.mkdir(parents=True, exist_ok=True)
    start, cpu = time.perf_counter(), time.process_time()
    result: dict[str, Any] = {"id": cell.id, **asdict(cell), "parameters": sum(p.numel() for p in model.parameters()),
                              "sizes": data.sizes(), "notes": list(data.notes),
                              "truncated": {k: v.truncated for k, v in sets.items()}}
    try:
        outcome = finetune(model, task, sets["train"], sets["valid"], cfg, checkpoint_dir=folder, device=device,
                           progress=progress, compile=compile, description=f"{cell.label} {cell.task} seed {cell.seed}")
    except FloatingPointError as e:
        result.update(diverged=str(e), scores=None)
    else:
        tests = {k.removeprefix("test:"): v for k, v in sets.items() if k.startswith("test:")}
        result.update(outcome, scores={k: score(model, task, v, cfg.eval_batch_size) for k, v in tests.items()},
                      baseline={k: baseline(task, sets["train"], v) for k, v in tests.items()})
        if cell.seed == 0:      # the sorted-vs-file-order timing costs two more test passes: once per task is enough
            result["eval_cost"] = {k: eval_cost(model, task, v, cfg.eval_batch_size) for k, v in tests.items()}
    # this process plus the interrupted parts before it; CPU time = wall time on an idle core, single-threaded
    earlier = result.pop("earlier_seconds", (0.0, 0.0))
    result["train_seconds"] = round(earlier[0] + time.perf_counter() - start, 2)
    result["cpu_seconds"] = round(earlier[1] + time.process_time() - cpu, 2)
    if keep_model and "diverged" not in result:
        save(model, model_dir)
    write_json_atomic(result_path, result)
    (folder / CHECKPOINT).unlink(missing_ok=True)
    return result
