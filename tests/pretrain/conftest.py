"""Fixtures: a small synthetic corpus (documents of generated sentences) and tiny run configs."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from posattn.text.corpus import Corpus, build_corpus
from posattn.text.sources import Document

WORDS = ("the cat dog bird sees chases likes a small big red green house tree river near over "
         "under quickly slowly runs sleeps eats and but then").split()


def make_documents(count: int = 160, seed: int = 0) -> list[Document]:
    """Documents of 6-14 sentences of 4-12 random words each."""
    rng = random.Random(seed)
    docs = []
    for d in range(count):
        sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                 for _ in range(rng.randint(6, 14))]
        docs.append(Document("synthetic", str(d), " ".join(sents)))
    return docs


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return build_corpus(make_documents(), tmp_path_factory.mktemp("corpus") / "c", vocab_size=64)


def tiny(corpus: Corpus, **overrides) -> dict:
    """A config dict for a 2-layer d=32 model that trains a few steps in about a second."""
    return {"name": "t", "preset": "mini", "model": {"d_model": 32, "n_heads": 2, "d_ff": 64, "max_len": 32},
            "corpus": str(corpus.folder), "steps": 6, "batch_size": 8, "eval_every": 3, "checkpoint_every": 2,
            "log_every": 1, "eval_sequences": 16, "lr": 3e-3, "dropout": 0.0, **overrides}


def read_weights(folder: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(folder / "model" / "model.safetensors"))
