"""The optimizer every training loop uses: AdamW with BERT's parameter groups."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def adamw(model: nn.Module, lr: float, weight_decay: float, **options: Any) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) with weight decay on matrices only (biases, norms and gains
    exempt), BERT's convention. ``options`` go to :class:`torch.optim.AdamW` (betas, eps)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, **options)
