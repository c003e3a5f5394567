"""``posattn compare``: train mechanisms side by side on a synthetic task and write a report.

A sweep is a YAML config (schema in :data:`SCHEMA`). Every combination of model entry, depth,
width, training length, learning rate and seed is one *cell*; a cell trains one model, evaluates
it at every test length and writes ``cells/<id>/result.json`` and its model. Finished cells are
never re-run, so an interrupted sweep resumes where it stopped. When all cells are done the
folder gets ``results.json``, ``report.md`` and PNG plots.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from itertools import product
from pathlib import Path
from typing import Any

import torch

from posattn.claims import parse_claims
from posattn.errors import PositionError
from posattn.experiments import config as config_loader
from posattn.experiments import sweep as sweep_runner
from posattn.experiments.config import ConfigError, is_int
from posattn.experiments.executors import Executor, block_problems
from posattn.experiments.store import content_id
from posattn.mechanisms import registry
from posattn.models import build_model, load, save
from posattn.runtime.files import name_problem, write_json_atomic
from posattn.runtime.lock import run_lock
from posattn.synthetic.generators import TASK_PARAMS, TASKS, TaskError, drop_overlap, generate
from posattn.synthetic.report import write_summary
from posattn.synthetic.train import CHECKPOINT, TrainConfig, evaluate, resolve_device, train

DEFAULT_CONFIG = "default"
MODEL_DEFAULTS: dict[str, Any] = {"n_heads": 2, "d_ff": 0, "max_len": None, "dropout": 0.0, "attn_path": "fast",
                                  "init_std": None}
MODEL_ENTRY_KEYS = ("mechanisms", "layers", "label", *MODEL_DEFAULTS)
EXAMPLE_DEFAULTS = {"train": 20000, "valid": 500, "test": 500}
TOP_KEYS = ("name", "task", "task_params", "vocab_size", "train_length", "test_lengths", "test_multipliers",
            "examples", "data_seed", "seeds", "d_model", "models", "training", "claims", "executor", *MODEL_DEFAULTS)
TRAINING_KEYS = tuple(f.name for f in fields(TrainConfig) if f.name != "seed")
EVAL_SCORE_BUDGET = 2 ** 25   # batch · length² kept under this at evaluation (attention matrices)

SCHEMA = """\
Config schema (YAML; every key but `models` has a default):
  name: str                  sweep name; default output folder runs/compare-<name>
  task: str                  one of {tasks}
  task_params: {{...}}         options of the task (defaults):
{task_params}
                             kv_density: float  (recall tasks) num_kv_pairs = round(density * train_length)
  vocab_size: int            64
  train_length: int | [int]  64; each training length is its own set of cells
  test_lengths: [int]        absolute test lengths, or instead
  test_multipliers: [num]    test lengths as multiples of the training length ([1, 2, 4, 8])
  examples: {{train: 20000, valid: 500, test: 500}}   valid: early stopping; test: per test length
  data_seed: int             0; seeds the data (train/valid/test come from disjoint streams)
  seeds: [int]               [0]; model initialisation and batch order
  d_model: int | [int]       64; widths to sweep
  n_heads: 2   d_ff: 0 (no MLP)   max_len: null (= longest test length)   dropout: 0.0
  attn_path: fast | reference
  init_std: null             null: PyTorch's default init of linear maps; 0.02: GPT-2/Zoology
  models:                    list of model entries, each
    - mechanisms: [name or {{name: ..., option: value}}]
{mechanisms}
      layers: int | [int]    depth(s), default 2
      label: str             optional row name (default: mechanism names and depth)
      n_heads/d_ff/max_len/dropout/attn_path/init_std: per-model overrides
  training:                  defaults:
{training}
    lr may be a list: each value is a cell and the report keeps, per model, the one with
    the best validation accuracy. warmup < 1 is a fraction of steps. Training stops early
    once validation accuracy reaches target_accuracy.
  claims:                    papers' claims, judged on test accuracy at the best lr (posattn.claims)
    - {{claim: str, paper: str, holds: ["cat (1L) > rope (2L)", "absolute (2L) >= 0.99", ...],
       at: {{d_model: int, train_length: int, length: int | train | longest}}}}   at: optional;
                             a key left out means every value (length: the training length)
  executor: {{...}}            where the cells run (see Executors below; command-line options win)
Tasks (vocabulary V; token 0 is filler or noise):
  mqar, mqnar      D key-value pairs (keys from [1, V/2), values from [V/2, V); mqnar keys are
                   N-grams), then every key queried once at power-law gaps (Zoology's layout)
  ar, nar          the same context, then one query at the very end
  selective_copy   num_tokens content tokens among noise, a separator (token 1), then the
                   content tokens in order
Accuracy is the fraction of scored tokens (query answers, copied tokens) predicted exactly.
A model that cannot run a test length (e.g. `absolute` beyond max_len) gets null there,
with the reason in the report."""


def schema_text() -> str:
    """:data:`SCHEMA` filled in with the valid tasks, task options, mechanisms and training keys."""
    mechanisms = textwrap.fill("valid names: " + ", ".join(registry.names()), 96,
                               initial_indent=" " * 29, subsequent_indent=" " * 29)
    task_lines = "\n".join(f"{'':29}{task}: {', '.join(f'{k}={v}' for k, v in params.items())}"
                           for task, params in TASK_PARAMS.items())
    training = textwrap.fill(", ".join(f"{k}={v}" for k, v in asdict(TrainConfig()).items() if k != "seed"),
                             96, initial_indent=" " * 29, subsequent_indent=" " * 29)
    return SCHEMA.format(tasks=", ".join(TASKS), task_params=task_lines, mechanisms=mechanisms, training=training)


def builtin_configs() -> list[str]:
    """Names of the configs shipped in ``posattn/synthetic/configs``."""
    return config_loader.builtin_configs("posattn.synthetic")


def load_config(source: str | Path | dict | None = None) -> dict[str, Any]:
    """A raw config from a YAML path, a built-in name, a dict or None (the ``default`` sweep)."""
    return config_loader.load_config(source, package="posattn.synthetic", default=DEFAULT_CONFIG, keys=TOP_KEYS)


@dataclass(frozen=True)
class Cell:
    """One trained model of a sweep: everything that determines its result."""

    task: str
    task_params: dict[str, Any]
    vocab_size: int
    train_length: int
    examples: dict[str, int]
    data_seed: int
    label: str
    mechanisms: list[Any]
    layers: int
    d_model: int
    n_heads: int
    d_ff: int
    max_len: int
    dropout: float
    attn_path: str
    init_std: float | None
    training: dict[str, Any]

    @property
    def id(self) -> str:
        """Stable short hash of the cell's settings (the folder name of its outputs)."""
        return content_id(asdict(self))

    def model_config(self) -> dict[str, Any]:
        """The ``build_model`` dict of this cell's decoder."""
        return {"kind": "decoder", "vocab_size": self.vocab_size, "d_model": self.d_model, "n_layers": self.layers,
                "mechanisms": self.mechanisms, **{k: getattr(self, k) for k in MODEL_DEFAULTS}}

    def data(self, split: str, length: int, n: int) -> Any:
        return generate(self.task, n, length, self.vocab_size, self.data_seed, split, **self.task_params)


@dataclass(frozen=True)
class Sweep:
    """A validated config: the normalized settings and the cells they expand to, seed by seed (all
    cells of the first seed, then of the second, ...), so that a sweep stopped part way has every
    model at every setting and learning rate on its first seeds rather than a few models on all."""

    name: str
    config: dict[str, Any]
    cells: list[Cell]
    test_lengths: dict[int, list[int]]


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _label(mechanisms: list[Any], layers: int, label: str | None, several_depths: bool) -> str:
    names = "+".join(m if isinstance(m, str) else str(m.get("name")) for m in mechanisms)
    if label is None:
        return f"{names} ({layers}L)"
    return f"{label} ({layers}L)" if several_depths else label


def _task_params(task: str, params: dict[str, Any], train_length: int) -> dict[str, Any]:
    params = dict(params)
    density = params.pop("kv_density", None)
    if density is not None:
        params["num_kv_pairs"] = max(1, round(density * train_length))
    return params


def _lengths(raw: dict[str, Any], errors: list[str]) -> tuple[list[int], dict[int, list[int]]]:
    """Training lengths and, per training length, the sorted test lengths."""
    train_lengths = _as_list(raw.get("train_length", 64))
    if not all(is_int(n, 2) for n in train_lengths):
        errors.append(f"train_length must be an integer >= 2 or a list of them, got {raw.get('train_length')!r}")
        train_lengths = [64]
    if "test_lengths" in raw and "test_multipliers" in raw:
        errors.append("give test_lengths or test_multipliers, not both")
    if "test_lengths" in raw:
        lengths = _as_list(raw["test_lengths"])
        if not lengths or not all(is_int(n, 2) for n in lengths):
            errors.append(f"test_lengths must be a non-empty list of integers >= 2, got {raw['test_lengths']!r}")
            lengths = train_lengths[:1]
        return train_lengths, {n: sorted(set(lengths)) for n in train_lengths}
    mults = _as_list(raw.get("test_multipliers", [1, 2, 4, 8]))
    if not mults or not all(isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0 for m in mults):
        errors.append(f"test_multipliers must be a non-empty list of positive numbers, got {mults!r}")
        mults = [1]
    return train_lengths, {n: sorted({max(2, round(m * n)) for m in mults}) for n in train_lengths}


def _training(raw: dict[str, Any], errors: list[str]) -> tuple[TrainConfig, list[float]]:
    """The shared training settings and the learning rates to sweep."""
    training = dict(raw.get("training") or {})
    bad = sorted(set(training) - set(TRAINING_KEYS))
    if bad:
        errors.append(f"training: unknown key(s) {', '.join(bad)}; valid keys: {', '.join(TRAINING_KEYS)}")
        training = {k: v for k, v in training.items() if k in TRAINING_KEYS}
    lrs = _as_list(training.pop("lr", TrainConfig.lr))
    try:
        base = TrainConfig(**training)
        for key in ("steps", "batch_size", "eval_every", "eval_batch_size"):
            if not is_int(getattr(base, key)):
                raise TypeError(f"{key} must be a positive integer, got {getattr(base, key)!r}")
        if not all(isinstance(lr, (int, float)) and lr > 0 for lr in lrs):
            raise TypeError(f"lr must be a positive number or a list of them, got {lrs!r}")
        target = base.target_accuracy
        if target is not None and not (isinstance(target, (int, float)) and 0 < target <= 1):
            raise TypeError(f"target_accuracy must be null or in (0, 1], got {target!r}")
    except TypeError as e:
        errors.append(f"training: {e}")
        return TrainConfig(), [TrainConfig.lr]
    return base, [float(lr) for lr in lrs]


def _model_specs(raw: dict[str, Any], errors: list[str], train_length: int, longest: int) -> list[dict[str, Any]]:
    """One spec per (model entry, depth): label, mechanisms, layers and the model settings."""
    entries = raw.get("models")
    if not isinstance(entries, list) or not entries:
        errors.append("models must be a non-empty list of entries like {mechanisms: [rope], layers: 2}")
        return []
    valid_names = registry.names()
    defaults = {k: raw.get(k, v) for k, v in MODEL_DEFAULTS.items()}
    specs: list[dict[str, Any]] = []
    for i, entry in enumerate(entries):
        where = f"models[{i}]"
        if not isinstance(entry, dict) or "mechanisms" not in entry:
            errors.append(f"{where}: must be a mapping with a 'mechanisms' list, got {entry!r}")
            continue
        bad = sorted(set(entry) - set(MODEL_ENTRY_KEYS))
        if bad:
            errors.append(f"{where}: unknown key(s) {', '.join(bad)}; valid keys: {', '.join(MODEL_ENTRY_KEYS)}")
        mechanisms = _as_list(entry["mechanisms"])
        names = [m if isinstance(m, str) else m.get("name") if isinstance(m, dict) else None for m in mechanisms]
        wrong = [repr(n) for n in names if n not in valid_names]
        if wrong:
            errors.append(f"{where}: unknown mechanism(s) {', '.join(wrong)}; "
                          f"valid mechanisms: {', '.join(valid_names)}")
            continue
        depths = _as_list(entry.get("layers", 2))
        if not all(is_int(d) for d in depths):
            errors.append(f"{where}: layers must be a positive integer or a list of them, got {entry.get('layers')!r}")
            continue
        settings = {k: entry.get(k, defaults[k]) for k in MODEL_DEFAULTS}
        settings["max_len"] = settings["max_len"] or longest
        if settings["max_len"] < train_length:
            errors.append(f"{where}: max_len {settings['max_len']} is shorter than the training length {train_length}")
            continue
        for depth in depths:
            specs.append({"where": where, "label": _label(mechanisms, depth, entry.get("label"), len(depths) > 1),
                          "mechanisms": mechanisms, "layers": depth, **settings})
    labels = [s["label"] for s in specs]
    dupes = sorted({lab for lab in labels if labels.count(lab) > 1})
    if dupes:
        errors.append(f"models: duplicate row label(s) {', '.join(dupes)}; give the entries distinct labels")
    return specs


def validate_config(raw: dict[str, Any]) -> Sweep:
    """Check a raw config and expand it into cells; raise one :class:`ConfigError` listing every problem."""
    errors: list[str] = []
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        errors.append(f"unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(TOP_KEYS)}")
    if unsafe := name_problem(raw.get("name", DEFAULT_CONFIG), "name"):   # names the output folder
        errors.append(unsafe)
    task = raw.get("task", "mqar")
    if task not in TASKS:
        errors.append(f"task {task!r} is not one of: {', '.join(TASKS)}")
        task = "mqar"
    task_params = raw.get("task_params") or {}
    valid_params = [*TASK_PARAMS[task], *(["kv_density"] if task != "selective_copy" else [])]
    if not isinstance(task_params, dict) or set(task_params) - set(valid_params):
        errors.append(f"task_params for {task} must be a mapping with keys from: {', '.join(valid_params)}; "
                      f"got {task_params!r}")
        task_params = {}
    if "kv_density" in task_params and "num_kv_pairs" in task_params:
        errors.append("task_params: give num_kv_pairs or kv_density, not both")
    vocab = raw.get("vocab_size", 64)
    if not is_int(vocab, 3):
        errors.append(f"vocab_size must be an integer >= 3, got {vocab!r}")
        vocab = 64
    train_lengths, test_lengths = _lengths(raw, errors)
    examples = {**EXAMPLE_DEFAULTS, **(raw.get("examples") or {})}
    if set(examples) != set(EXAMPLE_DEFAULTS) or not all(is_int(v) for v in examples.values()):
        errors.append(f"examples must map train/valid/test to positive integers, got {raw.get('examples')!r}")
        examples = dict(EXAMPLE_DEFAULTS)
    data_seed = raw.get("data_seed", 0)
    seeds = _as_list(raw.get("seeds", [0]))
    if not is_int(data_seed, 0) or not seeds or not all(is_int(s, 0) for s in seeds):
        errors.append(f"data_seed and seeds must be integers >= 0, got {data_seed!r} and {raw.get('seeds')!r}")
        data_seed, seeds = 0, [0]
    widths = _as_list(raw.get("d_model", 64))
    if not all(is_int(d) for d in widths):
        errors.append(f"d_model must be a positive integer or a list of them, got {raw.get('d_model')!r}")
        widths = [64]
    base, lrs = _training(raw, errors)
    specs = _model_specs(raw, errors, max(train_lengths), max(max(v) for v in test_lengths.values()))
    for n in train_lengths:
        params = _task_params(task, task_params, n)
        for length in test_lengths[n]:
            try:
                generate(task, 1, length, vocab, data_seed, "test", **params)
            except TaskError as e:
                errors.append(f"task {task} at length {length} (training length {n}): {e}")
    errors.extend(_check_models(specs, widths, vocab))
    errors.extend(block_problems(raw.get("executor")))
    claims = parse_claims(raw.get("claims"), errors, optional=("at",))
    for i, c in enumerate(claims):
        errors.extend(f"claims[{i}].at: {e}" for e in _check_at(c.at, train_lengths, widths))
    if errors:
        raise ConfigError("invalid compare config:\n  - " + "\n  - ".join(errors))

    cells = [Cell(task=task, task_params=_task_params(task, task_params, n), vocab_size=vocab, train_length=n,
                  examples=examples, data_seed=data_seed, label=s["label"], mechanisms=s["mechanisms"],
                  layers=s["layers"], d_model=d, **{k: s[k] for k in MODEL_DEFAULTS},
                  training=asdict(replace(base, lr=lr, seed=seed)))
             for seed, n, d, s, lr in product(seeds, train_lengths, widths, specs, lrs)]
    training = {k: v for k, v in asdict(base).items() if k != "seed"}
    config = {"name": str(raw.get("name", DEFAULT_CONFIG)), "task": task, "task_params": task_params,
              "vocab_size": vocab, "train_length": train_lengths,
              "test_lengths": {str(k): v for k, v in test_lengths.items()}, "examples": examples,
              "data_seed": data_seed, "seeds": seeds, "d_model": widths,
              "models": [{k: v for k, v in s.items() if k != "where"} for s in specs],
              "training": {**training, "lr": lrs},
              "claims": [c.to_dict() for c in claims]}
    return Sweep(name=config["name"], config=config, cells=cells, test_lengths=test_lengths)


def _check_at(at: dict[str, Any], train_lengths: list[int], widths: list[int]) -> list[str]:
    """Problems of a claim's ``at``: d_model / train_length among the sweep's, length an integer,
    ``train`` (the training length, the default) or ``longest``."""
    bad = [f"unknown key {k!r} (d_model, train_length, length)" for k in sorted(set(at) - {"d_model", "train_length",
                                                                                          "length"})]
    if "d_model" in at and at["d_model"] not in widths:
        bad.append(f"d_model {at['d_model']!r} is not one of the sweep's {widths}")
    if "train_length" in at and at["train_length"] not in train_lengths:
        bad.append(f"train_length {at['train_length']!r} is not one of the sweep's {train_lengths}")
    if "length" in at and not (is_int(at["length"]) or at["length"] in ("train", "longest")):
        bad.append(f"length must be an integer, train or longest, got {at['length']!r}")
    return bad


def _check_models(specs: list[dict[str, Any]], widths: list[int], vocab: int) -> list[str]:
    """Build every (model entry, width) once so that bad options fail now, not mid-sweep."""
    errors = []
    for s, d in product(specs, widths):
        cfg = {"kind": "decoder", "vocab_size": vocab, "d_model": d, "n_layers": s["layers"],
               **{k: s[k] for k in MODEL_DEFAULTS}, "mechanisms": s["mechanisms"]}
        try:
            build_model(cfg)
        except (ValueError, TypeError, KeyError) as e:
            errors.append(f"{s['where']} ({s['label']}, d_model={d}): {e}")
    return errors


def _eval_batch(length: int, cap: int) -> int:
    return max(1, min(cap, EVAL_SCORE_BUDGET // length ** 2))


def _cell_folder(cell: Cell, out: Path) -> Path:
    return out / "cells" / cell.id


def _saved_result(cell: Cell, out: Path) -> dict | None:
    path = _cell_folder(cell, out) / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def missing_lengths(result: dict | None, lengths: list[int]) -> list[int]:
    """The test lengths ``result`` (None: a cell not trained yet) has no accuracy for."""
    return [n for n in lengths if result is None or str(n) not in result["accuracy"]]


def run_cell(cell: Cell, test_lengths: list[int], out: Path, device: str = "auto", progress: bool = True) -> dict:
    """Train (or resume) one cell, evaluate the test lengths it lacks, and return its result record.
    The cell's folder is locked meanwhile (:func:`~posattn.runtime.lock.run_lock`)."""
    with run_lock(_cell_folder(cell, out)):
        return _run_cell(cell, test_lengths, out, device, progress)


def _run_cell(cell: Cell, test_lengths: list[int], out: Path, device: str, progress: bool) -> dict:
    """:func:`run_cell` with the cell's folder locked."""
    folder = _cell_folder(cell, out)
    result_path, model_dir = folder / "result.json", folder / "model"
    folder.mkdir(parents=True, exist_ok=True)
    result = _saved_result(cell, out)
    missing = missing_lengths(result, test_lengths)
    if not missing:
        return result
    tcfg = TrainConfig(**cell.training)
    train_data = cell.data("train", cell.train_length, cell.examples["train"])
    if result is None:
        torch.manual_seed(tcfg.seed)
        model = build_model(cell.model_config())
        try:
            outcome = train(model, train_data, tcfg,
                            valid=cell.data("valid", cell.train_length, cell.examples["valid"]),
                            checkpoint_dir=folder, device=device, progress=progress,
                            description=f"{cell.label} d={cell.d_model} L={cell.train_length} lr={tcfg.lr:g}")
        except FloatingPointError as e:
            outcome, diverged = None, str(e)
        result = {"id": cell.id, "task": cell.task, "task_params": cell.task_params, "vocab_size": cell.vocab_size,
                  "label": cell.label, "mechanisms": cell.mechanisms, "layers": cell.layers, "d_model": cell.d_model,
                  "n_heads": cell.n_heads, "d_ff": cell.d_ff, "max_len": cell.max_len,
                  "train_length": cell.train_length, "lr": tcfg.lr, "seed": tcfg.seed,
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "steps": outcome.steps if outcome else None,
                  "stopped_early": outcome.stopped_early if outcome else False,
                  "valid_accuracy": outcome.valid_accuracy if outcome else None,
                  "train_seconds": outcome.seconds if outcome else None,
                  "history": outcome.history if outcome else [],
                  "accuracy": {}, "not_applicable": {}, "test_examples": {}}
        if outcome is None:
            result["diverged"] = diverged
        save(model, model_dir)
    else:
        model = load(model_dir)
    model.to(resolve_device(device))
    for n in missing:
        if "diverged" in result:
            result["accuracy"][str(n)] = None
            result["not_applicable"][str(n)] = f"training diverged: {result['diverged']}"
            continue
        test = drop_overlap(cell.data("test", n, cell.examples["test"]), train_data)
        result["test_examples"][str(n)] = len(test)
        try:
            acc = evaluate(model, test, _eval_batch(n, tcfg.eval_batch_size))
        except PositionError as e:
            result["accuracy"][str(n)], result["not_applicable"][str(n)] = None, str(e)
        else:
            result["accuracy"][str(n)] = acc
    write_json_atomic(result_path, result)
    (folder / CHECKPOINT).unlink(missing_ok=True)
    return result


def _cell_job(job: tuple[Cell, list[int], str, str, bool], in_worker: bool) -> dict:
    cell, lengths, out, device, progress = job
    return run_cell(cell, lengths, Path(out), device, progress and not in_worker)


def _read_cell(job: tuple[Cell, list[int], str, str, bool]) -> dict | None:
    cell, lengths, out, _, _ = job
    return finished_cell(cell, lengths, Path(out))


def finished_cell(cell: Cell, lengths: list[int], out: Path) -> dict | None:
    """The result of ``cell`` if it is trained and scored at every length in ``lengths``, else None."""
    result = _saved_result(cell, out)
    return None if missing_lengths(result, lengths) else result


def recipe(sweep: Sweep, out: Path, device: str = "auto", progress: bool = True) -> sweep_runner.Recipe:
    """The sweep for :func:`posattn.experiments.sweep.run`: a cell is a trained model in ``out/cells/<id>``."""
    cells = [sweep_runner.Cell(cell.id, f"cell {cell.id} ({cell.label})",
                               (cell, sweep.test_lengths[cell.train_length], str(out), device, progress))
             for cell in sweep.cells]
    return sweep_runner.Recipe(f"sweep {sweep.name!r}", cells, _cell_job, _read_cell,
                               partial(write_summary, sweep.name, sweep.config), config=sweep.config)


def run_sweep(sweep: Sweep, out: str | Path, executor: Executor | None = None, device: str = "auto",
              progress: bool = True, report_only: bool = False) -> list[dict]:
    """Run every cell not yet finished, then write results.json, report.md and the plots into ``out``;
    return the finished cells' results (:func:`posattn.experiments.sweep.run`).

    ``executor``: where the cells run (default: one after another in this process); cells its time
    budget keeps from starting are left for the next invocation and the report says it is partial.
    ``report_only``: train nothing, report the cells finished so far (a partial report says so);
    ConfigError if there are none.
    """
    return sweep_runner.run(recipe(sweep, Path(out), device, progress), out, executor, progress=progress,
                            report_only=report_only)
