"""Tiny tokenizer and posattn checkpoints for the transformers integration tests."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import posattn  # noqa: E402
from posattn import Decoder, Encoder, ModelConfig  # noqa: E402
from posattn.text.tokenizer import train_tokenizer  # noqa: E402

TEXT = ["the cat sat on the mat", "a dog ran in the park", "the bird sang a song in the tree",
        "she read the book by the window", "rain fell on the quiet town all night"] * 8


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return TEXT


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(TEXT, vocab_size=120)


def tiny_config(vocab: int, mechanisms: list, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, d_model=16, n_layers=2, n_heads=2, max_len=64, mechanisms=mechanisms, **kw)


@pytest.fixture
def encoder_folder(tmp_path: Path, tokenizer) -> Path:
    """What ``posattn pretrain`` writes: config.json + model.safetensors + tokenizer.json."""
    torch.manual_seed(0)
    model = Encoder(tiny_config(tokenizer.get_vocab_size(), ["absolute", {"name": "tisa", "mode": "supplement"}]))
    folder = posattn.save(model, tmp_path / "enc")
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture
def decoder_folder(tmp_path: Path, tokenizer) -> Path:
    torch.manual_seed(0)
    model = Decoder(tiny_config(tokenizer.get_vocab_size(), ["rope", "alibi"]))
    folder = posattn.save(model, tmp_path / "dec")
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder
