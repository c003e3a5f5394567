"""``posattn results add``: copy the finished cells of a run folder into the results store.

Every finished cell becomes ``results/<recipe>/<id>.json`` with its provenance: the date it
finished (where its result records one, else today), the hardware (where the run records its
device, that device's name, else this machine's accelerator or CPU) and the command that ran it
(read from the run folder's config). Ids come from the cells' settings, so cells from any
machine merge by id and a cell already in the store is kept as it is; a cell of another config
left in the folder (one reused for another sweep) is not copied, and the summary names it.
Beside the cells, ``recipe.json`` records the kind of sweep and its config, so that ``posattn report`` can lay out
the recipe's tables; cells of another config under the same recipe name are refused. The rows of
a ``posattn eval-lm`` folder are stored as ``lengths`` records of the pretraining recipe they
evaluate (its ``recipe.json`` is left as it is).

Only small result files are copied; a record that would exceed :data:`store.MAX_BYTES` loses its
per-step ``history`` (the result says so with ``history_dropped``).
"""
from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posattn.errors import PositionError
from posattn.experiments import store
from posattn.experiments.runs import Run, read_run

HEADROOM = 4096   # bytes kept for the record's envelope (recipe, id, provenance) around a result


@dataclass
class Added:
    """What one ``results add`` of a run folder did."""

    recipe: str
    added: int = 0
    present: int = 0
    unfinished: int | None = None
    trimmed: list[str] = field(default_factory=list)   # ids whose history was dropped to fit the cap
    other: list[str] = field(default_factory=list)     # finished cells of another config in the folder

    def __str__(self) -> str:
        left = "an unknown number of" if self.unfinished is None else str(self.unfinished)
        text = (f"{self.recipe}: {self.added} cell(s) added, {self.present} already present, "
                f"{left} unfinished")
        if self.trimmed:
            text += (f"; per-step history dropped from {len(self.trimmed)} record(s) over the store's "
                     f"{store.MAX_BYTES:,}-byte cap: {', '.join(self.trimmed)}")
        if self.other:
            text += (f"; {len(self.other)} finished cell(s) of another config than the folder's config.yaml "
                     f"left out: {', '.join(self.other)}")
        return text


def comparable(sweep: str, config: dict[str, Any]) -> dict[str, Any]:
    """The part of a recipe's config that must agree between machines: settings, not local paths
    (checkpoint and GLUE folders, the cell store, the Table 3 model folder) nor which runs of a
    pretraining recipe a machine happened to train."""
    config = dict(config)
    if sweep == "finetune":
        config["checkpoints"] = [c.get("label") for c in config.get("checkpoints", [])]
        config.pop("glue_dir", None)
        config.pop("cell_store", None)
    elif sweep == "table3":
        config.pop("model", None)
    elif sweep == "pretrain":
        config.pop("labels", None)
    return config


def recipe_result(run: Run) -> dict[str, Any]:
    """The result held by a recipe's ``recipe.json``: the sweep, its config and its cell count."""
    return {"sweep": run.sweep, "config": run.config, "cells_total": run.total}


def _stored_recipe(recipe: str, sweep: str, config: dict[str, Any], what: str, root: str | Path | None,
                   hint: str = "give this run another name with --recipe NAME") -> dict[str, Any] | None:
    """The result of the store's ``recipe.json`` for ``recipe`` (None if there is none); one error,
    ending with ``hint``, if it describes another sweep or config than ``sweep``/``config`` (those
    of ``what``)."""
    path = store.record_path(recipe, store.RECIPE_ID, root)
    if not path.exists():
        return None
    old = store.read_record(path)["result"]
    if old.get("sweep") != sweep or comparable(sweep, old.get("config", {})) != comparable(sweep, config):
        raise PositionError(f"results store: {path.parent} holds cells of another {old.get('sweep')} config named "
                            f"{recipe!r} than {what}; {hint}")
    return old


def stored_cells(recipe: str, sweep: str, config: dict[str, Any], what: str,
                 root: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """The results of the cells of ``recipe`` already in the store, by cell id, for a sweep that
    finishes the recipe's other cells; one error if the store holds another config under this name."""
    config = json.loads(json.dumps(config))   # as the store holds it (JSON)
    hint = "name the sweep differently (name: in its config) or run it without --store"
    if _stored_recipe(recipe, sweep, config, what, root, hint) is None:
        return {}
    return {record["id"]: record["result"] for record in store.load(recipe, root, kind="cell")}


def _publish_recipe(run: Run, recipe: str, prov: dict[str, str], root: str | Path | None) -> None:
    """Write ``recipe.json``, or check that the one there describes the same recipe (and, for a
    pretraining recipe built from parts, add the labels this run folder knows)."""
    new = recipe_result(run)
    old = _stored_recipe(recipe, run.sweep, run.config, str(run.folder), root)
    if old is None:
        store.publish(recipe, store.RECIPE_ID, new, prov, kind="recipe", root=root)
        return
    if run.sweep == "pretrain":
        labels = list(dict.fromkeys([*old["config"].get("labels", []), *run.config["labels"]]))
        if labels != old["config"].get("labels"):
            merged = {**old, "config": {**old["config"], "labels": labels}, "cells_total": len(labels)}
            store.publish(recipe, store.RECIPE_ID, merged, prov, kind="recipe", root=root, replace=True)


def small(result: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``result`` as it fits the store: without its ``history`` if the whole would exceed the cap."""
    size = len(json.dumps(result))
    if size + HEADROOM <= store.MAX_BYTES or "history" not in result:
        return result, False
    trimmed = {k: v for k, v in result.items() if k != "history"}
    trimmed["history_dropped"] = (f"{len(result['history'])} history entries left out: the result was {size:,} "
                                  f"bytes, over the store's cap of {store.MAX_BYTES:,}")
    return trimmed, True


def finish_date(result: dict[str, Any]) -> str | None:
    """The date a cell finished, where its result records one (``finished`` or ``date``, ISO)."""
    for key in ("finished", "date"):
        value = result.get(key)
        if isinstance(value, str):
            try:
                return datetime.date.fromisoformat(value[:10]).isoformat()
            except ValueError:
                continue
    return None


def default_hardware(run: Run) -> str:
    """The run's recorded device's name, else this machine's CUDA device if it has one, else its CPU."""
    import torch

    device = run.device or ("cuda" if torch.cuda.is_available() else None)
    return store.hardware(device)


def add_run(folder: str | Path, recipe: str | None = None, root: str | Path | None = None, *,
            command: str | None = None, hardware: str | None = None) -> Added:
    """Copy every finished cell of the run ``folder`` into the store under ``recipe`` (default: the
    sweep's own name); ``command`` and ``hardware`` replace what the folder says or this machine is."""
    run = read_run(folder)
    recipe = store.check_name(recipe or run.recipe, "recipe")
    base = store.provenance(command or run.command)
    base["hardware"] = hardware or default_hardware(run)
    kind = "lengths" if run.sweep == "eval-lm" else "cell"
    if kind == "cell":
        _publish_recipe(run, recipe, base, root)
    added = Added(recipe, unfinished=None if run.total is None else max(0, run.total - len(run.cells)),
                  other=run.other)
    for cell_id, result in run.cells.items():
        kept, trimmed = small(result)
        prov = {**base, "date": finish_date(result) or base["date"]}
        if store.publish(recipe, cell_id, kept, prov, kind=kind, root=root):
            added.added += 1
            if trimmed:
                added.trimmed.append(cell_id)
        else:
            added.present += 1
    return added
