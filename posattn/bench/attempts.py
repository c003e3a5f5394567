"""The GPU command's units that did not finish, remembered from one GPU window to the next.

A measurement stage of :mod:`.gpu_check` runs its units in order (one bench run, one profiled step,
one A/B pair, one throughput setting), and the driver kills the stage at its time box. A unit that
cannot finish inside its box would be the stage's first unit again in every later window, so the
stage would store nothing, window after window (on an H100 on 2026-11-27, five of seven stages
were killed that way in both windows of the day). So every unit is entered in a ledger in the
results store, ``results/gpu_attempts.json``, when it starts and taken out when it ends. An entry
still there was killed, or its run raised or had rows that failed (:meth:`Attempt.fail`), and
:func:`in_turn` runs such units after every unit that never failed, fewest failures first. The
ledger travels back with the store's other new files.

Ledger: ``{"<stage>: <unit>": {"tries": k, "date": "YYYY-MM-DD"}}``, ``k`` the starts that did
not finish. It is one JSON file beside the recipe folders, not a recipe: the store's reports
never read it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from ..errors import PositionError
from ..experiments.store import read_json, results_root, today
from ..runtime.files import write_json_atomic

LEDGER = "gpu_attempts.json"
U = TypeVar("U")


def ledger_path(root: str | Path | None = None) -> Path:
    return results_root(root) / LEDGER


def load(root: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """The ledger ({} when there is none); one error naming the file when it is not a ledger."""
    path = ledger_path(root)
    if not path.exists():
        return {}
    data = read_json(path)
    if not (isinstance(data, dict) and all(isinstance(v, dict) and isinstance(v.get("tries"), int)
                                           for v in data.values())):
        raise PositionError(f"{path}: not a ledger of GPU units ({{\"<stage>: <unit>\": {{\"tries\": k, ...}}}})")
    return data


def _tries(data: dict[str, dict[str, Any]], key: str) -> int:
    return data[key]["tries"] if key in data else 0


def tries(key: str, root: str | Path | None = None) -> int:
    """How often the unit ``key`` started and did not finish."""
    return _tries(load(root), key)


def _save(data: dict[str, dict[str, Any]], root: str | Path | None) -> None:
    path = ledger_path(root)
    if data:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, dict(sorted(data.items())))
    elif path.exists():
        write_json_atomic(path, {})   # emptied, not deleted: the archive carries the change back


class Attempt:
    """One unit's run: :meth:`fail` keeps its ledger entry although the block ends (a run that
    stored nothing because its rows failed, e.g. a fast-path arm that errors on this device)."""

    def __init__(self) -> None:
        self.failed = False

    def fail(self) -> None:
        self.failed = True


@contextmanager
def running(key: str, root: str | Path | None = None) -> Iterator[Attempt]:
    """Enter ``key`` in the ledger (one more try) while the block runs; a block that ends takes it
    out unless it called :meth:`Attempt.fail`, one that raises or is killed leaves it there."""
    data = load(root)
    data[key] = {"tries": _tries(data, key) + 1, "date": today()}
    _save(data, root)
    attempt = Attempt()
    yield attempt
    if not attempt.failed:
        data = load(root)
        data.pop(key, None)
        _save(data, root)


def in_order(units: Iterable[U], key: Callable[[U], str], root: str | Path | None = None) -> list[U]:
    """``units`` with those that never failed first (in their own order), then by fewest
    unfinished tries (``key(unit)``: its ledger entry)."""
    data = load(root)
    return sorted(units, key=lambda u: _tries(data, key(u)))


def in_turn(stage: str, units: Iterable[U], name: Callable[[U], str],
            root: str | Path | None = None) -> Iterator[tuple[U, Attempt]]:
    """The units of ``stage`` in :func:`in_order`, each with its :class:`Attempt` and in the ledger
    as ``"<stage>: <name>"`` while the caller runs it (the loop body)."""
    def key(unit: U) -> str:
        return f"{stage}: {name(unit)}"

    for unit in in_order(units, key, root):
        with running(key(unit), root) as attempt:
            yield unit, attempt
