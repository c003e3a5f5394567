"""Examples to model inputs: BERT's input format, longest-first truncation, length-sorted batches.

A single sentence becomes ``[CLS] a [SEP]`` with segment ids 0…0; a pair ``[CLS] a [SEP] b [SEP]``
with segment ids 0…0 1…1 (Devlin et al. 2019). Inputs longer than ``max_len`` tokens are cut
*longest first* (a token from the end of the longer text at a time, as BERT's
``truncate_seq_pair``) for every model alike, so all mechanisms see the same tokens; the number
of truncated examples is reported. Evaluation batches hold examples of similar length
(sorted by length), so almost no padding is computed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from torch import Tensor

from ..text.tokenizer import SpecialIds, encode, special_ids
from .tasks import Example, Task


@dataclass
class Encoded:
    """Token ids (specials included), segment ids and labels of a list of examples."""

    ids: list[list[int]]
    segments: list[list[int]]
    labels: Tensor
    pad: int
    truncated: int

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> list[int]:
        return [len(x) for x in self.ids]

    def batch(self, index: list[int] | Tensor, device: torch.device | str = "cpu") -> tuple[Tensor, ...]:
        """``(input_ids, segment_ids, attention_mask, labels)`` of the examples at ``index``, right-padded."""
        index = [int(i) for i in index]
        width = max(len(self.ids[i]) for i in index)
        ids = torch.full((len(index), width), self.pad, dtype=torch.long)
        seg = torch.zeros((len(index), width), dtype=torch.long)
        mask = torch.zeros((len(index), width), dtype=torch.bool)
        for row, i in enumerate(index):
            n = len(self.ids[i])
            ids[row, :n] = torch.tensor(self.ids[i])
            seg[row, :n] = torch.tensor(self.segments[i])
            mask[row, :n] = True
        return ids.to(device), seg.to(device), mask.to(device), self.labels[index].to(device)


def truncate_pair(a: list[int], b: list[int], budget: int) -> bool:
    """Cut ``a`` and ``b`` in place, longest first, to at most ``budget`` tokens together; True if cut."""
    cut = False
    while len(a) + len(b) > budget:
        (a if len(a) > len(b) else b).pop()
        cut = True
    return cut


def encode_examples(tok: Tokenizer, task: Task, examples: list[Example], max_len: int,
                    specials: SpecialIds | None = None) -> Encoded:
    """Tokenise ``examples`` of ``task`` into BERT inputs of at most ``max_len`` tokens."""
    sp = specials or special_ids(tok)
    firsts = encode(tok, [e.a for e in examples])
    seconds = encode(tok, [e.b or "" for e in examples]) if task.pair else [[] for _ in examples]
    ids, segments, truncated = [], [], 0
    for a, b in zip(firsts, seconds):
        truncated += truncate_pair(a, b, max_len - (3 if task.pair else 2))
        first = [sp.cls, *a, sp.sep]
        second = [*b, sp.sep] if task.pair else []
        ids.append(first + second)
        segments.append([0] * len(first) + [1] * len(second))
    dtype = torch.float if task.regression else torch.long
    labels = torch.tensor([e.label for e in examples], dtype=dtype)
    return Encoded(ids, segments, labels, sp.pad, truncated)


def eval_batches(lengths: list[int], batch_size: int, sort: bool = True) -> list[list[int]]:
    """Index batches for evaluation; with ``sort`` each batch holds examples of neighbouring lengths."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__) if sort else list(range(len(lengths)))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def padded_tokens(lengths: list[int], batches: list[list[int]]) -> int:
    """Tokens a forward pass over ``batches`` computes (every row padded to its batch's longest)."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)
