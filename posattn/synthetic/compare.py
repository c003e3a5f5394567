"""``posattn compare``: train mechanisms side by side on a synthetic task and write a report.

A sweep is a YAML config (its schema: :class:`~posattn.synthetic.schema.CompareConfig`). Every
combination of model entry, depth, width, training length, learning rate and seed is one *cell*;
a cell trains one model, evaluates it at every test length and writes ``cells/<id>/result.json``
and its model. Finished cells are never re-run, so an interrupted sweep resumes where it stopped.
When all cells are done the folder gets ``results.json``, ``report.md`` and PNG plots.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from itertools import product
from pathlib import Path
from typing import Any

import torch

from posattn.claims import parse_claims
from posattn.errors import PositionError
from posattn.experiments import config as config_loader
from posattn.experiments import sweep as sweep_runner
from posattn.experiments.executors import Executor
from posattn.experiments.store import content_id
from posattn.models import build_model, load, save
from posattn.runtime.checkpoint import CHECKPOINT
from posattn.runtime.files import write_json_atomic
from posattn.runtime.lock import run_lock
from posattn.synthetic.generators import drop_overlap, generate
from posattn.synthetic.report import write_summary
from posattn.synthetic.schema import MODEL_KEYS, CompareConfig, task_params_at
from posattn.synthetic.train import TrainConfig, evaluate, resolve_device, train

DEFAULT_CONFIG = "default"
EVAL_SCORE_BUDGET = 2 ** 25   # batch · length² kept under this at evaluation (attention matrices)


def schema_text() -> str:
    """The config's keys, types, defaults and meanings for ``posattn compare --help``, from the schema."""
    return config_loader.schema_text(CompareConfig, "Config schema")


def builtin_configs() -> list[str]:
    """Names of the configs shipped in ``posattn/synthetic/configs``."""
    return config_loader.builtin_configs("posattn.synthetic")


def load_config(source: str | Path | dict | None = None) -> dict[str, Any]:
    """A raw config from a YAML path, a built-in name, a dict or None (the ``default`` sweep)."""
    return config_loader.load_config(source, package="posattn.synthetic", default=DEFAULT_CONFIG)


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
                "mechanisms": self.mechanisms, **{k: getattr(self, k) for k in MODEL_KEYS}}

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


def validate_config(raw: dict[str, Any]) -> Sweep:
    """Check a raw config against :class:`~posattn.synthetic.schema.CompareConfig` and expand it into
    cells; raise one :class:`ConfigError` listing every problem."""
    spec, problems = config_loader.check(CompareConfig, raw)
    config_loader.fail("compare config", problems)
    test_lengths = spec.lengths()
    given = spec.training.model_fields_set - {"lr"}
    training = {k: v for k, v in asdict(TrainConfig(**{k: getattr(spec.training, k) for k in given})).items()
                if k != "seed"}
    config = {"name": spec.name, "task": spec.task, "task_params": spec.task_params,
              "vocab_size": spec.vocab_size, "train_length": spec.train_length,
              "test_lengths": {str(k): v for k, v in test_lengths.items()}, "examples": spec.examples.model_dump(),
              "data_seed": spec.data_seed, "seeds": spec.seeds, "d_model": spec.d_model,
              "models": [{k: v for k, v in s.items() if k != "where"} for s in spec.row_specs()],
              "training": {**training, "lr": [float(lr) for lr in spec.training.lr]},
              "claims": [c.to_dict() for c in parse_claims(spec.claims, [], optional=("at",))]}
    return Sweep(name=config["name"], config=config, cells=expand(config), test_lengths=test_lengths)


def expand(config: dict[str, Any]) -> list[Cell]:
    """The cells of a normalized config (:attr:`Sweep.config`, as ``config.yaml`` and the results store
    hold it), seed by seed: the one expansion, so that the ids of a run folder's or the store's
    config are those its sweep trained."""
    training = {k: v for k, v in config["training"].items() if k != "lr"}
    return [Cell(task=config["task"], task_params=task_params_at(config["task_params"], n),
                 vocab_size=config["vocab_size"], train_length=n, examples=config["examples"],
                 data_seed=config["data_seed"], label=m["label"], mechanisms=m["mechanisms"], layers=m["layers"],
                 d_model=d, **{k: m[k] for k in MODEL_KEYS}, training=asdict(TrainConfig(**training, lr=lr, seed=seed)))
            for seed, n, d, m, lr in product(config["seeds"], config["train_length"], config["d_model"],
                                             config["models"], config["training"]["lr"])]


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


def run_cell(cell: Cell, test_lengths: list[int], out: Path, device: str = "auto", progress: bool = True,
             compile: str | None = None) -> dict:
    """Train (or resume) one cell, evaluate the test lengths it lacks, and return its result record.
    ``compile``: a :mod:`posattn.runtime.compile` mode for the training steps (not part of the cell).
    The cell's folder is locked meanwhile (:func:`~posattn.runtime.lock.run_lock`)."""
    with run_lock(_cell_folder(cell, out)):
        return _run_cell(cell, test_lengths, out, device, progress, compile)


def _run_cell(cell: Cell, test_lengths: list[int], out: Path, device: str, progress: bool,
              compile: str | None) -> dict:
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
                            checkpoint_dir=folder, device=device, progress=progress, compile=compile,
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


def _cell_job(job: tuple[Cell, list[int], str, str, bool, str | None], in_worker: bool) -> dict:
    cell, lengths, out, device, progress, compile = job
    return run_cell(cell, lengths, Path(out), device, progress and not in_worker, compile)


def _read_cell(job: tuple[Cell, list[int], str, str, bool, str | None]) -> dict | None:
    cell, lengths, out = job[:3]
    return finished_cell(cell, lengths, Path(out))


def finished_cell(cell: Cell, lengths: list[int], out: Path) -> dict | None:
    """The result of ``cell`` if it is trained and scored at every length in ``lengths``, else None."""
    result = _saved_result(cell, out)
    return None if missing_lengths(result, lengths) else result


def recipe(sweep: Sweep, out: Path, device: str = "auto", progress: bool = True,
           compile: str | None = None) -> sweep_runner.Recipe:
    """The sweep for :func:`posattn.experiments.sweep.run`: a cell is a trained model in ``out/cells/<id>``."""
    cells = [sweep_runner.Cell(cell.id, f"cell {cell.id} ({cell.label})",
                               (cell, sweep.test_lengths[cell.train_length], str(out), device, progress, compile))
             for cell in sweep.cells]
    return sweep_runner.Recipe(f"sweep {sweep.name!r}", cells, _cell_job, _read_cell,
                               partial(write_summary, sweep.name, sweep.config), config=sweep.config)


def run_sweep(sweep: Sweep, out: str | Path, executor: Executor | None = None, device: str = "auto",
              progress: bool = True, report_only: bool = False, compile: str | None = None,
              stored: dict[str, dict] | None = None, on_cell: Callable[[str, dict], Any] | None = None,
              only: set[str] | None = None) -> list[dict]:
    """Run every cell not yet finished, then write results.json, report.md and the plots into ``out``;
    return the finished cells' results (:func:`posattn.experiments.sweep.run`).

    ``executor``: where the cells run (default: one after another in this process); cells its time
    budget keeps from starting are left for the next invocation and the report says it is partial.
    ``report_only``: train nothing, report the cells finished so far (a partial report says so);
    ConfigError if there are none. ``compile``: a :mod:`posattn.runtime.compile` mode for the
    training steps (the cells' results do not depend on it beyond floating-point rounding).
    ``stored``: results of cells finished elsewhere, by id (the results store): not run again;
    ``on_cell(id, result)``: called as each cell trained here finishes. ``only``: the ids of the
    cells to train now; the others are read back if finished and otherwise left for a later run.
    """
    return sweep_runner.run(recipe(sweep, Path(out), device, progress, compile), out, executor, progress=progress,
                            report_only=report_only, stored=stored, on_cell=on_cell, only=only)
