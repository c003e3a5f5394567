"""Fixtures: tiny checkpoints written by the tests (Hugging Face BERT format, posattn format)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

D, H, LAYERS, N_POS, VOCAB = 8, 2, 2, 12, 20


def write_bert(folder: Path, seed: int = 0, token_types: bool = True, biases: bool = True,
               model_type: str = "bert", extra: dict | None = None) -> dict[str, np.ndarray]:
    """A BertModel-format checkpoint: config.json + model.safetensors with the tensors the analyses read."""
    rng = np.random.default_rng(seed)
    t = {
        "embeddings.word_embeddings.weight": rng.normal(size=(VOCAB, D)),
        "embeddings.position_embeddings.weight": rng.normal(size=(N_POS, D)),
        "embeddings.LayerNorm.weight": 1 + 0.1 * rng.normal(size=D),
        "embeddings.LayerNorm.bias": 0.1 * rng.normal(size=D),
    }
    if token_types:
        t["embeddings.token_type_embeddings.weight"] = rng.normal(size=(2, D))
    for layer in range(LAYERS):
        for name in ("query", "key"):
            p = f"encoder.layer.{layer}.attention.self.{name}"
            t[p + ".weight"] = rng.normal(size=(D, D)) / np.sqrt(D)
            t[p + ".bias"] = 0.3 * rng.normal(size=D) if biases else np.zeros(D)
    t.update(extra or {})
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.tensor(v, dtype=torch.float32) for k, v in t.items()}, str(folder / "model.safetensors"))
    config = {"model_type": model_type, "hidden_size": D, "num_attention_heads": H, "num_hidden_layers": LAYERS,
              "max_position_embeddings": N_POS, "vocab_size": VOCAB, "layer_norm_eps": 1e-12,
              "type_vocab_size": 2 if token_types else 0, "pad_token_id": 0}
    (folder / "config.json").write_text(json.dumps(config))
    # what the checkpoint holds, as float64 of the stored float32 values
    return {k: torch.tensor(v, dtype=torch.float32).double().numpy() for k, v in t.items()}


@pytest.fixture
def bert_folder(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path / "tiny-bert"
    return folder, write_bert(folder)
