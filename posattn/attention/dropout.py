"""Dropout (Srivastava et al. 2014), with its mask drawn by a counter-based hash on the CPU.

Every element is zeroed with probability p and the rest scaled by 1/(1 − p), as in
``torch.nn.functional.dropout``. On the CPU, PyTorch draws one Bernoulli variate per element
(about 10 ns each): 12% of a ``tiny`` masked-LM or fine-tuning step, most of it on the [b, h, n, n]
attention probabilities. Here (``csrc/dropout.cpp``) element i of a call is dropped when
h(seed, i) < p · 2³², h a vectorised 32-bit integer hash, and the seed is one draw from torch's
generator, so ``torch.manual_seed`` and a restored RNG state reproduce every mask. The backward
recomputes the mask from the seed instead of storing it. On other devices or dtypes, or where the
kernels are not built, it is ``torch.nn.functional.dropout``.

The reference and the fast attention paths both drop through :func:`dropout`, so on the same
seed they drop the same entries.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native

SEED_RANGE = 2 ** 62


class _HashDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float, seed: int) -> Tensor:  # type: ignore[override]
        ctx.p, ctx.seed = p, seed
        return native.kernels().hash_dropout(x, p, seed)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return native.kernels().hash_dropout(grad, ctx.p, ctx.seed), None, None


def hashed(x: Tensor) -> bool:
    """Whether :func:`dropout` takes the counter-based kernel for ``x``."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and native.kernels() is not None


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``x`` with each element zeroed with probability ``p`` and the rest scaled by 1/(1 − p)
    while ``training``; ``x`` itself otherwise."""
    if not training or p == 0.0:
        return x
    if not 0.0 < p < 1.0 or not hashed(x):
        return F.dropout(x, p, True)
    seed = int(torch.randint(SEED_RANGE, (), dtype=torch.long))
    return _HashDropout.apply(x, p, seed)


class Dropout(nn.Module):
    """:func:`dropout` as a module, in place of ``nn.Dropout``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
