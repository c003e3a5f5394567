"""Pretraining losses as modules, so one forward call (and DistributedDataParallel) covers them.

Both return the *sum* of token cross-entropies and the number of scored tokens; the loop divides
by the number of scored tokens of the whole global batch, so the gradient does not depend on how
the batch is split over processes and micro-batches.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..models.transformer import Decoder, Encoder, Transformer
from .data import IGNORE, Batch


class MaskedLM(nn.Module):
    """BERT's masked-LM loss; the last layer and the logits only at the scored positions (tied
    decoder + bias)."""

    def __init__(self, model: Encoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        keep = batch.labels != IGNORE
        logits = self.model.mlm_logits(self.model(batch.input_ids, batch.segment_ids, batch.attention_mask,
                                                  scored=keep))
        targets = batch.labels[keep]
        loss = F.cross_entropy(logits.float(), targets, reduction="sum")
        correct = (logits.argmax(-1) == targets).sum()
        return loss, correct


class CausalLM(nn.Module):
    """Next-token loss of a decoder over every position; a packed batch's documents are kept apart
    (``document_ids``: positions restart and no attention crosses a document boundary)."""

    def __init__(self, model: Decoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        logits = self.model(batch.input_ids, batch.attention_mask, document_ids=batch.document_ids)
        flat, targets = logits.flatten(0, 1).float(), batch.labels.flatten()
        loss = F.cross_entropy(flat, targets, ignore_index=IGNORE, reduction="sum")
        correct = (flat.argmax(-1) == targets).sum()
        return loss, correct


def objective_for(model: Transformer) -> nn.Module:
    """The loss module that fits the model's kind."""
    return MaskedLM(model) if isinstance(model, Encoder) else CausalLM(model)
