"""Resume checkpoints: tensors and plain data only, written atomically, read without running code.

A checkpoint is a dict whose leaves are tensors, strings, numbers, booleans or None, nested in
dicts, lists and tuples: model and optimizer state, RNG state (:mod:`.rng`), step counters and
histories. It is written with ``torch.save`` to a uniquely named temporary file renamed over the
target (:func:`posattn.runtime.files.atomic_path`), so a crash never leaves half a checkpoint and
two writers never share a temporary name. It is read with ``torch.load(weights_only=True)``:
PyTorch's restricted unpickler builds tensors and plain containers only, so a file that carries
any other object (a pickle payload that would run code, e.g. a ``checkpoint.pt`` copied in from
elsewhere) is refused with one :class:`PositionError` before anything in it runs.

:func:`check_config` is the one "written with another config" check of every training loop.
"""
from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from posattn.errors import PositionError
from posattn.runtime.files import atomic_path

CHECKPOINT = "checkpoint.pt"
_SCALARS = (str, int, float, bool, type(None))


def plain_problem(obj: Any, where: str = "checkpoint") -> str | None:
    """Where ``obj`` holds something other than tensors and plain data (None if nowhere). Types are
    matched exactly: a subclass (``numpy.float64`` is a float) would be pickled as itself."""
    if isinstance(obj, torch.Tensor) or type(obj) in _SCALARS:
        return None
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            if type(key) not in (str, int):
                return f"{where} has a key of type {type(key).__name__}"
            if (problem := plain_problem(value, f"{where}[{key!r}]")) is not None:
                return problem
        return None
    if type(obj) in (list, tuple):
        return next((p for i, v in enumerate(obj) if (p := plain_problem(v, f"{where}[{i}]")) is not None), None)
    return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}"


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` (tensors and plain data only: anything else is a bug, raised as TypeError,
    because it could not be loaded back) to ``path`` atomically."""
    problem = plain_problem(state)
    if problem is not None:
        raise TypeError(f"{problem}: a checkpoint holds tensors and plain data only (convert it first)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: str | Path, keys: tuple[str, ...] = ("config",)) -> dict[str, Any]:
    """The checkpoint at ``path``, which must be a dict with ``keys``; anything else (a damaged file,
    or one holding objects other than tensors and plain data, which is never unpickled) gets one
    :class:`PositionError` and the file is left as it is."""
    path = Path(path)
    advice = "move it away to start over; nothing was overwritten"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle, zipfile and torch raise many types for a bad file
        why = ("it holds objects other than tensors and plain data, which posattn never unpickles"
               if isinstance(e, pickle.UnpicklingError) else f"{type(e).__name__}: {e}")
        raise PositionError(f"checkpoint {path} is unreadable ({why}); {advice}") from None
    if not isinstance(state, dict) or not set(keys) <= set(state):
        raise PositionError(f"{path} is not a posattn checkpoint (a mapping with {', '.join(keys)}); {advice}")
    return state


def check_config(saved: Mapping[str, Any], current: Mapping[str, Any], path: str | Path,
                 ignore: tuple[str, ...] = ()) -> None:
    """Refuse to resume from a checkpoint written with other settings: one :class:`PositionError`
    naming every key that differs (old -> new). ``ignore``: keys free to change on resume."""
    names = [*current, *(k for k in saved if k not in current)]
    diff = [f"{k}: {saved.get(k, '(absent)')!r} -> {current.get(k, '(absent)')!r}"
            for k in names if k not in ignore and saved.get(k) != current.get(k)]
    if diff:
        raise PositionError(f"{path} was written with a different config ({'; '.join(diff)}); use another "
                            f"output folder or the original settings; nothing was overwritten")
