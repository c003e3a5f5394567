"""Save and load models: ``config.json`` (kind + ModelConfig) and ``model.safetensors``."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from safetensors.torch import load_model, save_model

from ..errors import PositionError
from .transformer import Transformer, build_model

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def save(model: Transformer, folder: str | Path) -> Path:
    """Write the model to ``folder`` (created if needed); shared tensors are stored once."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps({"format": "posattn", **model.config_dict()}, indent=2))
    save_model(model, str(folder / WEIGHTS))
    return folder


def is_checkpoint(folder: str | Path) -> bool:
    """True if ``folder`` holds a posattn checkpoint."""
    cfg = Path(folder) / CONFIG
    return cfg.is_file() and json.loads(cfg.read_text()).get("format") == "posattn"


def load(folder: str | Path) -> Transformer:
    """Rebuild the model from ``folder`` and load its weights exactly."""
    folder = Path(folder)
    if not is_checkpoint(folder):
        raise PositionError(f"{folder} is not a posattn checkpoint (no {CONFIG} with format 'posattn')")
    data = json.loads((folder / CONFIG).read_text())
    data.pop("format")
    model = build_model(data)
    load_model(model, str(folder / WEIGHTS))
    return model


def from_yaml(path: str | Path) -> Transformer:
    """Build a fresh model from a YAML file with the fields of :func:`build_model`."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise PositionError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise PositionError(f"{path}: expected a mapping of model fields")
    return build_model(data)
