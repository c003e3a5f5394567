"""Save and load models: ``config.json`` (kind + ModelConfig) and ``model.safetensors``.

``config.json`` also names ``model_type: "posattn"``, so ``transformers``' Auto classes load the
folder directly once :mod:`posattn.hf` is imported."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model

from ..errors import PositionError
from ..experiments.config import read_yaml
from ..runtime.files import atomic_path, write_text_atomic
from .transformer import Transformer, build_model

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def save(model: Transformer, folder: str | Path) -> Path:
    """Write the model to ``folder`` (created if needed); shared tensors are stored once. Each file
    is written atomically (:mod:`posattn.runtime.files`): a reader never sees half of one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # the bytes of config.json key fine-tuning cells (posattn.finetune.run.fingerprint): keep them as they were
    write_text_atomic(folder / CONFIG, json.dumps({"format": "posattn", "model_type": "posattn",
                                                   **model.config_dict()}, indent=2))
    with atomic_path(folder / WEIGHTS) as tmp:
        save_model(model, str(tmp))
    return folder


def read_config(folder: str | Path) -> dict:
    """The checkpoint's config (kind + ModelConfig fields); PositionError if it is not one."""
    path = Path(folder) / CONFIG
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PositionError(f"{folder} is not a posattn checkpoint: no {CONFIG}") from None
    except json.JSONDecodeError as e:
        raise PositionError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != "posattn":
        raise PositionError(f"{folder} is not a posattn checkpoint: {CONFIG} lacks format 'posattn'")
    return {k: v for k, v in data.items() if k not in ("format", "model_type")}


def is_checkpoint(folder: str | Path) -> bool:
    """True if ``folder`` holds a readable posattn checkpoint config."""
    try:
        read_config(folder)
    except PositionError:
        return False
    return True


def load(folder: str | Path) -> Transformer:
    """Rebuild the model from ``folder`` and load its weights exactly."""
    model = build_model(read_config(folder))
    load_weights(model, Path(folder) / WEIGHTS)
    return model


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load the safetensors file ``path`` into ``model`` exactly; PositionError naming the file if it is
    missing, truncated, not a safetensors file, or holds other tensors than the model's."""
    path = weights_file(path)
    try:
        load_model(model, str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a bad file, torch RuntimeError
        raise unreadable_weights(path, e) from None


def weights_file(path: str | Path) -> Path:
    """``path`` as a Path; PositionError if there is no such file."""
    path = Path(path)
    if not path.is_file():
        raise PositionError(f"{path}: no such weights file")
    return path


def check_weights(path: str | Path) -> None:
    """Refuse a safetensors file that cannot be loaded: missing, truncated, not a safetensors file. Only
    its header is read (and checked against the file's size), so a command refuses a damaged
    checkpoint at once, before it writes anything, however large the file."""
    path = weights_file(path)
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a bad file
        raise unreadable_weights(path, e) from None


def unreadable_weights(path: str | Path, error: Exception) -> PositionError:
    """The error for a weights file that cannot be read (truncated, foreign, written for another model)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    return PositionError(f"{path}: unreadable weights ({' '.join(lines)[:300]}); the file may be truncated, not a "
                         f"weights file, or written for another config.json: copy or train it again")


def from_yaml(path: str | Path) -> Transformer:
    """Build a fresh model from a YAML file with the fields of :func:`build_model`."""
    return build_model(read_yaml(path))
