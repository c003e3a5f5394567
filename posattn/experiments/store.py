"""The results store: every finished cell as one small JSON file that lives in the repository.

Layout: ``results/<recipe>/<cell id>.json``, one record per cell::

    {"recipe": "cat_fair_mqar", "id": "3f2a9c0d1e2b", "kind": "cell",
     "provenance": {"date": "2026-11-26", "hardware": "NVIDIA H100 80GB HBM3", "command": "posattn compare ...",
                    "posattn": "0.1.0"},
     "result": {...the cell's result record, as the sweep wrote it...}}

``kind`` is ``"cell"`` for a cell's own result, ``"summary"`` for a table whose cells are gone,
recorded once with its provenance until its cells are re-run, ``"lengths"`` for a ``posattn
eval-lm`` row (a trained model's perplexity at every evaluation length, which extends its
pretraining recipe's report), and ``"recipe"`` for the one record
``recipe.json`` that says what the recipe is (the kind of sweep, its config and how many cells it
has in all), from which ``posattn report`` lays out its tables. Cell ids come from the cell's
content (its settings), so the same cell run on any machine has the same id: records from
several machines merge by copying files, and :func:`publish` keeps the record already there.
No checkpoints or large files: a record over :data:`MAX_BYTES` is refused.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

from posattn.errors import PositionError
from posattn.runtime.files import check_name, write_json_atomic

ROOT_ENV = "POSATTN_RESULTS"
KINDS = ("cell", "summary", "recipe", "lengths")
RECIPE_ID = "recipe"
MAX_BYTES = 1 << 20  # one record; the store holds results, not models


def content_id(settings: Any) -> str:
    """A record's id: a short stable hash of the settings that determine its result (JSON with
    sorted keys, SHA-1, 12 hex digits), so the same cell run anywhere has the same id."""
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def results_root(root: str | Path | None = None) -> Path:
    """The store's folder: ``root``, else ``$POSATTN_RESULTS``, else ``results`` in the working directory."""
    return Path(root if root is not None else os.environ.get(ROOT_ENV, "results"))


def hardware(device: Any = None) -> str:
    """A short description of the machine a result was measured on: the GPU's name for a CUDA
    device, else the CPU model and its core count."""
    import torch

    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def today() -> str:
    """Today's date (UTC), as the store's records and ledgers write it."""
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def provenance(command: str, device: Any = None, date: str | None = None) -> dict[str, str]:
    """Where a number comes from: the date (UTC), the hardware and the command that made it."""
    from posattn import __version__

    return {"date": date or today(),
            "hardware": hardware(device), "command": command, "posattn": __version__}


def record_path(recipe: str, cell_id: str, root: str | Path | None = None) -> Path:
    """Where the record of ``cell_id`` of ``recipe`` lives (names checked: nothing leaves the store)."""
    return results_root(root) / check_name(recipe, "recipe") / f"{check_name(cell_id, 'cell id')}.json"


def publish(recipe: str, cell_id: str, result: dict[str, Any], prov: dict[str, str], *,
            kind: str = "cell", root: str | Path | None = None, replace: bool = False) -> bool:
    """Store one record; True if written, False if a record of this id was already there (it is
    kept unless ``replace``: the same id means the same settings, so the first result stands)."""
    if kind not in KINDS:
        raise PositionError(f"results store: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    missing = [k for k in ("date", "hardware", "command") if not prov.get(k)]
    if missing:
        raise PositionError(f"results store: provenance lacks {', '.join(missing)} (date, hardware and command)")
    path = record_path(recipe, cell_id, root)
    if path.exists() and not replace:
        return False
    record = {"recipe": recipe, "id": cell_id, "kind": kind, "provenance": dict(prov), "result": result}
    size = len(json.dumps(record))
    if size > MAX_BYTES:
        raise PositionError(f"results store: the record of {recipe}/{cell_id} is {size:,} bytes, over "
                            f"{MAX_BYTES:,}; the store keeps small results, not models or histories of that size")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    return True


def read_json(path: str | Path) -> Any:
    """A JSON file (a record, or a result file of a run folder); one error naming it if it is not
    readable JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PositionError(f"{path}: not a readable JSON file ({e})") from None


def read_record(path: str | Path) -> dict[str, Any]:
    """One record, checked: a file that is not a store record gets one error naming it."""
    path = Path(path)
    record = read_json(path)
    if not (isinstance(record, dict) and {"recipe", "id", "kind", "provenance", "result"} <= set(record)
            and record["kind"] in KINDS and path.stem == record["id"]):
        raise PositionError(f"results store: {path} is not a store record (keys recipe, id, kind, provenance, "
                            f"result; the file named by its id)")
    return record


def load(recipe: str, root: str | Path | None = None, kind: str | None = None) -> list[dict[str, Any]]:
    """Every record of ``recipe`` (of one ``kind`` if given), sorted by id; [] if there are none."""
    folder = results_root(root) / check_name(recipe, "recipe")
    records = [read_record(p) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    return [r for r in records if kind is None or r["kind"] == kind]


def recipes(root: str | Path | None = None) -> list[str]:
    """The recipes that have at least one record."""
    base = results_root(root)
    return sorted(p.name for p in base.iterdir() if p.is_dir() and any(p.glob("*.json"))) if base.is_dir() else []
