"""The boolean mask both paths share: padding keys and (for decoders) future keys are hidden."""
from __future__ import annotations

import torch
from torch import Tensor


def allowed_mask(n: int, keep: Tensor | None, causal: bool, device: torch.device) -> Tensor | None:
    """[b|1, 1, n, n] bool, True where query i may attend to key j; None if nothing is hidden.

    Each query always sees itself, so a padding query never has an empty row (no NaN); real
    queries are unaffected because they are real keys too.
    """
    if keep is None and not causal:
        return None
    ok = torch.ones(1, 1, n, n, dtype=torch.bool, device=device)
    if causal:
        ok = ok.tril()
    if keep is not None:
        ok = ok & keep[:, None, None, :]
    return ok | torch.eye(n, dtype=torch.bool, device=device)
