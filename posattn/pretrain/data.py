"""Pretraining batches from a tokenised corpus, a pure function of (seed, step).

Masked LM (Devlin et al. 2019, as Chang et al. §A.1: sentence pairs, no next-sentence
prediction): each epoch cuts every document into instances ``[CLS] A [SEP] B [SEP]`` of whole
consecutive sentences filling the max length (10% of them shorter, as BERT), A/B split at a
random sentence boundary, segment ids 0/1; instances are shuffled. Each token other than the
special ones is chosen with probability 15%; a chosen token becomes [MASK] (80%), a random
ordinary token (10%) or stays (10%); labels are -100 elsewhere.

Causal LM: the token stream (documents separated by [SEP]) in windows of ``n + 1`` tokens at an
epoch-dependent offset, shuffled; inputs are the first n, targets the last n. With ``pack``
(``pack_documents`` in the config) each window also carries the document of each input token
(:func:`window_documents`), so the model keeps the documents of a window apart.

Every random choice is seeded by ``(seed, epoch)`` or ``(seed, step)``, so the global batch of a
step is the same whatever the number of processes, micro-batches or restarts: a rank takes its
slice of it (:meth:`Batch.shard`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from ..errors import PositionError
from ..text.corpus import Split
from ..text.tokenizer import SpecialIds

IGNORE = -100
SHORT_PROB = 0.1


@dataclass
class Batch:
    """Tensors of one (global or per-rank) batch; ``labels`` is IGNORE where nothing is scored;
    ``document_ids`` the document of each token of a packed row (None: nothing packed)."""

    input_ids: Tensor
    labels: Tensor
    segment_ids: Tensor
    attention_mask: Tensor
    document_ids: Tensor | None = None

    def shard(self, index: int, count: int) -> Batch:
        """The ``index``-th of ``count`` equal consecutive slices along the batch."""
        size = self.input_ids.shape[0] // count
        return Batch(*(None if (t := getattr(self, f.name)) is None else t[index * size:(index + 1) * size]
                       for f in fields(self)))

    def to(self, device: torch.device) -> Batch:
        return Batch(*(None if (t := getattr(self, f.name)) is None else t.to(device, non_blocking=True)
                       for f in fields(self)))

    @property
    def targets(self) -> int:
        return int((self.labels != IGNORE).sum())


def window_documents(input_ids: Tensor, sep: int) -> Tensor:
    """Document ids [b, n] of causal-LM windows of the token stream, where [SEP] ends each
    document (:mod:`posattn.text.corpus`): a [SEP] is the last token of its document and the
    next document starts at the token after it. Ids count the [SEP]s before each token in its
    window (0 for the window's first, possibly cut, document). The target of a [SEP] input, the
    next document's first token, stays scored: predicted from the document the [SEP] ends, as an
    end-of-text token is in GPT-style packing."""
    ends = (input_ids == sep).long()
    return ends.cumsum(-1) - ends


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([abs(k) for k in key])


def mlm_instances(split: Split, length: int, rng: np.random.Generator) -> np.ndarray:
    """Instances [N, 4] (A start, A end, B start, B end) in token offsets, BERT-style packing."""
    target_max = length - 3
    spans, docs = np.asarray(split.sentences), np.asarray(split.documents)
    out: list[tuple[int, int, int, int]] = []

    def draw_target() -> int:  # BERT: 10% of instances get a random shorter target length
        return target_max if rng.random() >= SHORT_PROB else int(rng.integers(2, target_max + 1))

    for d in range(len(docs) - 1):
        first, last = int(docs[d]), int(docs[d + 1])
        target = draw_target()
        chunk: list[int] = []
        size = 0
        for s in range(first, last):
            chunk.append(s)
            size += int(spans[s, 1] - spans[s, 0])
            if size >= target or s == last - 1:
                cut = int(rng.integers(1, len(chunk))) if len(chunk) > 1 else 1
                a0, a1 = int(spans[chunk[0], 0]), int(spans[chunk[cut - 1], 1])
                b0, b1 = (int(spans[chunk[cut], 0]), int(spans[chunk[-1], 1])) if cut < len(chunk) else (a1, a1)
                out.append(_truncate(a0, a1, b0, b1, target_max))
                chunk, size = [], 0
                target = draw_target()
    return np.asarray(out, np.int64).reshape(-1, 4)


def _truncate(a0: int, a1: int, b0: int, b1: int, budget: int) -> tuple[int, int, int, int]:
    """Drop tokens from the end of the longer segment until both fit in ``budget``."""
    while (a1 - a0) + (b1 - b0) > budget:
        if a1 - a0 >= b1 - b0:
            a1 -= 1
        else:
            b1 -= 1
    return a0, a1, b0, b1


class Batches:
    """The global batch of any step for one objective, split and sequence length."""

    def __init__(self, split: Split, objective: str, length: int, batch_size: int, seed: int,
                 specials: SpecialIds, vocab_size: int, mask_prob: float = 0.15, pack: bool = False) -> None:
        if pack and objective != "clm":
            raise PositionError(f"packing documents needs the causal-LM objective (clm), got {objective}: "
                                f"masked-LM instances are sentence pairs of one document already")
        self.split, self.objective, self.length, self.batch_size = split, objective, length, batch_size
        self.pack = pack
        self.seed, self.specials, self.vocab_size, self.mask_prob = seed, specials, vocab_size, mask_prob
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.ordinary = np.setdiff1d(np.arange(vocab_size), specials.all())  # random replacements draw from these

    @classmethod
    def evaluation(cls, split: Split, objective: str, length: int, specials: SpecialIds, vocab_size: int,
                   mask_prob: float = 0.15, pack: bool = False) -> Batches:
        """Fixed held-out batches: units in corpus order (no shuffling), masks seeded per batch."""
        return cls(split, objective, length, 1, 0, specials, vocab_size, mask_prob, pack)

    def fixed(self, sequences: int, batch_size: int) -> list[Batch]:
        """The first ``sequences`` units of epoch 0 in corpus order, in batches (for evaluation)."""
        units = self.epoch_plan(0)[0][:sequences]
        out = []
        for i in range(0, len(units), batch_size):
            rows = units[i:i + batch_size]
            out.append(self.windows(rows) if self.objective == "clm" else self.pairs(rows, _rng(self.seed, i, 3))[0])
        return out

    def epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(units, order) of ``epoch``: MLM instances or window starts, and their shuffled order."""
        if epoch not in self._plans:
            rng = _rng(self.seed, epoch, 1)
            if self.objective == "mlm":
                units = mlm_instances(self.split, self.length, rng)
            else:
                offset = int(rng.integers(0, self.length)) if epoch else 0
                units = np.arange(offset, self.split.n_tokens - self.length - 1, self.length, dtype=np.int64)
            keep = {e: self._plans[e] for e in (0, epoch - 1) if e in self._plans}  # epoch 0 sizes the stream
            self._plans = {**keep, epoch: (units, rng.permutation(len(units)))}
        return self._plans[epoch]

    def units_per_epoch(self) -> int:
        """Units of epoch 0; a step's position in the stream counts epochs of this size (a later
        epoch with a different count wraps or leaves its last units unused)."""
        return len(self.epoch_plan(0)[0])

    def indices(self, step: int) -> list[tuple[int, int]]:
        """(epoch, unit) pairs of the ``batch_size`` units of ``step``, epoch after epoch."""
        per_epoch = self.units_per_epoch()
        out = []
        for g in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, k = divmod(g, per_epoch)
            units, order = self.epoch_plan(epoch)
            if k >= len(units):  # a later epoch cut fewer units: wrap inside it
                k %= len(units)
            out.append((epoch, int(order[k])))
        return out

    def batch(self, step: int, rank: int = 0, world: int = 1) -> tuple[Batch, int]:
        """Rank ``rank``'s slice (of ``world`` equal slices) of the global batch of step ``step``,
        and the number of scored tokens in the whole global batch. Only this slice's tokens are read."""
        picks = self.indices(step)
        rows = np.stack([self.epoch_plan(e)[0][u] for e, u in picks])
        size = len(rows) // world
        mine = slice(rank * size, (rank + 1) * size)
        if self.objective == "clm":
            return self.windows(rows[mine]), len(rows) * self.length
        return self.pairs(rows, _rng(self.seed, step, 2), mine)

    def windows(self, starts: np.ndarray) -> Batch:
        """Causal-LM inputs and next-token targets from windows starting at ``starts`` (and the
        inputs' document ids when packing)."""
        index = np.asarray(starts, np.int64)[:, None] + np.arange(self.length + 1)
        block = torch.from_numpy(np.asarray(self.split.tokens[index.ravel()], np.int64).reshape(index.shape))
        ones = torch.ones(len(starts), self.length, dtype=torch.bool)
        inputs = block[:, :-1].contiguous()
        documents = window_documents(inputs, self.specials.sep) if self.pack else None
        return Batch(inputs, block[:, 1:].contiguous(), torch.zeros_like(ones, dtype=torch.long), ones, documents)

    def pairs(self, rows: np.ndarray, rng: np.random.Generator, part: slice = slice(None)) -> tuple[Batch, int]:
        """``[CLS] A [SEP] B [SEP]`` rows padded to the length and masked with ``rng``: the rows of
        ``part`` and the scored-token count of all rows. The layout and the masking draws cover every
        row, so a slice is the same whatever the number of slices."""
        sp = self.specials
        rows = np.asarray(rows, np.int64).reshape(-1, 4)
        a0, la, b0, lb = rows[:, :1], rows[:, 1:2] - rows[:, :1], rows[:, 2:3], rows[:, 3:4] - rows[:, 2:3]
        j = np.arange(self.length)[None, :]
        in_a = (j >= 1) & (j <= la)
        in_b = (j >= la + 2) & (j < la + 2 + lb)
        u = rng.random((2,) + in_a.shape)
        chosen = (u[0] < self.mask_prob) & (in_a | in_b)  # special tokens are never chosen
        replacements = self.ordinary[rng.integers(0, len(self.ordinary), in_a.shape)]
        total = int(chosen.sum())
        a0, la, b0, lb, in_a, in_b, u, chosen, replacements = (
            x[part] for x in (a0, la, b0, lb, in_a, in_b, u.swapaxes(0, 1), chosen, replacements))
        source = np.where(in_a, a0 + j - 1, np.where(in_b, b0 + j - la - 2, 0))
        ids = np.where(in_a | in_b,
                       np.asarray(self.split.tokens[source.ravel()], np.int64).reshape(source.shape), sp.pad)
        ids[:, 0] = sp.cls
        ids[j == la + 1] = sp.sep
        ids[(j == la + 2 + lb) & (lb > 0)] = sp.sep
        seg = ((j >= la + 2) & (j <= la + 2 + lb) & (lb > 0)).astype(np.int64)
        # BERT: a chosen token becomes [MASK] (80%), a random ordinary token (10%) or stays (10%)
        labels = np.where(chosen, ids, IGNORE)
        masked = np.where(chosen & (u[:, 1] < 0.8), sp.mask, ids)
        masked = np.where(chosen & (u[:, 1] >= 0.8) & (u[:, 1] < 0.9), replacements, masked)
        t = torch.from_numpy
        return Batch(t(masked), t(labels), t(seg), t(ids != sp.pad)), total
