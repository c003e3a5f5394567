"""``posattn eval-lm``: held-out perplexity (decoders) or masked-LM loss (encoders) against context length.

Every model reads the same first ``tokens`` held-out tokens of its corpus, cut into windows of
each evaluation length (1x-8x the training length by default); the score at a length is the mean
cross-entropy per scored token over those windows, and perplexity its exponential. A mechanism
that cannot run a length (e.g. ``absolute`` beyond its learned positions) gets no value there and
the reason is recorded. ``rope_scaling`` adds a row for every model with a mechanism that
rescales for longer inputs (:meth:`~posattn.mechanisms.base.Mechanism.length_scaled`), extended at
evaluation time: for ``rope`` (and xPos) position interpolation (``linear``), NTK-aware (``ntk``),
dynamic NTK (``dynamic``), YaRN (``yarn``), Llama 3.1's (``llama3``) or LongRoPE (``longrope``,
with the short and long factors the model's rope options give), as CAT does for PI and YaRN:
factor ``length / training length`` at each longer length unless a fixed ``factor`` is given.
``dynamic`` also adapts its base to each length by itself (transformers' usage: a fixed
``factor``, e.g. 2); ``longrope`` switches to its long factors beyond the training length.

Each length's windows are also scored in :data:`BLOCKS` consecutive blocks of text
(``block_losses``): the same blocks for every model, so that two models' difference at a length
has a standard error (:mod:`posattn.pretrain.report` judges the papers' claims with it). Every row
records the settings that made it (tokens, fixed factor, device, the pretraining run it scores), so
that an output folder can enter the results store (``posattn results add``) and ``posattn report``
rebuilds the table and plot from there.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import PositionError
from ..mechanisms import length_scalings, with_length_scaling
from ..models.io import WEIGHTS, load_weights, read_config
from ..models.transformer import Transformer, build_model
from ..runtime.device import resolve_device
from ..runtime.files import write_json_atomic, write_text_atomic
from ..text.corpus import Corpus, open_corpus
from ..text.tokenizer import FILENAME, load_tokenizer, special_ids
from .data import Batches
from .plots import plot_lengths
from .run import RUN_CONFIG, evaluate

SCALINGS = length_scalings()  # what the registered mechanisms offer (rope: linear, ntk, dynamic, yarn, …)
SCORE_BUDGET = 2 ** 24  # batch · length² per evaluation batch
BLOCKS = 8  # blocks of text per length whose losses are kept (a standard error for comparisons)
LENGTHS = "lengths.json"  # an eval-lm output folder's rows


@dataclass
class Subject:
    """One model to evaluate: its label, checkpoint folder, config and corpus; ``run``: the name of
    the pretraining run it comes from (``recipe/label``), where its folder records one."""

    label: str
    folder: Path
    config: dict[str, Any]
    corpus: Corpus
    run: str | None = None


def subject(path: str | Path, corpus: str | Path | None = None, label: str | None = None) -> Subject:
    """A pretraining run folder (its ``model/`` and corpus are used) or a model folder plus ``corpus``."""
    path = Path(path)
    run_config = path / RUN_CONFIG
    folder = path / "model" if (path / "model").is_dir() else path
    config = read_config(folder)
    recorded = json.loads(run_config.read_text()) if folder != path and run_config.exists() else None
    if corpus is None:
        if recorded is None:
            raise PositionError(f"{path}: a model folder needs --corpus (a run folder records its own)")
        corpus = recorded["corpus_folder"]
    opened = open_corpus(corpus)
    if (folder / FILENAME).exists():
        mine = load_tokenizer(folder)
        if mine.get_vocab() != opened.tokenizer.get_vocab():
            raise PositionError(f"{folder}: its tokenizer differs from the corpus {opened.folder}'s "
                                f"({mine.get_vocab_size()} vs {opened.vocab_size} entries); evaluate on a corpus "
                                f"built with its tokenizer (posattn corpus --tokenizer {folder / FILENAME})")
    if config["vocab_size"] != opened.vocab_size:
        raise PositionError(f"{folder}: the model's vocabulary ({config['vocab_size']}) does not match the corpus "
                            f"{opened.folder} ({opened.vocab_size})")
    name = label or (path.parent.name if folder.name == "model" and folder == path else path.name)
    return Subject(name, folder, config, opened, None if recorded is None else str(recorded.get("name")))


def length_scaled_config(config: dict[str, Any], scaling: str, factor: float) -> dict[str, Any] | None:
    """The config with every mechanism that rescales for longer inputs (rope) rescaled by
    ``scaling`` and ``factor`` from the trained length ``max_len``, or None if none can
    (:func:`posattn.mechanisms.with_length_scaling`)."""
    specs = with_length_scaling(config["mechanisms"], scaling, factor, config["max_len"])
    if specs is None:
        return None
    return {**config, "mechanisms": [s.to_json() for s in specs]}


def _model(config: dict[str, Any], folder: Path, device: torch.device) -> Transformer:
    model = build_model(config)
    load_weights(model, folder / WEIGHTS)
    return model.to(device).eval()


def score(model: Transformer, corpus: Corpus, length: int, tokens: int, device: torch.device) -> dict[str, Any]:
    """Mean held-out loss per scored token (and perplexity) over ``tokens`` tokens in windows of
    ``length``, and the loss of each of up to :data:`BLOCKS` consecutive blocks of those windows."""
    objective = "clm" if model.causal else "mlm"
    specials = special_ids(corpus.tokenizer)
    data = Batches.evaluation(corpus.splits["valid"], objective, length, specials, corpus.vocab_size)
    sequences = max(1, tokens // length)
    per_block = math.ceil(sequences / BLOCKS)
    batches = data.fixed(sequences, max(1, min(per_block, SCORE_BUDGET // length ** 2)))
    if not batches:
        raise PositionError(f"the held-out split of {corpus.folder} is shorter than one window of {length} tokens")
    model.context(batches[0].input_ids[:1].to(device), None, None, None)
    rows_per_batch = batches[0].input_ids.shape[0]
    step = max(1, per_block // rows_per_batch)   # batches per block (a batch never spans two blocks)
    blocks = [batches[i:i + step] for i in range(0, len(batches), step)]
    scored = [(evaluate(model, block, device), sum(b.targets for b in block)) for block in blocks]
    count = sum(n for _, n in scored)
    out: dict[str, Any] = {key: sum(r[key] * n for r, n in scored) / count for key in ("valid_loss", "valid_accuracy")}
    out["valid_perplexity"] = math.exp(min(out["valid_loss"], 50.0))
    out["block_losses"] = [r["valid_loss"] for r, _ in scored]
    return out


def length_sweep(subjects: list[Subject], multipliers: list[float] | None = None, lengths: list[int] | None = None,
                 tokens: int = 32768, rope_scaling: str | None = None, factor: float | None = None,
                 device: str = "auto", progress: bool = True) -> list[dict[str, Any]]:
    """One row per model (and per rescaled rope model): loss and perplexity at every length."""
    if rope_scaling is not None and rope_scaling not in SCALINGS:
        raise PositionError(f"--rope-scaling must be one of {', '.join(SCALINGS)}, got {rope_scaling!r}")
    if factor is not None and factor < 1:
        raise PositionError(f"--factor must be >= 1, got {factor}")
    dev = resolve_device(device)
    jobs = []
    for s in subjects:
        train_length = s.config["max_len"]
        todo = lengths or [int(round(m * train_length)) for m in (multipliers or [1, 2, 4, 8])]
        jobs.append((s, s.label, None, todo))
        if rope_scaling and length_scaled_config(s.config, rope_scaling, 2.0) is not None:
            fixed = f" (factor {factor:g})" if factor is not None else ""   # apart from the per-length rows
            jobs.append((s, f"{s.label} + {rope_scaling}{fixed}", rope_scaling, todo))
    rows = []
    bar = tqdm(total=sum(len(j[3]) for j in jobs), desc="eval-lm", disable=not progress, dynamic_ncols=True)
    for s, label, scaling, todo in jobs:
        row: dict[str, Any] = {"label": label, "model": str(s.folder), "run": s.run, "kind": s.config["kind"],
                               "mechanisms": s.config["mechanisms"], "train_length": s.config["max_len"],
                               "rope_scaling": scaling, "fixed_factor": factor if scaling else None,
                               "tokens": tokens, "device": str(dev), "valid_loss": {}, "valid_perplexity": {},
                               "block_losses": {}, "skipped": {}}
        for n in todo:
            config = s.config
            if scaling:
                f = factor if factor is not None else max(1.0, n / s.config["max_len"])
                config = length_scaled_config(s.config, scaling, f)
                row.setdefault("factor", {})[str(n)] = f
            try:
                result = score(_model(config, s.folder, dev), s.corpus, n, tokens, dev)
                row["valid_loss"][str(n)] = result["valid_loss"]
                row["valid_perplexity"][str(n)] = result["valid_perplexity"]
                row["block_losses"][str(n)] = result["block_losses"]
            except PositionError as e:
                row["valid_loss"][str(n)] = row["valid_perplexity"][str(n)] = None
                row["skipped"][str(n)] = str(e)
            bar.update(1)
        rows.append(row)
    bar.close()
    return rows


def write_report(rows: list[dict[str, Any]], out: str | Path) -> Path:
    """``lengths.json``, ``report.md`` and ``perplexity_vs_length.png`` (or ``mlm_loss_vs_length.png``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / LENGTHS, rows, indent=2)
    kinds = {r["kind"] for r in rows}
    what = ("perplexity (decoders)" if kinds == {"decoder"} else "masked-LM loss (encoders)" if kinds == {"encoder"}
            else "perplexity (decoders) / masked-LM loss (encoders)")
    write_text_atomic(out / "report.md", "\n".join([f"# Held-out {what} against evaluation length", "",
                                                     *length_table(rows)]) + "\n")
    write_length_plots(rows, out)
    return out / "report.md"


def length_table(rows: list[dict[str, Any]], ratio: bool = False) -> list[str]:
    """Markdown lines: one row per model, perplexity (decoders) or masked-LM loss (encoders) at every
    length, then the lengths a model could not run and why. ``ratio``: a last column, the value at
    the longest length over the value at the training length (the change with length alone)."""
    lengths = sorted({int(n) for r in rows for n in r["valid_loss"]})
    extra = [f"{lengths[-1]} / trained"] if ratio and lengths else []
    lines = ["| model | " + " | ".join([*map(str, lengths), *extra]) + " |",
             "|---|" + "---|" * (len(lengths) + len(extra))]
    for r in rows:
        metric = "valid_perplexity" if r["kind"] == "decoder" else "valid_loss"
        cells = [f"{r[metric][str(n)]:.2f}" if r[metric].get(str(n)) is not None else "–" for n in lengths]
        if extra:
            first, last = r[metric].get(str(r["train_length"])), r[metric].get(str(lengths[-1]))
            cells.append(f"{last / first:.3f}" if first and last is not None else "–")
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    notes = [f"- {r['label']} at {n}: {why}" for r in rows for n, why in r["skipped"].items()]
    return lines + (["", "Not run:", *notes] if notes else [])


def write_length_plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """``perplexity_vs_length.png`` (decoders) and ``mlm_loss_vs_length.png`` (encoders) in ``out``;
    the paths written."""
    paths = []
    for kind, metric, name in (("decoder", "valid_perplexity", "perplexity_vs_length.png"),
                               ("encoder", "valid_loss", "mlm_loss_vs_length.png")):
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            plot_lengths(mine, out / name, mine[0]["train_length"], metric)
            paths.append(out / name)
    return paths
