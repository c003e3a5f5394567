"""The analyses' view of posattn models (``posattn.models``): position tables, F̂_P, the
position-only score term, and the per-mechanism learned structures.

Every model is copied to float64 first, so ranks and profiles are not blurred by float32 round-off.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..attention.terms import QueryRelative
from ..models import Transformer, is_checkpoint, load
from ..models.io import CONFIG, read_config
from .hf import CheckpointError, HFCheckpoint, is_hf_folder, resolve
from .profiles import Profiles

Source = HFCheckpoint | Transformer


def open_source(model: str | Path) -> Source:
    """A posattn checkpoint folder or ``posattn pretrain`` run folder (its ``model/``), a Hugging Face
    checkpoint folder, or ``minilm`` / ``mpnet``."""
    from ..finetune.run import MODEL_DIR

    folder = resolve(model)
    if not (folder / CONFIG).is_file() and (folder / MODEL_DIR / CONFIG).is_file():
        folder = folder / MODEL_DIR   # a `posattn pretrain` run folder, which every command takes
    if is_checkpoint(folder):
        return load(folder).eval()
    if is_hf_folder(folder):
        return HFCheckpoint.open(folder)
    if (folder / CONFIG).is_file():
        read_config(folder)   # says what is wrong with a posattn config.json (not JSON, no format)
    raise CheckpointError(
        f"{folder} is neither a Hugging Face checkpoint (config.json with model_type, and "
        f"model.safetensors or pytorch_model.bin) nor a posattn checkpoint (config.json with format 'posattn')"
    )


def describe(source: Source) -> dict:
    """Name, kind and sizes of a source, for the JSON reports."""
    if isinstance(source, HFCheckpoint):
        return {"source": str(source.folder), "kind": f"hf:{source.model_type}", "n_layers": source.n_layers,
                "n_heads": source.n_heads, "d_model": source.d_model, "head_dim": source.head_dim}
    cfg = source.cfg
    return {"source": "posattn model", "kind": f"posattn:{source.kind}", "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads, "d_model": cfg.d_model, "head_dim": cfg.d_model // cfg.n_heads,
            "mechanisms": [m if isinstance(m, str) else dict(m) for m in cfg.mechanisms]}


def as_float64(model: Transformer) -> Transformer:
    return copy.deepcopy(model).to(torch.float64).eval()


def position_table(model: Transformer, n: int | None = None) -> Tensor:
    """E_P ``[n, d]`` of the model's input position mechanism (any that has a table:
    :meth:`~posattn.mechanisms.base.Mechanism.position_table`)."""
    names = [m.name for m in model.input_mechanisms]
    n = n or model.cfg.max_len
    for m in model.input_mechanisms:
        table = m.position_table(n)
        if table is not None:
            return table
    raise CheckpointError(
        f"this posattn model has no input position embeddings (its mechanisms: "
        f"{', '.join(map(str, model.cfg.mechanisms)) or 'none'}; input-level: {names or 'none'})"
    )


def _check_length(model: Transformer, n: int) -> None:
    if not 1 <= n <= model.cfg.max_len:
        raise CheckpointError(f"asked for {n} positions; the model was built with max_len {model.cfg.max_len}")


@torch.no_grad()
def mean_word_scores(model: Transformer, n: int) -> Tensor:
    """F̂_P ``[L, H, n, n]`` of a posattn model (TISA §3.2): every row of the token embedding replaced
    by the vocabulary mean, then the model's real pre-softmax scores of each layer (its own norms
    and every position mechanism included)."""
    _check_length(model, n)
    m = as_float64(model)
    m.tokens.weight.copy_(m.tokens.weight.mean(0, keepdim=True).expand_as(m.tokens.weight))
    ids = torch.zeros(1, n, dtype=torch.long)
    return torch.stack([s[0] for s in m.score_matrices(ids)])


def posattn_profiles(model: Transformer, n: int | None = None) -> Profiles:
    """F̂_P of a posattn model as :class:`Profiles` (method ``forward``)."""
    n = n or min(model.cfg.max_len, 128)
    return Profiles(mean_word_scores(model, n).numpy(), "posattn model", "forward", True, False)


@torch.no_grad()
def score_matrices64(model: Transformer, input_ids: Tensor) -> list[Tensor]:
    """Pre-softmax scores ``[b, h, n, n]`` per layer, computed in float64."""
    return as_float64(model).score_matrices(input_ids)


@torch.no_grad()
def position_scores(model: Transformer, n: int) -> list[Tensor]:
    """The position-only score term ``[h, n, n]`` of every layer (DIET Fig 8).

    Per layer: Σ of the mechanisms' position-only terms (every structure but the query-relative
    one, which depends on content; segment terms left out), plus, when the model has input position embeddings, the
    content path of the positions alone: q(E_P)·k(E_P)/√d_h with q, k the layer's projections of
    LN(E_P) (DIET's P W_Q W_Kᵀ Pᵀ; the token embeddings are zeroed).
    """
    _check_length(model, n)
    m = as_float64(model)
    m.tokens.weight.zero_()
    ids = torch.zeros(1, n, dtype=torch.long)
    ctx = m.context(ids, None, None, None)
    x = m.embed(ids, ctx)
    content = len(m.input_mechanisms) > 0
    out = []
    for block in m.blocks:
        q, k, _ = block.attn.project(block.ln1(x), ctx)
        s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 if content else torch.zeros(1, q.shape[1], n, n, dtype=q.dtype)
        for mech in block.attn.mechanisms:
            if not mech.positional:  # segment ids, not positions
                continue
            for t in mech.score_terms(q, k, ctx):
                if not isinstance(t, QueryRelative):
                    s = s + t.dense(n)
        out.append(s[0].expand(q.shape[1], n, n))
    return out


def learned_structures(model: Transformer, n: int) -> list[dict]:
    """What each layer's mechanisms learned, as arrays to plot (Chang Fig 2-3, TISA Fig 3, DIET Fig 4/7).

    Items: ``{"layer", "mechanism", "kind", "data"}`` from each mechanism's
    :meth:`~posattn.mechanisms.base.Mechanism.position_structures` (kinds in
    :class:`~posattn.mechanisms.base.Structure`); a mechanism shared across layers is shown once,
    at its first layer.
    """
    _check_length(model, n)
    ids = torch.zeros(1, n, dtype=torch.long)
    ctx = model.context(ids, None, None, None)
    items: list[dict] = []
    seen: set[int] = set()
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            for mech in block.attn.mechanisms:
                if id(mech) in seen:
                    continue
                seen.add(id(mech))
                items += [{"layer": layer, "mechanism": s.label, "kind": s.kind,
                           "data": np.ascontiguousarray(s.data.numpy())} for s in mech.position_structures(n, ctx)]
    return items
