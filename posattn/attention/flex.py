"""CUDA: FlexAttention with the score terms inside the fused kernel (forward and backward).

Low-rank terms fold into q/k as on every path; Toeplitz tables, query/key-relative products,
two-sided vectors and dense biases are read in ``score_mod``; padding, causality and the documents of packed
rows become a block mask, so
fully hidden blocks are skipped. Gradients reach every captured tensor (FlexAttention
differentiates through ``score_mod`` on CUDA). Not available on CPU for training; the CPU
tests run FlexAttention only in inference, the CUDA tests (``tests/*/test_cuda.py``) train through it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import refused
from .fold import fold_low_rank
from .terms import Dense, LowRank, QueryRelative, Term, Toeplitz, TwoSided

BLOCK = 128   # FlexAttention's default block size (queries and keys)

_COMPILED: dict[str, Callable[..., Tensor]] = {}


AUTOTUNE = "max-autotune-no-cudagraphs"   # the torch.compile mode of ``flex_attend(autotune=True)``


def _flex(autotune: bool = False) -> Callable[..., Tensor]:
    """FlexAttention through ``torch.compile`` (its fused kernels), with :data:`AUTOTUNE` when
    ``autotune``: a compiled function of its own, whose Dynamo cache entries are apart from the
    default's (guarded on the backend), so both can run in one process (an A/B)."""
    key = f"flex {AUTOTUNE}" if autotune else "flex"
    if key not in _COMPILED:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # every score_mod, length and batch recompiles into one Dynamo cache: past the default
        # limit (8) Dynamo silently falls back to eager, unfused flex attention
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 256)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 1024)
        _COMPILED[key] = torch.compile(flex_attention, dynamic=False, mode=AUTOTUNE if autotune else None)
    return _COMPILED[key]


def _padded(x: Tensor, dim: int, before: int, after: int, value: float | bool = 0.0) -> Tensor:
    """``x`` with ``before`` and ``after`` entries ``value`` along ``dim``, as ``F.pad`` gives,
    written as a gather and a select. A tensor that ``score_mod`` or ``mask_mod`` reads is inlined
    into the FlexAttention kernel when the whole step is compiled, and Inductor's lowering of
    ``F.pad`` (a masked load) fails there (torch 2.13 on an H100: "'function' object has no
    attribute 'graph'" for T5's table in ``compare --compile``); an indexed load and a select
    lower like ``score_mod`` itself."""
    size = x.shape[dim]
    idx = torch.arange(-before, size + after, device=x.device)
    inside = ((idx >= 0) & (idx < size)).view([-1] + [1] * (x.dim() - 1 - dim % x.dim()))
    return torch.where(inside, x.index_select(dim, idx.clamp(0, size - 1)), value)


def _scorer(big: int, table: Tensor | None, closed: list[Callable[[Tensor, Tensor], Tensor]],
            query_prods: list[tuple[Tensor, int]], key_prods: list[tuple[Tensor, int]], dense: list[Tensor],
            sided: list[tuple[Tensor, ...]]) -> Callable[..., Tensor]:
    """FlexAttention's ``score_mod`` over the captured tensors (N = ``big``): the Toeplitz table at
    offset j − i, the closed forms, the query-/key-relative products at the clipped offset, the
    dense biases and the two-sided vectors."""
    def score_mod(score: Tensor, bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        r = ki - qi
        if table is not None:
            score = score + table[hi, r + big - 1]
        for formula in closed:
            score = score + formula(hi, r)
        for prod, w in query_prods:
            score = score + prod[bi, hi, qi, torch.clamp(r, -w, w) + w]
        for prod, w in key_prods:
            score = score + prod[bi, hi, ki, torch.clamp(-r, -w, w) + w]
        for bias in dense:
            score = score + bias[bi, hi, qi, ki]
        for a, x, b_, y in sided:
            score = score + torch.where(ki <= qi, a[bi, hi, qi] + x[bi, hi, ki], b_[bi, hi, qi] + y[bi, hi, ki])
        return score

    return score_mod


def flex_attend(q: Tensor, k: Tensor, v: Tensor, low: list[LowRank], rest: list[Term],
                keep: Tensor | None, causal: bool, scale: float, documents: Tensor | None = None,
                formulas: bool = False, tma: bool = False, autotune: bool = False) -> Tensor:
    """Attention [b, h, n, d_v] with every term inside FlexAttention (CUDA).

    The length is padded up to a multiple of :data:`BLOCK` (FlexAttention's block, so no extra
    block is computed) and every captured tensor to that padded length: Dynamo specialises on
    shapes, so variable-length batches (fine-tuning, evaluation sorted by length) share one
    compiled kernel per padded length instead of compiling one per length. Padded keys are
    masked; padded query rows are dropped. ``documents`` ([b, n]): a query sees only the keys of
    its own document. ``formulas``: a Toeplitz term with a ``formula`` is computed per score
    from it instead of read from its table. ``tma``: the kernels load through the Tensor Memory
    Accelerator (kernel option ``USE_TMA``, Hopper GPUs; ignored elsewhere). ``autotune``: the
    kernels' configuration chosen by timing (:data:`AUTOTUNE`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, h, n, _ = q.shape
    d_v = v.shape[-1]
    q, k, v = fold_low_rank(q, k, v, low, scale, 16)
    big = -(-n // BLOCK) * BLOCK
    extra = big - n

    def pad(x: Tensor, dim: int, before: int, after: int, value: float | bool = 0.0) -> Tensor:
        """``x`` with ``value`` added along ``dim``; ``x`` itself (no copy) when the length needs no padding."""
        return _padded(x, dim, before, after, value) if extra else x

    # pad before expanding: an expanded batch-free bias stays a view, never b copies of it
    q, k, v = (F.pad(x, (0, 0, 0, extra)) if extra else x for x in (q, k, v))
    table: Tensor | None = None
    closed: list[Callable[[Tensor, Tensor], Tensor]] = []
    query_prods: list[tuple[Tensor, int]] = []
    key_prods: list[tuple[Tensor, int]] = []
    dense: list[Tensor] = []
    sided: list[tuple[Tensor, ...]] = []  # a, x, b, y, each [b, h, N]
    for t in rest:
        if isinstance(t, Toeplitz) and formulas and t.formula is not None:
            closed.append(t.formula)
        elif isinstance(t, Toeplitz):    # offsets −(n−1)..n−1 sit at the middle of −(N−1)..N−1
            part = pad(t.table, -1, extra, extra).expand(h, 2 * big - 1)
            table = part if table is None else table + part
        elif isinstance(t, QueryRelative):
            w = t.weight if t.weight.dim() == 3 else t.weight.unsqueeze(0)
            prod = torch.einsum("bhid,hmd->bhim", t.vec, w) * t.scale
            (key_prods if t.key_side else query_prods).append((pad(prod, -2, 0, extra).expand(b, h, big, -1),
                                                               t.window))
        elif isinstance(t, Dense):
            bias = t.bias if t.bias.dim() == 4 else t.bias.unsqueeze(0)
            dense.append(pad(pad(bias, -1, 0, extra), -2, 0, extra).expand(b, h, big, big))
        elif isinstance(t, TwoSided):
            # four tensors that share no storage: FlexAttention's backward refuses to index one
            # tensor that needs a gradient twice in score_mod (a and b at q, x and y at k); the
            # copies are [b, h, N] each, no n×n tensor
            sided.append(tuple(pad(part, -1, 0, extra).expand(b, h, big).clone()
                               for part in torch.broadcast_tensors(*t.vectors())))
        else:  # low-rank terms arrive in ``low``, folded above
            raise refused("flex", t)

    score_mod = _scorer(big, table, closed, query_prods, key_prods, dense, sided)

    block_mask = None
    if causal or keep is not None or extra or documents is not None:
        if keep is None:
            keep = torch.ones(1, n, dtype=torch.bool, device=q.device)
        keep = pad(keep, -1, 0, extra, False)    # [b|1, N]: a tensor, so n is no compile constant
        wide = keep.shape[0] > 1
        docs = None if documents is None else pad(documents, -1, 0, extra, -1)  # padded rows: document −1
        batched = wide or docs is not None

        def mask_mod(bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            ok = ki <= qi if causal else ki >= 0
            seen = keep[bi if wide else 0, ki]
            if docs is not None:
                seen = seen & (docs[bi, qi] == docs[bi, ki])
            return ok & (seen | (ki == qi))

        block_mask = create_block_mask(mask_mod, b if batched else None, None, big, big, device=q.device)
    flex = _flex(autotune)
    options = {"USE_TMA": True} if tma else None
    o = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0, kernel_options=options)
    return o[:, :, :n, :d_v]
