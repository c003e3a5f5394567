"""``--compile MODE``: run a training step's forward and backward through ``torch.compile``.

Modes are ``torch.compile``'s (``default``, ``reduce-overhead`` — CUDA graphs where shapes are
static —, ``max-autotune-no-cudagraphs``) plus ``dynamo``: dynamo captures the graphs and runs
them eagerly, without code generation (seconds instead of minutes on a CPU; tests use it to
check the compiled path's plumbing). The backward pass goes through AOTAutograd's compiled
backward. Evaluation stays eager: it sees other lengths than training and would recompile.

Recompilation is bounded by the shapes a step sees: a training step has one sequence length (the
synthetic tasks and pretraining train at one length); the number of scored positions of masked-LM
and recall batches varies from step to step, which dynamo handles by marking that dimension
dynamic after its second shape (``dynamic=None``), so a run compiles at most twice.

Inside a compiled step the fused C++ CPU kernels stand aside (dynamo cannot trace an extension;
the compiler fuses the torch paths instead), and every host sync is left out so that the step is
one graph (CUDA graphs replay one graph; ``tests/runtime/test_compile.py`` captures each
mechanism's step with ``fullgraph=True``): the range checks of token ids, segments and positions
and every mechanism's input check (``mechanisms.base.check_inputs``), the inference cache's
content comparison, the test whether a padding mask hides anything or a term is the same for
every batch row, TISA's clipping window, and the synthetic
tasks' scored rows (their compiled loss computes a static count per example, the most any
training example scores, padded with ignored rows: ``masked_loss``'s ``scored_max``; every
position's logits instead made CAT Fig 2's smallest cell 9× slower than eager on the CPU, its
vocabulary of 8192 computed at 64 rows for 4 scored). Two places still split the graph:
Landmark CAT's blocks, and masked-LM pretraining, which keeps computing the vocabulary product
at the ~15% scored positions only (every position's would cost 6-7× that product and its fp32
logits; their count differs from batch to batch).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from posattn.errors import PositionError

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "dynamo")
F = TypeVar("F", bound=Callable[..., Any])


def check_mode(mode: str | None, where: str = "--compile") -> str | None:
    """``mode`` if it is None or one of :data:`COMPILE_MODES`, else one PositionError naming them."""
    if mode is not None and mode not in COMPILE_MODES:
        raise PositionError(f"{where}: mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    return mode


def raise_recompile_limits(at_least: int = 4096) -> None:
    """Let dynamo keep one graph per model: a sweep compiles the same step function over many
    models, and past the default limit (8) dynamo silently falls back to eager."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), at_least))


_PIECES: dict[Callable[..., Any], Callable[..., Any]] = {}


def compiled_piece(fn: F) -> F:
    """``fn`` through ``torch.compile`` with static shapes, built once per process: a piece of an
    eager step that runs compiled (a fused kernel, one graph per shape), with the recompile
    limits raised so that many shapes never fall back to eager."""
    if fn not in _PIECES:
        raise_recompile_limits()
        _PIECES[fn] = torch.compile(fn, dynamic=False)
    return _PIECES[fn]  # type: ignore[return-value]


def compiled(fn: F, mode: str | None) -> F:
    """``fn`` through ``torch.compile`` in ``mode`` (None: ``fn`` itself, eager)."""
    if check_mode(mode) is None:
        return fn
    raise_recompile_limits()
    options: dict[str, Any] = {"backend": "eager"} if mode == "dynamo" else {"mode": mode}
    return torch.compile(fn, **options)  # type: ignore[return-value]
