"""``posattn pretrain``: masked-LM encoders and causal-LM decoders on a tokenised corpus.

One run writes to its folder::

    pretrain.json       the resolved :class:`~.config.PretrainConfig` and the corpus it read
    checkpoint.pt       model, optimizer, scheduler, grad scaler, step, RNG state of every rank
    model/              the latest weights as a posattn checkpoint + tokenizer.json (for finetuning)
    metrics.jsonl       one line per log interval (loss, lr, tokens/s) and per evaluation
    loss.png            training and held-out loss curves
    result.json         written when the run is finished: final held-out metrics, speed, time

The loop is deterministic: the batch of a step is a function of (seed, step) alone
(:mod:`.data`), and a checkpoint holds everything else, so killing a run at any moment and
running the same command again continues it and ends with the weights of an uninterrupted run.
Under ``torchrun`` it runs DistributedDataParallel (gloo on CPU, NCCL on GPU): each rank takes
its slice of every global batch, and only rank 0 writes.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PositionError
from ..models.io import load, save
from ..models.transformer import MODEL_KINDS, Transformer
from ..runtime.checkpoint import (
    CHECKPOINT,
    check_config,
    load_checkpoint,
)
from ..runtime.compile import check_mode, compiled
from ..runtime.device import autocast, inference
from ..runtime.files import write_json_atomic
from ..runtime.folders import replace_folder
from ..runtime.lock import run_lock
from ..runtime.loop import Plan, run_loop
from ..runtime.metrics import MetricsLog
from ..runtime.optim import adamw
from ..runtime.world import World, init_world
from ..text.corpus import Corpus, build_corpus, open_corpus
from ..text.sources import load_documents
from ..text.tokenizer import FILENAME, special_ids
from .config import PretrainConfig
from .data import Batch, Batches
from .objective import objective_for
from .plots import plot_run

RESULT, RUN_CONFIG, MODEL = "result.json", "pretrain.json", "model"
DEFAULT_CORPUS = Path("runs/corpus/default")
SPEED_ONLY = ("data_workers",)  # config keys that change speed, never results: free to change on resume


def resolve_corpus(name: str, world: World) -> Corpus:
    """Open the corpus folder; ``default`` is built from the offline sources on first use (by rank 0)."""
    if name != "default":
        return open_corpus(name)
    if world.main and not (DEFAULT_CORPUS / "meta.json").exists():
        print(f"building the default corpus in {DEFAULT_CORPUS} (BBC news + Shakespeare, WordPiece 8192) ...")
        build_corpus(load_documents(), DEFAULT_CORPUS, description="default: bbc + shakespeare")
    world.barrier()
    return open_corpus(DEFAULT_CORPUS)




def build_model(cfg: PretrainConfig, corpus: Corpus) -> Transformer:
    """A fresh model (seeded by ``cfg.seed``) sized by the preset, with the corpus's vocabulary."""
    torch.manual_seed(cfg.seed)
    return MODEL_KINDS[cfg.kind](cfg.model_config(corpus.vocab_size))


def evaluate(model: Transformer, batches: list[Batch], device: torch.device,
             amp: contextlib.AbstractContextManager | None = None) -> dict[str, float]:
    """Held-out loss per scored token, accuracy, and perplexity (causal LM) over fixed batches
    (:func:`~posattn.runtime.device.inference`: eval mode, no autograd, subnormals flushed on the CPU)."""
    objective = objective_for(model)
    loss = correct = count = 0.0
    with inference(model, device):
        for batch in batches:
            with amp or contextlib.nullcontext():
                s, c = objective(batch.to(device))
            loss, correct, count = loss + float(s), correct + float(c), count + batch.targets
    out = {"valid_loss": loss / count, "valid_accuracy": correct / count}
    if not isinstance(model, MODEL_KINDS["encoder"]):
        out["valid_perplexity"] = math.exp(min(out["valid_loss"], 50.0))
    return out






def save_run_model(model: Transformer, corpus: Corpus, folder: Path) -> None:
    """A run's ``model/`` (weights, config and the corpus's tokenizer.json, what ``posattn finetune``
    reads), written whole: a crash mid-save leaves the previous folder, never half of one."""
    def fill(tmp: Path) -> None:
        save(model, tmp)
        corpus.tokenizer.save(str(tmp / FILENAME))

    replace_folder(folder, fill)


def model_intact(folder: Path) -> bool:
    """True if ``folder`` holds a model that loads (config, every weight) and its tokenizer."""
    try:
        load(folder)
    except Exception:  # noqa: BLE001 - a damaged file fails in json, safetensors or torch
        return False
    return (folder / FILENAME).is_file()


def restore_model(cfg: PretrainConfig, out: Path, corpus: Corpus) -> None:
    """Rewrite a finished run's missing or damaged ``model/`` from its final checkpoint, or refuse."""
    path = out / CHECKPOINT
    state = load_checkpoint(path, ("config", "model", "loop")) if path.exists() else None
    if state is None or state["loop"]["step"] != cfg.steps:
        raise PositionError(f"{out / MODEL} is missing or damaged and {path} does not hold the final step to "
                            f"rewrite it from; train the run again in a new folder")
    model = build_model(cfg, corpus)
    model.load_state_dict(state["model"])
    save_run_model(model, corpus, out / MODEL)


class _Steps(torch.utils.data.Dataset):
    """Map-style view of the steps ``start`` … ``stop`` − 1: item i is this rank's batch of step start + i."""

    def __init__(self, data: Batches, start: int, stop: int, world: World) -> None:
        self.data, self.start, self.stop, self.world = data, start, stop, world

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> tuple[Batch, int]:
        return self.data.batch(self.start + i, self.world.rank, self.world.size)


def prefetch(data: Batches, start: int, stop: int, world: World, workers: int) -> Iterator[tuple[Batch, int]]:
    """This rank's batches of steps ``start`` … in order, built by ``workers`` background processes
    (0: in this process). Batches are pure functions of the step, so workers change nothing but speed."""
    if workers == 0:
        return (data.batch(s, world.rank, world.size) for s in range(start, stop))
    return iter(torch.utils.data.DataLoader(_Steps(data, start, stop, world), batch_size=None, num_workers=workers,
                                            prefetch_factor=4, persistent_workers=False))


def pretrain(cfg: PretrainConfig, out: str | Path, *, device: str = "auto", progress: bool = True,
             on_step: Callable[[int], None] | None = None, log_to: tuple[str, ...] = (),
             compile: str | None = None) -> dict[str, Any]:
    """Train (or resume, or just report a finished run) into ``out``; returns the result dict.

    ``on_step(step)`` is called after every optimizer step (tests use it to interrupt a run).
    ``log_to``: mirrors of ``metrics.jsonl`` (:mod:`posattn.runtime.metrics`, e.g. ``("tensorboard",)``).
    ``compile``: a :mod:`posattn.runtime.compile` mode for the training step (evaluation stays eager). The
    main process holds ``out``'s lock (:func:`~posattn.runtime.lock.run_lock`) meanwhile: a second
    run on the same folder gets a PositionError naming this process."""
    out, compile = Path(out), check_mode(compile)
    world, dev = init_world(device)
    with run_lock(out) if world.main else contextlib.nullcontext():
        return _pretrain(cfg, out, world, dev, progress, on_step, log_to, compile)


def _pretrain(cfg: PretrainConfig, out: Path, world: World, dev: torch.device, progress: bool,
              on_step: Callable[[int], None] | None, log_to: tuple[str, ...], compile: str | None) -> dict[str, Any]:
    """:func:`pretrain` in its process group, with the run folder locked."""
    if (out / RESULT).exists():
        written, current = json.loads((out / RUN_CONFIG).read_text()), cfg.to_dict()
        check_config({k: written.get(k) for k in current}, current, out / RUN_CONFIG, ignore=SPEED_ONLY)
        if world.main and not model_intact(out / MODEL):
            restore_model(cfg, out, open_corpus(written["corpus_folder"]))
        return json.loads((out / RESULT).read_text())
    corpus = resolve_corpus(cfg.corpus, world)
    specials = special_ids(corpus.tokenizer, str(corpus.folder))
    per_rank, rem = divmod(cfg.batch_size, world.size * cfg.grad_accum)
    if rem or per_rank == 0:
        raise PositionError(f"batch_size {cfg.batch_size} must be a multiple of processes × grad_accum = "
                            f"{world.size} × {cfg.grad_accum}")
    model = build_model(cfg, corpus).to(dev)
    objective = objective_for(model)
    train_data = Batches(corpus.splits["train"], cfg.objective, cfg.length, cfg.batch_size, cfg.seed, specials,
                         corpus.vocab_size, cfg.mask_prob, cfg.pack_documents)
    valid_data = Batches.evaluation(corpus.splits["valid"], cfg.objective, cfg.length, specials, corpus.vocab_size,
                                    cfg.mask_prob, cfg.pack_documents).fixed(cfg.eval_sequences,
                                                                             max(1, min(64, cfg.batch_size)))
    if not valid_data:
        raise PositionError(f"corpus {corpus.folder}: the valid split is too short for one sequence of {cfg.length}")
    model.context(valid_data[0].input_ids[:1].to(dev), None, None, None)  # a length the mechanisms refuse fails here

    optimizer = adamw(model, cfg.lr, cfg.weight_decay, betas=tuple(cfg.betas), eps=cfg.eps)
    amp, scaled = autocast(cfg.precision, dev)
    log = MetricsLog(out if world.main else None, log_to if world.main else ())
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / RUN_CONFIG, {**cfg.to_dict(), "corpus_folder": str(corpus.folder),
                                             "corpus_fingerprint": corpus.fingerprint,
                                             "parameters": sum(p.numel() for p in model.parameters())}, indent=2)
    trainer: nn.Module = objective
    if world.size > 1:
        trainer = nn.parallel.DistributedDataParallel(objective, device_ids=[dev.index] if dev.type == "cuda" else None,
                                                      find_unused_parameters=True)
    trainer = compiled(trainer, compile)
    workers = cfg.data_workers if cfg.data_workers is not None else (2 if dev.type == "cuda" else 0)
    stream: Iterator[tuple[Batch, int]] | None = None

    def step_fn(step: int, backward: Callable[[torch.Tensor], None]) -> tuple[float, dict[str, float]]:
        nonlocal stream
        first, t0 = stream is None, time.perf_counter()
        if stream is None:  # from the (resumed) step on
            stream = prefetch(train_data, step, cfg.steps, world, workers)
        mine, total = next(stream)
        waited = 0.0 if first else time.perf_counter() - t0  # the first fetch includes the workers' start-up
        loss_sum = torch.zeros(2, device=dev)  # scored-token loss, real tokens
        for micro in range(cfg.grad_accum):
            part = mine.shard(micro, cfg.grad_accum).to(dev)
            sync = micro == cfg.grad_accum - 1 or world.size == 1
            with (contextlib.nullcontext() if sync else trainer.no_sync()), amp:
                s, _ = trainer(part)
            backward(s * (world.size / total))
            loss_sum[0] += s.detach()
        loss_sum[1] = float(mine.attention_mask.sum())
        if world.size > 1:
            dist.all_reduce(loss_sum)
        return float(loss_sum[0]) / total, {"tokens": int(loss_sum[1]), "data_seconds": waited}

    plan = Plan(steps=cfg.steps, lr=lambda step: cfg.lr * cfg.lr_factor(step), eval_every=cfg.eval_every,
                grad_clip=cfg.grad_clip, seed=cfg.seed * 7919 + world.rank, checkpoint_every=cfg.checkpoint_every,
                log_every=cfg.log_every, loss_scaling=scaled, description=f"pretrain {cfg.name}")
    state = run_loop(model, optimizer, plan, step_fn, lambda state: evaluate(model, valid_data, dev, amp), device=dev,
                     folder=out, config={**cfg.to_dict(), "corpus_fingerprint": corpus.fingerprint},
                     ignore=SPEED_ONLY, world=world, log=log, progress=progress,
                     on_checkpoint=lambda: save_run_model(model, corpus, out / MODEL), on_step=on_step)
    log.close()
    if world.main and state.step == state.resumed_at:  # resumed at its last step: model/ may be stale or damaged
        save_run_model(model, corpus, out / MODEL)
    elapsed, tokens = state.train_seconds, state.counters.get("tokens", 0)
    result = {"name": cfg.name, "objective": cfg.objective, "mechanisms": cfg.mechanisms, "steps": state.step,
              "tokens": tokens, "train_seconds": elapsed, "tokens_per_s": tokens / max(elapsed, 1e-9),
              "data_fraction": state.counters.get("data_seconds", 0.0) / max(elapsed, 1e-9),
              "parameters": sum(p.numel() for p in model.parameters()), "processes": world.size,
              "device": str(dev)}
    if world.main:
        result.update({k: v for k, v in state.history[-1].items() if k != "step"})
        plot_run(log.rows, out / "loss.png", cfg.name)
        write_json_atomic(out / RESULT, result, indent=2)
    if world.size > 1:  # every rank returns rank 0's result (with the held-out metrics)
        shared = [result]
        dist.broadcast_object_list(shared, src=0)
        result = shared[0]
    return result
