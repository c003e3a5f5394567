"""The config layer shared by every sweep (``compare``, ``finetune``, ``pretrain`` recipes).

:class:`ConfigError` is the one error a bad config raises, whichever command reads it; :func:`load_config`
reads a raw config (a YAML path, a built-in name from a package's ``configs/`` folder, a dict or None for
the default) and :func:`is_int` is the integer check the validators share.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from posattn.errors import PositionError


class ConfigError(PositionError):
    """A config (compare sweep, fine-tuning suite or pretraining recipe) is invalid; the message lists
    every problem found."""


def is_int(value: Any, low: int = 1) -> bool:
    """``value`` is an integer (not a bool) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def builtin_configs(package: str) -> list[str]:
    """Names of the configs shipped in ``<package>/configs`` (file names without ``.yaml``)."""
    folder = resources.files(package) / "configs"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_config(source: str | Path | dict | None, *, package: str, default: str,
                keys: tuple[str, ...]) -> dict[str, Any]:
    """A raw config from a YAML path, a built-in name of ``package`` (see :func:`builtin_configs`), a dict
    or ``None`` (the built-in ``default``); a file's config is named by its stem unless it names itself.
    ``keys`` are the valid top-level keys, named when the top level is not a mapping; problems raise
    :class:`ConfigError`."""
    if isinstance(source, dict):
        return dict(source)
    name = default if source is None else str(source)
    path = Path(name)
    if path.is_file():
        text, stem = path.read_text(), path.stem
    elif name.removesuffix(".yaml") in builtin_configs(package):
        stem = name.removesuffix(".yaml")
        text = (resources.files(package) / "configs" / f"{stem}.yaml").read_text()
    else:
        raise ConfigError(f"config {name!r} is neither a file nor a built-in config; "
                          f"built-in configs: {', '.join(builtin_configs(package))}")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config {name}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {name}: the top level must be a mapping of keys ({', '.join(keys)})")
    raw.setdefault("name", stem)
    return raw
