"""Tokenizers: train an uncased WordPiece or Unigram model on a corpus, or load a ``tokenizer.json``.

Hugging Face ``tokenizers`` does the work. Every posattn tokenizer has BERT's five special tokens
(:data:`SPECIALS`); a trained one numbers them 0-4 ([PAD] = 0). A loaded one (e.g. the MiniLM
package's) keeps its own ids, looked up by name. posattn never uses a tokenizer's post-processor:
callers add [CLS]/[SEP] themselves (:func:`encode` returns bare token ids).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ..errors import PositionError

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
KINDS = ("wordpiece", "unigram")
FILENAME = "tokenizer.json"


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens of one tokenizer."""

    pad: int
    unk: int
    cls: int
    sep: int
    mask: int

    def all(self) -> tuple[int, ...]:
        return (self.pad, self.unk, self.cls, self.sep, self.mask)


def train_tokenizer(texts: Iterable[str], kind: str = "wordpiece", vocab_size: int = 8192) -> Tokenizer:
    """An uncased ``kind`` tokenizer with ``vocab_size`` entries trained on ``texts``.

    WordPiece follows BERT (BERT normaliser with lower-casing and accent stripping, BERT
    pre-tokeniser, ``##`` continuation); Unigram follows SentencePiece (lower-casing, ``▁`` word
    boundaries), as Chang et al.'s uncased SentencePiece tokenizer.

    The WordPiece trainer numbers continuation tokens (``##x``) in hash-map order, a different
    order in every process (huggingface/tokenizers#1794), so the same texts gave the same
    vocabulary under different ids, hence different token files and corpus fingerprints. The ids
    are therefore renumbered canonically: the special tokens 0-4, then the rest sorted. WordPiece
    encodes by longest match, so the ids change nothing else."""
    if kind not in KINDS:
        raise PositionError(f"tokenizer kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if vocab_size < len(SPECIALS) + 26:
        raise PositionError(f"vocab_size {vocab_size} is too small (at least {len(SPECIALS) + 26})")
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False)
    else:
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()])
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), unk_token="[UNK]",
                                          show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if kind == "wordpiece":
        vocab = tok.get_vocab()
        order = [*SPECIALS, *sorted(set(vocab) - set(SPECIALS))]
        tok.model = models.WordPiece({t: i for i, t in enumerate(order)}, unk_token="[UNK]")
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json`` file or a folder holding one; checks its special tokens."""
    path = Path(path)
    if path.is_dir():
        path = path / FILENAME
    if not path.is_file():
        raise PositionError(f"{path}: no such tokenizer file")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise PositionError(f"{path}: not a tokenizers JSON file ({e})") from None
    tok.no_padding()
    tok.no_truncation()
    special_ids(tok, str(path))
    return tok


def special_ids(tok: Tokenizer, where: str = "tokenizer") -> SpecialIds:
    """The ids of [PAD], [UNK], [CLS], [SEP], [MASK]; PositionError naming any that is missing."""
    ids = {name: tok.token_to_id(name) for name in SPECIALS}
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise PositionError(f"{where}: missing special token(s) {', '.join(missing)} (posattn needs "
                            f"{', '.join(SPECIALS)})")
    return SpecialIds(*ids.values())


def encode(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (batched in Rust)."""
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
