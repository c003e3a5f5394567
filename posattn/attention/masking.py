"""The boolean mask every path shares: padding keys and (for decoders) future keys are hidden."""
from __future__ import annotations

import torch
from torch import Tensor

from .terms import row_offsets


def allowed_mask(n: int, keep: Tensor | None, causal: bool, device: torch.device,
                 rows: Tensor | None = None) -> Tensor | None:
    """[b|1, 1, m, n] bool, True where query i may attend to key j, for the query rows ``rows``
    ([b|1, m] positions; default all n); None if nothing is hidden.

    Each query always sees itself, so a padding query never has an empty row (no NaN); real
    queries are unaffected because they are real keys too.
    """
    if keep is None and not causal:
        return None
    r = row_offsets(torch.arange(n, device=device)[None] if rows is None else rows, n)  # [b|1, m, n]
    ok = r <= 0 if causal else torch.ones_like(r, dtype=torch.bool)
    if keep is not None:
        ok = ok & keep[:, None, :]
    return (ok | (r == 0))[:, None]
