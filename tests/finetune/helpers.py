"""Tiny checkpoints for the fine-tuning tests: a WordPiece tokenizer trained on a few sentences and
4-head encoders small enough to train in a second."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import models

import posattn
from posattn.text.tokenizer import SPECIALS, train_tokenizer

SENTENCES = [
    "The dog chased the cat across the old garden.", "A woman saw the man near the river bank.",
    "Shares rose sharply after the bank said profits were strong.", "The film is a slow and dull affair.",
    "What city hosted the first modern games?", "How many players are in a football team?",
    "Win a free phone now, text to claim your prize!", "The government will announce its budget on Monday.",
    "I totally hate the idea of not driving my own car.", "A gorgeous, witty and moving film.",
]


def tokenizer():
    """``train_tokenizer``'s WordPiece pipeline with a fixed vocabulary (the trainer breaks ties
    differently from run to run): the special tokens, then every word and character of
    :data:`SENTENCES` in sorted order, so token ids are the same in every run."""
    tok = train_tokenizer(SENTENCES, vocab_size=300)
    words = {w for s in SENTENCES for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(s))}
    chars = {c for w in words for c in w}
    vocab = [*SPECIALS, *sorted(words | chars | {f"##{c}" for c in chars})]
    tok.model = models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]")
    return tok


def make_checkpoint(folder: Path, mechanisms=("absolute",), kind: str = "encoder", seed: int = 0,
                    max_len: int = 64) -> Path:
    """A saved tiny model + tokenizer.json in ``folder/model``; returns ``folder``."""
    torch.manual_seed(seed)
    cfg = posattn.ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_len=max_len,
                              mechanisms=list(mechanisms))
    model = posattn.Encoder(cfg) if kind == "encoder" else posattn.Decoder(cfg)
    posattn.save(model, folder / "model")
    tokenizer().save(str(folder / "model" / "tokenizer.json"))
    return folder
