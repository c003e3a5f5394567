"""Files every command writes: atomically, under unique temporary names, inside their folder.

A reader never sees half a file: each write goes to a temporary file with a unique name in the
same folder (so two processes never share one, as ``path.with_suffix(".tmp")`` did) and is then
renamed over the target, which POSIX makes atomic. Names taken from configs (a sweep's ``name``,
a recipe's ``label``) become folder and file names only through :func:`check_name`, so none can
leave the output folder.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from posattn.errors import PositionError

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=,@-]*")


def name_problem(name: Any, what: str) -> str | None:
    """Why ``name`` cannot be one path component, or None if it can (for config validators that
    list every problem at once; :func:`check_name` raises it)."""
    if not isinstance(name, str) or len(name) > 200 or not _SAFE.fullmatch(name):
        return (f"{what} {name!r} cannot name a file or folder: use letters, digits and '._+=,@-', "
                f"starting with a letter or digit (no '/', no '..', at most 200 characters)")
    return None


def check_name(name: Any, what: str) -> str:
    """``name`` if it is safe as one path component (letters, digits and ``. _ + = , @ -``, not
    starting with a dot or dash, at most 200 characters), else one :class:`PositionError`."""
    problem = name_problem(name, what)
    if problem is not None:
        raise PositionError(problem)
    return name


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A uniquely named temporary path beside ``path`` for a writer that needs a file name
    (``torch.save``, safetensors); once the block ends it is flushed to disk and renamed over
    ``path``. If the block raises, the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a uniquely named temporary file in the same folder."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    """:func:`write_bytes_atomic` for UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, obj: Any, indent: int | None = 1) -> None:
    """``obj`` as JSON (keys in insertion order, a final newline), written atomically."""
    write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")
