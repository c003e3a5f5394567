"""The boolean mask every path shares: padding keys, (for decoders) future keys and (for packed
rows) keys of another document are hidden."""
from __future__ import annotations

import torch
from torch import Tensor

from .terms import row_offsets


def allowed_mask(n: int, keep: Tensor | None, causal: bool, device: torch.device,
                 rows: Tensor | None = None, documents: Tensor | None = None) -> Tensor | None:
    """[b|1, 1, m, n] bool, True where query i may attend to key j, for the query rows ``rows``
    ([b|1, m] positions; default all n); None if nothing is hidden. ``documents`` ([b, n] document
    index of each token of a packed row, :attr:`posattn.mechanisms.base.Context.documents`):
    query i sees only the keys of its own document.

    Each query always sees itself, so a padding query never has an empty row (no NaN); real
    queries are unaffected because they are real keys too.
    """
    if keep is None and not causal and documents is None:
        return None
    r = row_offsets(torch.arange(n, device=device)[None] if rows is None else rows, n)  # [b|1, m, n]
    ok = r <= 0 if causal else torch.ones_like(r, dtype=torch.bool)
    if keep is not None:
        ok = ok & keep[:, None, :]
    if documents is not None:
        mine = documents if rows is None else torch.take_along_dim(documents, rows.expand(documents.shape[0], -1), 1)
        ok = ok & (mine[:, :, None] == documents[:, None, :])
    return (ok | (r == 0))[:, None]
