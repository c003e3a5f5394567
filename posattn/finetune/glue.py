"""GLUE task files exactly as the official download lays them out (``download_glue_data.py``).

``--glue-dir DIR`` points at that folder (``DIR/CoLA/train.tsv``, ``DIR/MNLI/dev_matched.tsv``, ...);
nothing is downloaded. Files are tab-separated with no quoting. CoLA has no header and four
columns (source, label, original label, sentence); every other file has a header row and its
columns are found by name. The test files carry no labels (GLUE keeps them private), so the
official *dev* sets are the scored sets here, as in the dev-set tables of Chang et al. (Table 6),
TISA (Table 3) and DIET (Table 2); early stopping uses a fixed slice of the training file
(:data:`VALID_FRACTION`, at most :data:`VALID_MAX` examples), never the scored set.

A line with the wrong number of columns, an unknown label, text that is not UTF-8, a field
beyond the csv module's size limit, a missing file or an empty file raises
:class:`~posattn.finetune.tasks.TaskError` naming the file and line.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from .tasks import GLUE, Example, TaskData, TaskError, cap, label_id

VALID_FRACTION = 0.1
VALID_MAX = 2000


@dataclass(frozen=True)
class Layout:
    """Where a GLUE task's files are and which columns hold the texts and the label."""

    folder: str
    a: str | int
    b: str | int | None
    label: str | int
    eval_files: dict[str, str]
    header: bool = True
    n_columns: int | None = None      # files without a header: the fixed column count


LAYOUTS = {
    "cola": Layout("CoLA", 3, None, 1, {"test": "dev.tsv"}, header=False, n_columns=4),
    "sst2": Layout("SST-2", "sentence", None, "label", {"test": "dev.tsv"}),
    "mrpc": Layout("MRPC", "#1 String", "#2 String", "Quality", {"test": "dev.tsv"}),
    "stsb": Layout("STS-B", "sentence1", "sentence2", "score", {"test": "dev.tsv"}),
    "qqp": Layout("QQP", "question1", "question2", "is_duplicate", {"test": "dev.tsv"}),
    "mnli": Layout("MNLI", "sentence1", "sentence2", "gold_label",
                   {"m": "dev_matched.tsv", "mm": "dev_mismatched.tsv"}),
    "qnli": Layout("QNLI", "question", "sentence", "label", {"test": "dev.tsv"}),
    "rte": Layout("RTE", "sentence1", "sentence2", "label", {"test": "dev.tsv"}),
    "wnli": Layout("WNLI", "sentence1", "sentence2", "label", {"test": "dev.tsv"}),
}


def read_file(name: str, path: Path) -> list[Example]:
    """Every example of one GLUE file of task ``name``; TaskError naming the file and line."""
    task, layout = GLUE[name], LAYOUTS[name]
    if not path.is_file():
        raise TaskError(f"{path}: no such file (expected the official GLUE layout: "
                        f"{layout.folder}/train.tsv, {layout.folder}/{', '.join(layout.eval_files.values())})")
    rows = [(i + 1, row) for i, row in enumerate(_rows(path)) if row]
    columns: dict[str | int, int] = {}
    n_columns = layout.n_columns
    if layout.header:
        if not rows:
            raise TaskError(f"{path}: empty file (no header row)")
        header = rows.pop(0)[1]
        n_columns = len(header)
        wanted = [c for c in (layout.a, layout.b, layout.label) if c is not None]
        missing = [c for c in wanted if c not in header]
        if missing:
            raise TaskError(f"{path}:1: header lacks column(s) {', '.join(map(repr, missing))}; "
                            f"found {', '.join(header)}")
        columns = {c: header.index(c) for c in wanted}
    else:
        columns = {c: c for c in (layout.a, layout.b, layout.label) if isinstance(c, int)}
    if not rows:
        raise TaskError(f"{path}: no examples")
    examples = []
    for line, row in rows:
        where = f"{path}:{line}"
        if len(row) != n_columns:
            raise TaskError(f"{where}: {len(row)} tab-separated columns, expected {n_columns}")
        a = row[columns[layout.a]]
        b = row[columns[layout.b]] if layout.b is not None else None
        examples.append(Example(a, b, label_id(task, row[columns[layout.label]], where), f"{a}\t{b}"))
    return examples


def _rows(path: Path) -> list[list[str]]:
    """The tab-separated rows of ``path`` (one per line: the files are unquoted); TaskError naming the
    line that is not UTF-8 text or holds a field beyond the csv module's limit."""
    rows: list[list[str]] = []
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
                rows.append(row)
    except UnicodeDecodeError as e:
        line = _first_undecodable(path)
        raise TaskError(f"{path}:{line}: not UTF-8 text ({e.reason}); GLUE files are UTF-8: convert this one "
                        f"(e.g. iconv -f latin1 -t utf-8)") from None
    except csv.Error as e:
        raise TaskError(f"{path}:{len(rows) + 1}: {e}") from None
    return rows


def _first_undecodable(path: Path) -> int:
    """The number of the first line of ``path`` that is not UTF-8."""
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            return number
    return 0


def load_glue(name: str, glue_dir: str | Path, max_train: int | None = None,
              max_eval: int | None = None) -> TaskData:
    """Task ``name`` from ``glue_dir``: training file split into train/valid, the dev file(s) as scored sets."""
    if name not in LAYOUTS:
        raise TaskError(f"unknown GLUE task {name!r}; GLUE tasks: {', '.join(LAYOUTS)}")
    root = Path(glue_dir)
    if not root.is_dir():
        raise TaskError(f"--glue-dir {root}: no such folder")
    layout = LAYOUTS[name]
    folder = root / layout.folder
    everything = read_file(name, folder / "train.tsv")
    valid = cap(f"{name}/valid", everything, max(1, min(VALID_MAX, round(VALID_FRACTION * len(everything)))))
    held = set(valid)
    train = [ex for ex in everything if ex not in held]
    if not valid or not train:
        raise TaskError(f"{folder / 'train.tsv'}: {len(everything)} example(s) are too few to hold out a "
                        f"validation slice for early stopping")
    data = TaskData(GLUE[name], cap(name, train, max_train), cap(name, valid, max_eval),
                    {k: cap(name, read_file(name, folder / f), max_eval) for k, f in layout.eval_files.items()})
    data.notes.append(f"scored on the official dev set(s); early stopping on {len(data.valid)} held-out "
                      f"training examples")
    return data
