"""Where and in what precision a run computes: the device ("auto" picks CUDA when present), the
autocast context of a precision (bf16 / fp16 / fp32; fp16 also needs loss scaling), and the CPU's
handling of subnormal floats while a run trains or evaluates."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from posattn.errors import PositionError


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` picks CUDA when available, else CPU; anything else is passed to ``torch.device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def autocast(precision: str, device: torch.device) -> tuple[contextlib.AbstractContextManager, bool]:
    """The autocast context for ``precision`` on ``device`` and whether fp16 loss scaling is needed.
    ``precision`` is one of ``auto`` (bf16 on a CUDA device that supports it, else fp32), ``fp32``,
    ``bf16``, ``fp16`` (CUDA only; :mod:`posattn.pretrain.config` validates it)."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext(), False
    if precision == "fp16" and device.type != "cuda":
        raise PositionError("precision fp16 needs a CUDA device; use bf16 or fp32 on the CPU")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype), precision == "fp16"


def _flushing() -> bool:
    """Whether this thread flushes subnormal floats to zero now (torch has a setter and no getter):
    with denormals-are-zero set, a subnormal times one is zero."""
    return bool((torch.tensor([1e-39]) * 1.0).item() == 0.0)


@contextlib.contextmanager
def subnormals_flushed(device: torch.device | str) -> Iterator[None]:
    """On a CPU ``device``, flush subnormal floats (magnitude below 1.2e-38 in fp32) to zero while the
    block runs (:func:`torch.set_flush_denormal`: flush-to-zero and denormals-are-zero on x86 with
    SSE3), and restore the thread's earlier mode after it; elsewhere, do nothing.

    A score row that has grown sharp in training puts its small probabilities (exp(s - max) for
    s - max between -87 and -104) and their gradients in the subnormal range, where an x86 core
    computes through a slow microcode assist. Measured: one t5 (2L) model trained 4,800 steps at
    lr 0.0022 (d 128, n 128, batch 64, one thread) takes 1.6 s per training step unflushed and
    0.19 s flushed, as fast as the untrained model. A flushed value counts as the zero it rounds
    to next to its row's largest probability; numbers of normal size are computed as before.

    The mode belongs to the thread that sets it: with ``torch.set_num_threads(1)`` (how sweeps run
    their workers) it covers all the work; with more intra-op threads, only the calling thread's
    share of each parallel operation is flushed."""
    if torch.device(device).type != "cpu":
        yield
        return
    before = _flushing()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


@contextlib.contextmanager
def inference(model: torch.nn.Module, device: torch.device | str) -> Iterator[None]:
    """How every evaluation computes with ``model``: in eval mode (no dropout), without autograd,
    and on a CPU with subnormals flushed (:func:`subnormals_flushed`, as in training); the model's
    training mode is back afterwards, also when the block raises."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), subnormals_flushed(device):
            yield
    finally:
        model.train(was_training)
