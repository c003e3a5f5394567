"""Synthetic recall and copying tasks (CAT paper; MQAR layout of Zoology).

Every generator is deterministic given its seed and returns a :class:`TaskData` of
``inputs`` and ``labels`` (both ``LongTensor [n, length]``). Labels follow next-token
prediction: ``labels[:, t]`` is what the model must emit after reading ``inputs[:, :t+1]``,
and ``IGNORE`` (-100) where no prediction is scored.

Token layout of the recall tasks (``mqar``, ``mqnar``, ``ar``, ``nar``), for vocabulary ``V``:
token 0 is filler, keys come from ``[1, V/2)``, values from ``[V/2, V)``. The context holds
``D`` blocks ``key value`` (a key is ``ngram`` tokens), with no key or value repeated in a
sequence. ``mqar``/``mqnar`` then query every key once, at offsets ``C + (ngram+1)·g`` after
the context of ``C`` tokens, with distinct gaps ``g`` drawn with probability
``∝ (g+1)^(a-1)`` (Zoology, ``a = 0.01``); ``ar``/``nar`` query one key, at the very end.
The label sits on the last token of a query and is its value.

``selective_copy``: token 0 is noise, 1 the separator, content tokens come from ``[2, V)``.
``K`` content tokens sit at random positions of a noisy context of ``length - K`` tokens;
after the separator the model emits them in order (teacher forced: the input after the
separator is the content shifted by one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from posattn.errors import PositionError

IGNORE = -100
SPLITS = ("train", "valid", "test")
TASK_PARAMS: dict[str, dict[str, object]] = {
    "mqar": {"num_kv_pairs": 4, "power_a": 0.01, "random_filler": False},
    "mqnar": {"num_kv_pairs": 4, "ngram": 2, "key_alphabet": None, "power_a": 0.01, "random_filler": False},
    "ar": {"num_kv_pairs": None, "random_filler": False},
    "nar": {"num_kv_pairs": None, "ngram": 2, "key_alphabet": None, "random_filler": False},
    "selective_copy": {"num_tokens": 8},
}
"""Each task's keyword options and their defaults (``num_kv_pairs=None``: fill the context)."""
TASKS = tuple(TASK_PARAMS)
_CHUNK = 4096  # rows per vectorized block when sampling query gaps


class TaskError(PositionError):
    """A task cannot be generated with the requested parameters."""


@dataclass(frozen=True)
class TaskData:
    """A batch of examples: ``inputs`` and ``labels``, both ``LongTensor [n, length]``."""

    inputs: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.inputs.shape[0]

    @property
    def length(self) -> int:
        return self.inputs.shape[1]


def _rng(seed: int, split: str, length: int) -> np.random.Generator:
    """Independent stream per (seed, split, length): train/valid/test never share one."""
    if split not in SPLITS:
        raise TaskError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(SPLITS.index(split), length)))


def _distinct_rows(rng: np.random.Generator, n: int, population: int, k: int) -> np.ndarray:
    """``[n, k]`` integers from ``[0, population)``, distinct within each row."""
    if not n:
        return np.zeros((0, k), np.int64)
    return np.stack([rng.choice(population, size=k, replace=False) for _ in range(n)])


def _power_law_gaps(rng: np.random.Generator, n: int, space: int, k: int, power_a: float) -> np.ndarray:
    """``[n, k]`` distinct gaps from ``[0, space)`` drawn without replacement, ``p(g) ∝ (g+1)^(a-1)``.

    Gumbel top-k gives the same law (including the draw order) as sequential sampling
    without replacement, i.e. ``np.random.choice(space, k, replace=False, p=p)`` per row.
    """
    logp = (power_a - 1.0) * np.log(np.arange(1, space + 1, dtype=np.float64))
    out = np.empty((n, k), dtype=np.int64)
    for start in range(0, n, _CHUNK):
        rows = min(_CHUNK, n - start)
        scores = logp + rng.gumbel(size=(rows, space))
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
        out[start:start + rows] = np.take_along_axis(top, order, axis=1)
    return out


def recall(n: int, length: int, vocab_size: int, seed: int, *, split: str = "train",
           num_kv_pairs: int | None = 4, ngram: int = 1, key_alphabet: int | None = None,
           multi_query: bool = True, power_a: float = 0.01, random_filler: bool = False) -> TaskData:
    """Associative recall in all four variants (see the module docstring for the layout).

    ``num_kv_pairs=None`` fills the context (single-query tasks only). ``key_alphabet``
    restricts N-gram key tokens to ``[1, key_alphabet]`` so that single tokens are shared
    between keys and only the whole N-gram identifies one.
    """
    if ngram < 1:
        raise TaskError(f"ngram must be >= 1, got {ngram}")
    block = ngram + 1
    if num_kv_pairs is None:
        if multi_query:
            raise TaskError("num_kv_pairs=None (fill the context) is only defined for single-query tasks (ar, nar)")
        num_kv_pairs = (length - ngram) // block
    pairs = num_kv_pairs
    key_space = vocab_size // 2 - 1
    alphabet = key_space if key_alphabet is None else key_alphabet
    if pairs < 1:
        raise TaskError(f"length {length} holds no key-value pair (ngram={ngram})")
    if not 1 <= alphabet <= key_space:
        raise TaskError(f"key_alphabet must be in [1, {key_space}] for vocab_size {vocab_size}, got {alphabet}")
    if alphabet ** ngram < pairs:
        raise TaskError(f"{pairs} pairs need {pairs} distinct keys but only {alphabet ** ngram} exist "
                        f"(key alphabet {alphabet}, ngram {ngram}): raise vocab_size or key_alphabet, "
                        f"or lower num_kv_pairs")
    if vocab_size - vocab_size // 2 < pairs:
        raise TaskError(f"{pairs} distinct values need vocab_size >= {2 * pairs}, got {vocab_size}")
    context = pairs * block
    rng = _rng(seed, split, length)

    codes = _distinct_rows(rng, n, alphabet ** ngram, pairs)                       # [n, D]
    digits = alphabet ** np.arange(ngram - 1, -1, -1)
    keys = (codes[..., None] // digits) % alphabet + 1                             # [n, D, ngram]
    values = _distinct_rows(rng, n, vocab_size - vocab_size // 2, pairs) + vocab_size // 2
    inputs = np.zeros((n, length), dtype=np.int64)
    labels = np.full((n, length), IGNORE, dtype=np.int64)
    inputs[:, :context] = np.concatenate([keys, values[..., None]], axis=2).reshape(n, context)

    if multi_query:
        space = (length - context) // block
        if space < pairs:
            raise TaskError(f"length {length} is too short for {pairs} queries after a context of {context} tokens "
                            f"(needs >= {context + pairs * block})")
        starts = context + block * _power_law_gaps(rng, n, space, pairs, power_a)   # [n, D]
        query_keys = keys
        label_values = values
    else:
        if context + ngram > length:
            raise TaskError(f"length {length} is too short for {pairs} pairs and one query")
        pick = rng.integers(0, pairs, size=n)
        starts = np.full((n, 1), length - ngram)
        query_keys = keys[np.arange(n), pick][:, None]                              # [n, 1, ngram]
        label_values = values[np.arange(n), pick][:, None]
    if random_filler:
        filler = rng.integers(0, vocab_size, size=(n, length - context))
        inputs[:, context:] = filler
    positions = starts[..., None] + np.arange(ngram)                                # [n, Q, ngram]
    np.put_along_axis(inputs, positions.reshape(n, -1), query_keys.reshape(n, -1), axis=1)
    np.put_along_axis(labels, starts + ngram - 1, label_values, axis=1)
    return TaskData(torch.from_numpy(inputs), torch.from_numpy(labels))


def selective_copy(n: int, length: int, vocab_size: int, seed: int, *, split: str = "train",
                   num_tokens: int = 8) -> TaskData:
    """Selective copying: copy the content tokens of a noisy context, in order, after a separator."""
    k = num_tokens
    context = length - k
    if k < 1:
        raise TaskError(f"num_tokens must be >= 1, got {k}")
    if context < k:
        raise TaskError(f"length {length} is too short for {k} content tokens (needs >= {2 * k})")
    if vocab_size < 3:
        raise TaskError(f"selective_copy needs vocab_size >= 3 (noise, separator, content), got {vocab_size}")
    rng = _rng(seed, split, length)
    content = rng.integers(2, vocab_size, size=(n, k))
    where = np.sort(_distinct_rows(rng, n, context, k), axis=1)
    inputs = np.zeros((n, length), dtype=np.int64)
    labels = np.full((n, length), IGNORE, dtype=np.int64)
    np.put_along_axis(inputs, where, content, axis=1)
    inputs[:, context] = 1
    inputs[:, context + 1:] = content[:, :-1]
    labels[:, context:] = content
    return TaskData(torch.from_numpy(inputs), torch.from_numpy(labels))


def generate(task: str, n: int, length: int, vocab_size: int, seed: int, split: str = "train",
             **params: object) -> TaskData:
    """Generate ``n`` examples of ``task`` at ``length``; ``params`` override ``TASK_PARAMS[task]``."""
    if task not in TASKS:
        raise TaskError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    unknown = sorted(set(params) - set(TASK_PARAMS[task]))
    if unknown:
        raise TaskError(f"unknown parameter(s) {', '.join(unknown)} for task {task}; "
                        f"valid: {', '.join(TASK_PARAMS[task])}")
    merged = {**TASK_PARAMS[task], **params}
    if task == "selective_copy":
        return selective_copy(n, length, vocab_size, seed, split=split, **merged)
    return recall(n, length, vocab_size, seed, split=split, multi_query=task in ("mqar", "mqnar"), **merged)


def drop_overlap(data: TaskData, reference: TaskData) -> TaskData:
    """``data`` without the examples whose inputs also occur in ``reference`` (same length)."""
    if data.length != reference.length:
        return data
    seen = {row.tobytes() for row in reference.inputs.numpy()}
    keep = [i for i, row in enumerate(data.inputs.numpy()) if row.tobytes() not in seen]
    return TaskData(data.inputs[keep], data.labels[keep])
