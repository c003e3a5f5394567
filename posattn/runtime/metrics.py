"""Where a run's metrics go: one JSON-lines file that is the record, and optional mirrors.

Every row is a flat mapping with a ``step`` (training rows: loss, learning rate, speed;
evaluation rows: held-out metrics). :class:`MetricsLog` appends each row to ``metrics.jsonl``,
the file reports and plots are made from, and hands it to the mirrors chosen with ``--log-to``:

- ``tensorboard``: scalars under ``<run folder>/tensorboard`` (needs the ``tensorboard``
  package: ``pip install 'posattn[tensorboard]'``), viewed with ``tensorboard --logdir``.

A resumed run first cuts the file back to its checkpoint's step (:meth:`MetricsLog.resume`): a
run killed after its last checkpoint logged steps it will train again, and they are not kept twice.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posattn.errors import PositionError
from posattn.runtime.files import write_text_atomic

METRICS = "metrics.jsonl"
MIRRORS = ("tensorboard",)


class _TensorBoard:
    """Scalars of every row, keyed by the row's step, in ``folder/tensorboard``."""

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise PositionError("--log-to tensorboard needs the tensorboard package: "
                                "pip install 'posattn[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=str(folder / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def check_mirrors(names: Sequence[str]) -> list[str]:
    """``names`` if each is a known mirror, else one PositionError naming the valid ones."""
    unknown = [n for n in names if n not in MIRRORS]
    if unknown:
        raise PositionError(f"--log-to: unknown destination {', '.join(unknown)}; choose from {', '.join(MIRRORS)}")
    return list(names)


class MetricsLog:
    """The metrics of one run: ``folder/metrics.jsonl`` plus the ``mirrors`` (see the module).

    ``folder=None`` keeps the rows in memory only (:attr:`rows`), for runs without a folder."""

    def __init__(self, folder: str | Path | None, mirrors: Sequence[str] = ()) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.path = self.folder / METRICS if self.folder is not None else None
        if check_mirrors(mirrors) and self.folder is None:
            raise PositionError("--log-to needs a run folder to write into")
        self.mirrors = [_TensorBoard(self.folder) for name in mirrors if name == "tensorboard"]
        self.rows: list[dict[str, Any]] = []

    def resume(self, upto: int) -> list[dict[str, Any]]:
        """Keep the rows of steps ≤ ``upto`` (the checkpoint's step), in the file too; return them."""
        rows = []
        if self.path is not None and self.path.exists():
            rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            rows = [r for r in rows if r["step"] <= upto]
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in rows))
        self.rows = rows
        return rows

    def write(self, row: dict[str, Any]) -> None:
        """Record ``row`` (it must carry a ``step``) in the file and every mirror."""
        self.rows.append(row)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        for mirror in self.mirrors:
            mirror.write(row)

    def close(self) -> None:
        for mirror in self.mirrors:
            mirror.close()
