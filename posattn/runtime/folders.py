"""Folders written whole: a writer fills a fresh temporary sibling, which then replaces the target.

A reader (a resumed run, ``posattn finetune`` reading a pretraining run's ``model/``) sees the old
folder or the new one, never a half-written one. Only folders the program itself writes (a run's
``model/``, a corpus it built) are ever replaced; checking that is the caller's job.
"""
from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def _sibling(target: Path, tag: str) -> Path:
    return target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.{tag}"


def replace_folder(target: str | Path, fill: Callable[[Path], object]) -> Path:
    """Call ``fill(tmp)`` on an empty temporary folder beside ``target``, then rename it to ``target``
    (the previous ``target``, if any, is moved aside first and removed after). If ``fill`` raises,
    ``target`` is left as it was. Returns ``target``."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(target, "tmp")
    tmp.mkdir()
    try:
        fill(tmp)
        if target.exists():
            old = _sibling(target, "old")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
