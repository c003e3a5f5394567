"""A tokenised corpus on disk: token ids memory-mapped, nanoGPT style, tokenised once.

Layout of a corpus folder (``posattn corpus`` writes it, training only reads it):

    meta.json                  sources, tokenizer, sizes and a fingerprint of the token ids
    tokenizer.json             the tokenizer (trained on the train split only, or the one given)
    {split}.tokens.bin         token ids (uint16 when the vocabulary fits, else uint32);
                               each document's sentences back to back, then one [SEP]
    {split}.sentences.npy      int64 [S, 2]: start and end offset of every sentence
    {split}.documents.npy      int64 [D + 1]: index of every document's first sentence, then S

for split in ``train`` and ``valid`` (documents are split by :func:`.sources.split_of`; held-out
documents are never written). Masked-LM instances are cut at sentence boundaries inside one
document; causal-LM windows read the token stream, where [SEP] ends each document.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..errors import PositionError
from ..runtime.folders import replace_folder
from .sources import VALID_FRACTION, Document, sentences, split_of
from .tokenizer import FILENAME, encode, load_tokenizer, special_ids, train_tokenizer

FORMAT = "posattn-corpus"
META = "meta.json"
SPLITS = ("train", "valid")


@dataclass
class Split:
    """One split of a corpus, memory-mapped."""

    tokens: np.ndarray     # [T] token ids
    sentences: np.ndarray  # [S, 2] sentence start and end offsets
    documents: np.ndarray  # [D + 1] first sentence of each document

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class Corpus:
    """A corpus folder opened for reading."""

    folder: Path
    meta: dict
    tokenizer: Tokenizer
    splits: dict[str, Split]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def fingerprint(self) -> str:
        return str(self.meta["fingerprint"])


def build_corpus(documents: list[Document], out: str | Path, tokenizer: str | Path | None = None,
                 kind: str = "wordpiece", vocab_size: int = 8192, description: str = "") -> Corpus:
    """Split ``documents`` by document, train (or load) the tokenizer, tokenise once, write ``out``.

    ``tokenizer``: a ``tokenizer.json`` (or a folder with one) to use instead of training one of
    ``kind`` with ``vocab_size`` entries on the train split. The folder is written to a temporary
    sibling and renamed, so an interrupted build never leaves a half corpus behind. An existing
    ``out`` is replaced only if it is empty or a corpus this function wrote (:func:`check_replaceable`):
    nothing else is ever deleted."""
    out = Path(out)
    check_replaceable(out)
    parts = {split: [d for d in documents if split_of(d) == split] for split in SPLITS}
    empty = [s for s, docs in parts.items() if not any(d.text.strip() for d in docs)]
    if not documents or empty:
        raise PositionError(f"corpus {out}: no text in the {' and '.join(empty or SPLITS)} split "
                            f"({len(documents)} documents given; about {100 * VALID_FRACTION:.0f}% of documents go "
                            f"to validation, so give at least a few dozen)")
    tok = load_tokenizer(tokenizer) if tokenizer else train_tokenizer(
        (d.text for d in parts["train"]), kind, vocab_size)
    specials = special_ids(tok)
    dtype = np.uint16 if tok.get_vocab_size() <= 2 ** 16 else np.uint32
    sizes: dict[str, dict[str, int]] = {}

    def fill(tmp: Path) -> None:
        digest = hashlib.sha1()
        for split, docs in parts.items():
            arrays = _tokenise(docs, tok, specials.sep, dtype)
            for name, array in zip(("tokens.bin", "sentences.npy", "documents.npy"), arrays):
                if name.endswith(".bin"):
                    array.tofile(tmp / f"{split}.{name}")
                else:
                    np.save(tmp / f"{split}.{name}", array)
            digest.update(arrays[0].tobytes())
            sizes[split] = {"documents": len(arrays[2]) - 1, "sentences": len(arrays[1]),
                            "tokens": int(arrays[0].shape[0])}
            if sizes[split]["sentences"] == 0:
                raise PositionError(f"corpus {out}: the {split} split has no sentences")
        tok.save(str(tmp / FILENAME))
        meta = {"format": FORMAT, "description": description, "vocab_size": tok.get_vocab_size(),
                "dtype": np.dtype(dtype).name, "tokenizer": str(tokenizer) if tokenizer else
                {"kind": kind, "vocab_size": vocab_size}, "sources": sorted({d.source for d in documents}),
                "splits": sizes, "fingerprint": digest.hexdigest()[:16]}
        (tmp / META).write_text(json.dumps(meta, indent=2))

    replace_folder(out.resolve(), fill)
    return open_corpus(out)


def corpus_files() -> set[str]:
    """The names of every file a corpus folder holds (:func:`build_corpus` writes exactly these)."""
    return {META, FILENAME, *(f"{split}.{name}" for split in SPLITS
                              for name in ("tokens.bin", "sentences.npy", "documents.npy"))}


def check_replaceable(out: Path) -> None:
    """PositionError unless ``out`` is absent, an empty folder, or a posattn corpus holding nothing but
    its own files: ``posattn corpus --out DIR`` never deletes what it did not write."""
    if not out.exists():
        return
    if not out.is_dir():
        raise PositionError(f"corpus {out}: exists and is not a folder; give a new folder for the corpus")
    if out.resolve() in (Path.cwd(), *Path.cwd().parents):
        raise PositionError(f"corpus {out}: is the working directory or holds it; give a new folder for the corpus")
    names = {p.name for p in out.iterdir()}
    if not names:
        return
    try:
        ours = json.loads((out / META).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        ours = False
    foreign = sorted(names - corpus_files())
    if not ours or foreign:
        what = f"it holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}" if foreign else \
            f"no {META} of format {FORMAT!r}"
        raise PositionError(f"corpus {out}: the folder exists and is not a posattn corpus ({what}); posattn "
                            f"replaces only a corpus it built, so give a new or empty folder; nothing was changed")


def _tokenise(docs: list[Document], tok: Tokenizer, sep: int, dtype: type) -> tuple[np.ndarray, ...]:
    """Token stream (documents end with [SEP]), sentence spans, document starts."""
    per_doc = [sentences(d.text) for d in docs]
    ids = iter(encode(tok, [s for sents in per_doc for s in sents]))
    tokens: list[int] = []
    spans: list[tuple[int, int]] = []
    doc_starts: list[int] = []
    for sents in per_doc:
        doc_starts.append(len(spans))
        for _ in sents:
            piece = next(ids)
            if piece:
                spans.append((len(tokens), len(tokens) + len(piece)))
                tokens.extend(piece)
        tokens.append(sep)
    doc_starts.append(len(spans))
    return (np.asarray(tokens, dtype=dtype), np.asarray(spans, np.int64).reshape(-1, 2),
            np.asarray(doc_starts, np.int64))


def open_corpus(folder: str | Path) -> Corpus:
    """Open a corpus folder written by :func:`build_corpus`; PositionError if it is not one."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        raise PositionError(f"{folder} is not a posattn corpus (no {META}); build one with `posattn corpus`") from None
    except json.JSONDecodeError as e:
        raise PositionError(f"{folder / META} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PositionError(f"{folder / META}: not a posattn corpus (format is not {FORMAT!r})")
    splits = {}
    for split in SPLITS:
        try:
            splits[split] = Split(np.memmap(folder / f"{split}.tokens.bin", dtype=meta["dtype"], mode="r"),
                                  np.load(folder / f"{split}.sentences.npy", mmap_mode="r"),
                                  np.load(folder / f"{split}.documents.npy", mmap_mode="r"))
        except (FileNotFoundError, ValueError) as e:
            raise PositionError(f"corpus {folder}: the {split} split is missing or damaged ({e})") from None
        if splits[split].n_tokens != meta["splits"][split]["tokens"]:
            raise PositionError(f"corpus {folder}: {split}.tokens.bin holds {splits[split].n_tokens} tokens, "
                                f"meta.json says {meta['splits'][split]['tokens']}; rebuild the corpus")
    return Corpus(folder, meta, load_tokenizer(folder / FILENAME), splits)
