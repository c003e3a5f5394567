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
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..errors import PositionError
from ..heap import RELEASE_EVERY, release_freed_memory
from ..models.io import load, save
from ..models.transformer import MODEL_KINDS, Transformer
from ..runtime.checkpoint import (
    CHECKPOINT,
    check_config,
    load_checkpoint,
    save_checkpoint,
)
from ..runtime.device import autocast, resolve_device
from ..runtime.files import write_json_atomic, write_text_atomic
from ..runtime.folders import replace_folder
from ..runtime.lock import run_lock
from ..runtime.optim import adamw
from ..runtime.rng import rng_state, set_rng_state
from ..text.corpus import Corpus, build_corpus, open_corpus
from ..text.sources import load_documents
from ..text.tokenizer import FILENAME, special_ids
from .config import PretrainConfig
from .data import Batch, Batches
from .objective import objective_for
from .plots import plot_run

RESULT, METRICS, RUN_CONFIG, MODEL = "result.json", "metrics.jsonl", "pretrain.json", "model"
DEFAULT_CORPUS = Path("runs/corpus/default")
SPEED_ONLY = ("data_workers",)  # config keys that change speed, never results: free to change on resume


@dataclass(frozen=True)
class World:
    """This process's place in a (possibly single-process) data-parallel job."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def init_world(device: str) -> tuple[World, torch.device]:
    """Read torchrun's environment; start the process group (NCCL on CUDA, gloo on CPU)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    world = World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", world.local_rank if size > 1 else torch.cuda.current_device())
    if size > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return world, dev


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


@torch.no_grad()
def evaluate(model: Transformer, batches: list[Batch], device: torch.device,
             amp: contextlib.AbstractContextManager | None = None) -> dict[str, float]:
    """Held-out loss per scored token, accuracy, and perplexity (causal LM) over fixed batches."""
    objective = objective_for(model)
    was = model.training
    model.eval()
    loss = correct = count = 0.0
    for batch in batches:
        with amp or contextlib.nullcontext():
            s, c = objective(batch.to(device))
        loss, correct, count = loss + float(s), correct + float(c), count + batch.targets
    model.train(was)
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
    state = load_checkpoint(path, ("config", "model", "step")) if path.exists() else None
    if state is None or state["step"] != cfg.steps:
        raise PositionError(f"{out / MODEL} is missing or damaged and {path} does not hold the final step to "
                            f"rewrite it from; train the run again in a new folder")
    model = build_model(cfg, corpus)
    model.load_state_dict(state["model"])
    save_run_model(model, corpus, out / MODEL)


def _gather_rng(world: World, device: torch.device) -> list[Any]:
    """Every rank's RNG states (dropout streams), gathered on all ranks."""
    mine = rng_state(device)
    if world.size == 1:
        return [mine]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, mine)
    return out


def _set_rng(states: list[Any], world: World, device: torch.device) -> None:
    if len(states) != world.size:
        raise PositionError(f"the checkpoint was written by {len(states)} processes, this run has {world.size}; "
                            f"resume with the same number of processes")
    set_rng_state(states[world.rank], device)


def _rewrite_metrics(path: Path, upto: int) -> list[dict[str, Any]]:
    """Keep the metric lines of steps <= ``upto`` (a killed run may have logged beyond its checkpoint)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] <= upto]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


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
             on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train (or resume, or just report a finished run) into ``out``; returns the result dict.

    ``on_step(step)`` is called after every optimizer step (tests use it to interrupt a run). The
    main process holds ``out``'s lock (:func:`~posattn.runtime.lock.run_lock`) meanwhile: a second
    run on the same folder gets a PositionError naming this process."""
    out = Path(out)
    world, dev = init_world(device)
    with run_lock(out) if world.main else contextlib.nullcontext():
        return _pretrain(cfg, out, world, dev, progress, on_step)


def _pretrain(cfg: PretrainConfig, out: Path, world: World, dev: torch.device, progress: bool,
              on_step: Callable[[int], None] | None) -> dict[str, Any]:
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
                         corpus.vocab_size, cfg.mask_prob)
    valid_data = Batches.evaluation(corpus.splits["valid"], cfg.objective, cfg.length, specials, corpus.vocab_size,
                                    cfg.mask_prob).fixed(cfg.eval_sequences, max(1, min(64, cfg.batch_size)))
    if not valid_data:
        raise PositionError(f"corpus {corpus.folder}: the valid split is too short for one sequence of {cfg.length}")
    model.context(valid_data[0].input_ids[:1].to(dev), None, None, None)  # a length the mechanisms refuse fails here

    optimizer = adamw(model, cfg.lr, cfg.weight_decay, betas=tuple(cfg.betas), eps=cfg.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cfg.lr_factor)
    amp, scaled = autocast(cfg.precision, dev)
    scaler = torch.amp.GradScaler(dev.type, enabled=scaled)
    step, elapsed, tokens_seen, data_seconds = 0, 0.0, 0, 0.0
    path = out / CHECKPOINT
    if path.exists():
        state = load_checkpoint(path, ("config", "corpus", "model", "optimizer", "scheduler", "scaler", "rng", "step"))
        check_config({**state["config"], "corpus_fingerprint": state["corpus"]},
                     {**cfg.to_dict(), "corpus_fingerprint": corpus.fingerprint}, path, ignore=SPEED_ONLY)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        _set_rng(state["rng"], world, dev)
        step, elapsed = state["step"], state["elapsed"]
        tokens_seen, data_seconds = state["tokens"], state["data_seconds"]
    else:
        torch.manual_seed(cfg.seed * 7919 + world.rank)  # dropout stream of this rank
    resumed_at = step
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / RUN_CONFIG, {**cfg.to_dict(), "corpus_folder": str(corpus.folder),
                                             "corpus_fingerprint": corpus.fingerprint,
                                             "parameters": sum(p.numel() for p in model.parameters())}, indent=2)
        history = _rewrite_metrics(out / METRICS, step)
    trainer: nn.Module = objective
    if world.size > 1:
        trainer = nn.parallel.DistributedDataParallel(objective, device_ids=[dev.index] if dev.type == "cuda" else None,
                                                      find_unused_parameters=True)

    def checkpoint() -> None:
        rng = _gather_rng(world, dev)
        if world.main:
            save_checkpoint(path, {"config": cfg.to_dict(), "corpus": corpus.fingerprint, "model": model.state_dict(),
                                   "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                   "scaler": scaler.state_dict(), "rng": rng, "step": step, "elapsed": elapsed,
                                   "tokens": tokens_seen, "data_seconds": data_seconds})
            save_run_model(model, corpus, out / MODEL)
        world.barrier()

    def log(row: dict[str, Any]) -> None:
        if world.main:
            history.append(row)
            with open(out / METRICS, "a") as f:
                f.write(json.dumps(row) + "\n")

    stream = prefetch(train_data, step, cfg.steps, world, cfg.data_workers if cfg.data_workers is not None
                      else (2 if dev.type == "cuda" else 0))
    bar = tqdm(total=cfg.steps, initial=step, desc=f"pretrain {cfg.name}", disable=not (progress and world.main),
               dynamic_ncols=True)
    window_loss = window_count = window_tokens = 0.0
    first = True
    window_start = time.perf_counter()
    model.train()
    while step < cfg.steps:
        t0 = time.perf_counter()
        mine, total = next(stream)
        if not first:  # the first fetch of a (re)started loop includes the workers' start-up
            data_seconds += time.perf_counter() - t0
        first = False
        loss_sum = torch.zeros(2, device=dev)  # scored-token loss, real tokens
        for micro in range(cfg.grad_accum):
            part = mine.shard(micro, cfg.grad_accum).to(dev)
            sync = micro == cfg.grad_accum - 1 or world.size == 1
            with (contextlib.nullcontext() if sync else trainer.no_sync()), amp:
                s, _ = trainer(part)
            scaler.scale(s * (world.size / total)).backward()
            loss_sum[0] += s.detach()
        loss_sum[1] = float(mine.attention_mask.sum())
        if world.size > 1:
            dist.all_reduce(loss_sum)
        loss, real = float(loss_sum[0]) / total, int(loss_sum[1])
        if not math.isfinite(loss):
            raise PositionError(f"pretrain {cfg.name}: the loss became {loss} at step {step}; lower lr "
                                f"(now {cfg.lr}) or use fp32")
        scaler.unscale_(optimizer)
        if cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        tokens_seen += real
        elapsed += time.perf_counter() - t0
        window_loss, window_count, window_tokens = window_loss + loss, window_count + 1, window_tokens + real
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            speed = window_tokens / max(1e-9, time.perf_counter() - window_start)
            row = {"step": step, "loss": window_loss / window_count, "lr": scheduler.get_last_lr()[0],
                   "tokens_per_s": speed, "tokens": tokens_seen, "elapsed_s": elapsed}
            log(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{speed:,.0f}")
            window_loss = window_count = window_tokens = 0.0
        if step % cfg.eval_every == 0 or step == cfg.steps:
            if world.main:
                log({"step": step, **evaluate(model, valid_data, dev, amp)})
            world.barrier()
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            checkpoint()
        if step % RELEASE_EVERY == 0:
            release_freed_memory()  # without it the heap fragments to gigabytes (posattn.heap)
        if on_step is not None:
            on_step(step)
        window_start = window_start if window_count else time.perf_counter()
    bar.close()
    if world.main and step == resumed_at:  # resumed at its last step: model/ may be stale or damaged
        save_run_model(model, corpus, out / MODEL)
    result = {"name": cfg.name, "objective": cfg.objective, "mechanisms": cfg.mechanisms, "steps": step,
              "tokens": tokens_seen, "train_seconds": elapsed, "tokens_per_s": tokens_seen / max(elapsed, 1e-9),
              "data_fraction": data_seconds / max(elapsed, 1e-9),
              "parameters": sum(p.numel() for p in model.parameters()), "processes": world.size,
              "device": str(dev)}
    if world.main:
        evals = [r for r in history if "valid_loss" in r]
        result.update({k: v for k, v in evals[-1].items() if k != "step"})
        plot_run(history, out / "loss.png", cfg.name)
        write_json_atomic(out / RESULT, result, indent=2)
    if world.size > 1:  # every rank returns rank 0's result (with the held-out metrics)
        shared = [result]
        dist.broadcast_object_list(shared, src=0)
        result = shared[0]
    return result
