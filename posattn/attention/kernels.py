"""Thin wrappers over PyTorch's fused CPU flash-attention kernels, with the log-sum-exp exposed.

The fast paths split one attention into pieces (key ranges, query chunks) and merge them by
their log-sum-exp; the CPU flash kernel returns it and its backward accepts the *merged*
output and log-sum-exp, so each piece's gradient is exact for the whole softmax.

Facts these wrappers rely on (torch 2.13 CPU; tested in ``tests/attention/test_fast_paths.py``):
- masks must be float (additive) and may broadcast over batch, heads and query rows;
  any strides are accepted (the Toeplitz fast path passes an overlapping view);
- ``is_causal`` is aligned top-left (query row r sees keys 0..r) and combines with a mask;
- a row whose keys are all masked returns output 0 and log-sum-exp 0 (callers fix it to −inf).
"""
from __future__ import annotations

import torch
from torch import Tensor

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def flash_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
              mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ + mask) v with scale 1: (out [b, h, n, d], lse [b, h, n])."""
    return _FWD(q, k, v, 0.0, causal, attn_mask=mask, scale=1.0)


def flash_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              causal: bool = False, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of one piece given the merged output and log-sum-exp."""
    return _BWD(do, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=1.0)


def key_bias(keep: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive key-padding mask [b, 1, 1, n]: 0 for real keys, −inf for padding."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(
        ~keep, float("-inf"))[:, None, None, :]


def reduce_to(grad: Tensor, like: Tensor) -> Tensor:
    """Sum ``grad`` over the dimensions where ``like`` broadcasts (size 1 or missing)."""
    extra = grad.dim() - like.dim()
    if extra:
        grad = grad.sum(tuple(range(extra)))
    dims = tuple(i for i, s in enumerate(like.shape) if s == 1 and grad.shape[i] != 1)
    return grad.sum(dims, keepdim=True) if dims else grad
