"""What a run folder holds, whatever sweep wrote it: its recipe, config, finished cells and command.

Four kinds of run folder exist, each read here into one :class:`Run`:

- a ``posattn compare`` sweep: ``config.yaml`` (``task``, ``models``) and ``cells/<id>/result.json``;
  a cell is finished when it has an accuracy at every test length of its training length;
- a ``posattn finetune`` suite: ``config.yaml`` (``tasks``, ``checkpoints``) whose cells live in
  ``<run>/cells`` or in the shared ``cell_store`` it names; the suite's cells are known by
  validating that config again (its checkpoints must be on this machine: cell ids key them by
  content), and :func:`posattn.finetune.run.finished_cell` reads each one back;
- a ``posattn pretrain`` run (``pretrain.json``, ``result.json``, ``metrics.jsonl``) or recipe
  (one such folder per run label): a cell is a run, its id is its label, and its record holds
  the run's config and its metrics history;
- the TISA Table 3 study (``posattn study table3``): ``cells/<variant>-<task>-<seed>.json``
  and ``results.json`` (its ``protocol`` says how many tasks and seeds it has);
- a ``posattn eval-lm`` output folder (``lengths.json``): a cell is one row (a model, or a model
  with a rope rescaling, at every length), its id the hash of the settings that made it; its
  recipe is the pretraining recipe its models come from, whose report it extends.

Only small result files are read: no model, checkpoint or tensor file is opened.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posattn.errors import PositionError
from posattn.experiments.config import read_yaml
from posattn.experiments.store import read_json

TABLE3_RECIPE = "tisa_table3"
TABLE3_PROTOCOL = re.compile(r"^(?P<tasks>\d+) tasks \((?P<names>[^)]*)\), (?P<seeds>\d+) seeds")


@dataclass
class Run:
    """A run folder read back: ``cells`` maps each finished cell's id to its result record;
    ``total`` is how many cells the recipe has in all (None where the folder cannot tell);
    ``config`` is what ``posattn report`` needs to lay out the recipe's tables; ``other`` lists
    the finished cells the folder holds of another config than its own (a sweep's folder reused
    for another one), which belong to none of its recipe's cells and are left out."""

    folder: Path
    sweep: str
    recipe: str
    config: dict[str, Any]
    cells: dict[str, dict[str, Any]]
    total: int | None
    command: str
    device: str | None = None
    other: list[str] = field(default_factory=list)


def _mapping(value: Any, path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """``value`` if it is a mapping holding ``keys``, else one error naming ``path``."""
    if not isinstance(value, dict) or not set(keys) <= set(value):
        raise PositionError(f"{path}: not a result record of this kind of run (needs the keys {', '.join(keys)})")
    return value


def read_run(folder: str | Path) -> Run:
    """The :class:`Run` of ``folder``; one error if it is no kind of run folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PositionError(f"run folder {folder}: no such folder")
    if (folder / "config.yaml").is_file():
        config = read_yaml(folder / "config.yaml")
        if {"task", "models"} <= set(config):
            return _compare(folder, config)
        if {"tasks", "checkpoints"} <= set(config):
            return _finetune(folder, config)
        raise PositionError(f"{folder / 'config.yaml'}: neither a compare sweep's nor a finetune suite's config")
    if (folder / "pretrain.json").is_file() or any(folder.glob("*/pretrain.json")):
        return _pretrain(folder)
    if any((folder / "cells").glob("*.json")):
        return _table3(folder)
    if (folder / "lengths.json").is_file():
        return _lengths(folder)
    raise PositionError(f"{folder} is not a run folder: no compare/finetune config.yaml, no pretraining run "
                        f"(pretrain.json), no Table 3 cells (cells/*.json) and no eval-lm rows (lengths.json)")


def _compare(folder: Path, config: dict[str, Any]) -> Run:
    from posattn.synthetic.compare import builtin_configs, expand, load_config, missing_lengths, validate_config

    name = str(config.get("name"))
    lengths = config.get("test_lengths") or {}
    try:
        ids = {cell.id for cell in expand(config)}
    except (KeyError, TypeError) as e:
        raise PositionError(f"{folder / 'config.yaml'}: not a compare sweep's config (no {e})") from None
    cells, other = {}, []
    for path in sorted((folder / "cells").glob("*/result.json")):
        result = _mapping(read_json(path), path, ("id", "train_length", "accuracy"))
        if result["id"] != path.parent.name:
            raise PositionError(f"{path}: its id {result['id']!r} is not its folder's name")
        if result["id"] not in ids:     # a cell of another config run into this folder before
            other.append(result["id"])
        elif not missing_lengths(result, lengths.get(str(result["train_length"]), [None])):
            cells[result["id"]] = result
    builtin = name in builtin_configs() and validate_config(load_config(name)).config == config
    out = "" if folder == Path(f"runs/compare-{name}") else f" --out {shlex.quote(str(folder))}"
    command = f"posattn compare {name if builtin else name + '.yaml'}{out}"   # a config file is named by its sweep
    return Run(folder, "compare", name, config, cells, len(ids), command, other=other)


def _finetune(folder: Path, config: dict[str, Any]) -> Run:
    from posattn.finetune.run import finished_cell
    from posattn.finetune.suite import validate_config

    try:
        suite = validate_config(config)
    except PositionError as e:
        raise PositionError(f"{folder}: a suite's cells are keyed by its checkpoints' content, so its checkpoints "
                            f"must be on this machine: {e}") from None
    store = Path(suite.cell_store) if suite.cell_store else folder / "cells"
    cells = {c.id: r for c in suite.cells if (r := finished_cell(c, store)) is not None}
    command = f"posattn finetune --config {shlex.quote(str(folder / 'config.yaml'))} --out {shlex.quote(str(folder))}"
    return Run(folder, "finetune", suite.name, suite.config, cells, len(suite.cells), command)


def _pretrain_cell(run: Path) -> tuple[str, str, dict[str, Any] | None]:
    """(recipe, label, record) of one pretraining run folder; the record (its result, metrics history
    and config) is None until it has finished. A run of a recipe is named ``recipe/label``; a single
    run's recipe and label are its name."""
    from posattn.pretrain.report import finished_run

    config = _mapping(read_json(run / "pretrain.json"), run / "pretrain.json", ("name",))
    recipe, _, label = str(config["name"]).rpartition("/")
    record = finished_run(run, label)
    return recipe or label, label, None if record is None else {**record, "config": config}


def _pretrain(folder: Path) -> Run:
    from posattn.pretrain.config import builtin_configs, load

    single = (folder / "pretrain.json").is_file()
    runs = [folder] if single else sorted(p.parent for p in folder.glob("*/pretrain.json"))
    read = [_pretrain_cell(r) for r in runs]
    recipes = sorted({recipe for recipe, _, _ in read})
    if len(recipes) > 1:
        raise PositionError(f"{folder}: runs of several recipes ({', '.join(recipes)}); add each recipe's folder")
    recipe, builtin = recipes[0], recipes[0] in builtin_configs()
    cells = {label: record for _, label, record in read if record is not None}
    labels = [label for label, _ in load(recipe)[1]] if builtin else [label for _, label, _ in read]
    only = f" --runs {read[0][1]}" if len(read) == 1 and len(labels) > 1 else ""
    command = f"posattn pretrain {recipe if builtin else recipe + '.yaml'}{only}"
    device = next((r["device"] for r in cells.values() if r.get("device")), None)
    return Run(folder, "pretrain", recipe, {"name": recipe, "labels": labels}, cells, len(labels), command, device)


def _table3(folder: Path) -> Run:
    from posattn.hf.table3 import VARIANTS

    cells = {}
    for path in sorted((folder / "cells").glob("*.json")):
        cells[path.stem] = _mapping(read_json(path), path, ("variant", "task", "seed", "test", "majority_baseline"))
    summary = read_json(folder / "results.json") if (folder / "results.json").is_file() else {}
    match = TABLE3_PROTOCOL.match(str(summary.get("protocol", "")))
    tasks = [t.strip() for t in match["names"].split(",")] if match else sorted({c["task"] for c in cells.values()})
    seeds = int(match["seeds"]) if match else None
    first = next(iter(cells.values()))
    training = first.get("training", {})
    command = (f"posattn study table3 --tasks {' '.join(tasks)}"
               + (f" --seeds {seeds}" if seeds else "")
               + (f" --lr {training['lr']:g} --epochs {training['epochs']:g}" if training else "")
               + f" --out {shlex.quote(str(folder))}")
    config = {"name": TABLE3_RECIPE, "model": summary.get("model"), "protocol": summary.get("protocol"),
              "tasks": tasks, "seeds": seeds}
    total = len(VARIANTS) * len(tasks) * seeds if seeds else None
    return Run(folder, "table3", TABLE3_RECIPE, config, cells, total, command)


def length_row_id(row: dict[str, Any]) -> str:
    """The store id of an eval-lm row: a hash of what determines its numbers (the pretraining run or
    model it scores, its label, rescaling, fixed factor, tokens and lengths), so that the same row
    from two output folders (the plain rope row of every ``--rope-scaling`` folder) is one record."""
    from posattn.experiments.store import content_id

    return content_id({"run": row.get("run") or Path(row["model"]).name, "label": row["label"],
                       "rope_scaling": row.get("rope_scaling"), "fixed_factor": row.get("fixed_factor"),
                       "tokens": row.get("tokens"), "lengths": sorted(int(n) for n in row["valid_loss"])})


def _lengths(folder: Path) -> Run:
    from posattn.pretrain.lm_eval import LENGTHS

    path = folder / LENGTHS
    rows = read_json(path)
    if not isinstance(rows, list) or not rows:
        raise PositionError(f"{path}: not eval-lm rows (a non-empty list)")
    rows = [_mapping(r, path, ("label", "model", "kind", "train_length", "valid_loss", "valid_perplexity", "tokens"))
            for r in rows]
    recipes = sorted({str(r["run"]).rpartition("/")[0] or str(r["run"]) for r in rows if r.get("run")})
    if len(recipes) > 1:
        raise PositionError(f"{folder}: rows of several pretraining recipes ({', '.join(recipes)}); "
                            f"evaluate each recipe into its own folder")
    models = list(dict.fromkeys(str(Path(r["model"]).parent if Path(r["model"]).name == "model" else r["model"])
                                for r in rows))
    first = rows[0]
    lengths = sorted({int(n) for r in rows for n in r["valid_loss"]})
    scaling = next((r for r in rows if r.get("rope_scaling")), None)
    command = (f"posattn eval-lm {' '.join(map(shlex.quote, models))} --lengths {' '.join(map(str, lengths))} "
               f"--tokens {first['tokens']}"
               + (f" --rope-scaling {scaling['rope_scaling']}" if scaling else "")
               + (f" --factor {scaling['fixed_factor']:g}" if scaling and scaling.get("fixed_factor") else "")
               + f" --out {shlex.quote(str(folder))}")
    cells = {length_row_id(r): r for r in rows}
    recipe = recipes[0] if recipes else folder.name
    return Run(folder, "eval-lm", recipe, {"name": recipe}, cells, len(cells), command, first.get("device"))
