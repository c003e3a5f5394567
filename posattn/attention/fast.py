"""The fast path: the same function as :mod:`.reference`, computed per term structure.

Every algorithm here is exact (equal to the reference path in outputs and gradients, tested)
and none ever uses more memory than the reference path. :func:`plan` picks one per call from
the term structures, the device and the length, never from a mechanism's name:

- ``sdpa``: no score term beyond :class:`LowRank` ones (but see ``fused``). Those fold exactly into extra q/k
  dimensions, q' = [q/√d_h, u], k' = [k, v] (v zero-padded to the same width, which the CPU
  flash kernel needs; the width is rounded up to a multiple of 8), so SDPA keeps its fused
  kernel. A :class:`Toeplitz` term with a ``causal_form`` uses that low-rank form under a
  causal mask. With no padding the causal case runs with ``is_causal`` (no mask tensor).
- ``dense``: short inputs (n ≤ ``Policy.dense_max_n``; for Toeplitz tables that need a
  gradient n ≤ ``dense_grad_max_n``), non-CPU devices without FlexAttention,
  and dropout: every other term summed into one bias handed to SDPA (query-relative terms
  gathered from q·Wᵀ, never Shaw's n×n×d tensor). Under dropout on the CPU (and in ``sdpa``
  there) the product softmax(s)·V is written out instead, its dropout from :mod:`.dropout` as in
  the reference path (SDPA's CPU kernel falls back to its unfused math path under dropout
  anyway). Position-only biases that need no gradient (ALiBi; any table, and wide low-rank
  terms such as DIET-ABS's P_Q P_Kᵀ, at inference) come from a content-checked cache
  (:mod:`.cache`): built once per length, reused by every layer and batch.
- ``banded`` (CPU): every term is constant outside a window ±w, 2w+1 ≤ ``band_fraction``·n
  (clipped tables, query/key-relative terms): :mod:`.banded`, linear memory. Chosen for
  query/key-relative terms where ``fused`` is not (beyond ``fused_max_n``, or without the
  kernels), and for clipped tables that need a gradient at n ≥ ``band_min_n``.
- ``flash_bias`` (CPU): everything else at n > ``dense_max_n`` (full Toeplitz tables, dense
  terms; and tables at inference, where its forward is the fused kernel with a bias *view*), and
  tables that need a gradient from ``dense_grad_max_n`` on (where its chunked backward beats SDPA's
  math path on a dense bias), or from
  ``fused_grad_max_n`` on where that backward is one fused C++ kernel (:mod:`.native`: tables
  alone, no padding, float32; then it costs no more than SDPA's own fused backward):
  :mod:`.flash_bias`, linear memory beyond the terms themselves.
- ``fused`` (CPU, float32), up to ``fused_max_n``: query/key-relative and two-sided terms (with
  or without tables), where the dense bias would be gathered per batch row and SDPA would run its math
  path, and where the banded pieces cost more than the kernel (beyond ``fused_max_n`` banded
  wins: it leaves most scores to SDPA's kernel); every fusable term set in a decoder from
  ``causal_fused_min_n`` on, where whole blocks of masked keys are skipped (SDPA's CPU kernel
  gains little from the mask); narrow low-rank terms alone in any decoder (causal ALiBi) and at
  inference up to ``dense_max_n`` (segment embeddings; no q/k/v widened from 64 to 72 for a
  rank of 1 or 2); learned tables with padding where flash-bias would take them: :mod:`.fused`, the
  C++ kernels of :mod:`.native` with the bias added from the terms' small inputs and their
  gradients reduced from dS in the same pass.
- ``flex`` (CUDA): FlexAttention with the terms inside the kernel (:mod:`.flex`).

Packed rows (``documents``, :attr:`posattn.mechanisms.base.Context.documents`): every query sees
the keys of its own document only. ``sdpa`` (a boolean mask), ``dense`` (the mask in its bias) and
``flex`` (the mask in its block mask) take that mask; ``banded``, ``flash_bias`` and ``fused``
do not (their kernels know padding and causality alone), so :func:`plan` never picks them for a
packed batch and :func:`run` refuses them (:data:`.dispatch.TAKES_DOCUMENTS`).

The thresholds are CPU measurements (``posattn bench``; 2 threads, head dim 64), recorded in the
documentation ("How the fast paths work").
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import PositionError
from . import native, reference
from .banded import BandGeometry, banded_attention
from .cache import POSITION_CACHE
from .dispatch import HANDLES, Path, check_documents, check_terms, refused
from .dropout import hashed
from .flash_bias import BiasGeometry, ChunkFn, flash_bias_attention, relative_chunk
from .flex import flex_attend
from .fold import fold_low_rank
from .fused import fused_attention, kernel_inputs
from .masking import allowed_mask
from .terms import (
    Dense,
    LowRank,
    QueryRelative,
    RowNormalised,
    ScoreTransform,
    Term,
    Toeplitz,
    TwoSided,
    split_transforms,
)


@dataclass(frozen=True)
class Policy:
    """How :func:`attend` chooses and sizes its algorithms (see :func:`policy_for`)."""

    dense_max_n: int = 512  # at or below: one dense bias into SDPA
    dense_grad_max_n: int = 256  # ... but Toeplitz tables that need a gradient: flash-bias above this
    fused_grad_max_n: int = 128  # ... or above this where flash-bias's backward is the fused kernel
    band_fraction: float = 0.25  # banded only when the band 2w + 1 is at most this fraction of n
    band_min_n: int = 4096  # ... and, for Toeplitz-only terms that need a gradient, n this long
    band_chunk: int | None = None  # query rows per band block; None: max(64, 2w)
    flash_chunk: int = 1024  # query rows per fused flash call (flash_bias)
    grad_chunk: int = 256  # query rows per explicit backward step (flash_bias)
    width_multiple: int = 8  # folded q/k/v widths are zero-padded to a multiple of this
    low_rank_dense_min: int = 16  # a dense low-rank bias u·vᵀ beats a fold this wide: at inference
    dense_cache_bytes: int = 1 << 26  # ... cached, while the [h, n, n] bias is at most this big;
    low_rank_dense_max_n: int = 256  # ... in training, up to this length
    use_flex: bool = True  # CUDA: FlexAttention when torch provides it
    native: bool = True  # CPU: the fused C++ kernels (:mod:`.native`) where they apply and build
    fused_max_n: int = 4096  # up to here query/key-relative terms take those kernels at any n ...
    causal_fused_min_n: int = 512  # ... and in a decoder any fusable terms from here on (2 blocks)
    force: Path | None = None  # tests and benchmarks: take this path whenever it applies
    # query/key-relative terms as a dense bias: one gather, or "skew" (terms.clipped_band: pads and
    # views, whose backward sums where the gather's scatter-adds into the window's two edge slots)
    relative_bias: Literal["gather", "skew"] = "gather"
    # off the CPU: the short depthwise convolutions (CAT, conv_qkv, depthwise_conv) through
    # torch.compile (mechanisms.conv.conv_compiled) instead of eager shift-and-add
    compiled_conv: bool = False
    # off the CPU: mixers that attend over blocks each query picks (mechanisms.landmark) through
    # torch.compile, which reads the picked blocks by index in fused kernels, instead of eager's one
    # matmul per block (b·h·L/B launches a layer)
    compiled_blocks: bool = False
    # the SDPA kernels every scaled_dot_product_attention call of this path may take
    # (torch.nn.attention.sdpa_kernel): "auto" leaves the choice to PyTorch (cuDNN's attention on an
    # H100 in torch 2.13 for bf16), "flash" FlashAttention-2 (or the CPU's flash kernel); a backend
    # that cannot take the inputs is an error, not a silent fallback
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    # FlexAttention: a Toeplitz term with a closed form (Toeplitz.formula: ALiBi's −m_h·|j − i|) is
    # computed per score instead of read from its [h, 2n − 1] table, the way the FlexAttention paper
    # writes ALiBi; an A/B arm of the GPU command (a table read per score against a multiply-add)
    flex_formula: bool = False
    # the attention layer's QKV projection as three products on W_QKV's rows instead of one whose
    # output is split: the backward then needs no stack of dq, dk, dv (the whole encoder's H100
    # profile against BERT: aten::cat 1.75 ms and aten::copy_ 1.43 ms of a 47 ms step, BERT's three
    # projections having neither); an A/B arm of the GPU command
    split_qkv: bool = False
    # FlexAttention's kernels with the Tensor Memory Accelerator of Hopper GPUs (kernel option
    # USE_TMA; torch's default is off). Its forward took 1.52 ms against 0.58 ms for SDPA's cuDNN
    # kernel at n 4096 on an H100 (ALiBi, batch 16, 4 heads of 64); an A/B arm of the GPU command.
    # Other devices ignore it
    flex_tma: bool = False
    # FlexAttention compiled with mode "max-autotune-no-cudagraphs": Inductor times its candidate
    # block sizes, warps and stages per shape and keeps the fastest, where the default takes one
    # configuration per GPU and head size (the first call per shape then takes longer); an A/B arm
    # of the GPU command
    flex_autotune: bool = False


CPU_POLICY = Policy()
# "skew" off the CPU: the gather's backward is a scatter-add whose atomics collide in the window's
# two edge slots (every clipped offset lands there); on an H100 (bf16, n 512, batch 32, 12 heads,
# dropout 0.1: the dense path) the skew cut a training step of dynamic_conv from 8.1× to 2.1× SDPA,
# composite 8.4× to 2.3×, key_dynamic_conv 6.6× to 3.5× (the GPU command's A/B stage, results
# recipe gpu_layer_ab); on the CPU the two measure within noise, and the gather stays
OTHER_POLICY = Policy(dense_max_n=1 << 30, dense_grad_max_n=1 << 30, low_rank_dense_max_n=0, relative_bias="skew")
_OVERRIDE: list[Policy] = []


def policy_for(device: torch.device, **overrides: Any) -> Policy:
    """Defaults per device: the linear-memory CPU paths exist on CPU only; elsewhere the dense
    bias (or FlexAttention on CUDA). Inside :func:`using`, that policy instead; ``overrides``:
    those fields changed."""
    policy = _OVERRIDE[-1] if _OVERRIDE else CPU_POLICY if device.type == "cpu" else OTHER_POLICY
    return replace(policy, **overrides) if overrides else policy


@contextmanager
def using(policy: Policy) -> Iterator[Policy]:
    """Make ``policy`` the default of every :func:`attend` call in this block (tests, benchmarks)."""
    _OVERRIDE.append(policy)
    try:
        yield policy
    finally:
        _OVERRIDE.pop()


# -- pieces shared by several paths -----------------------------------------------------------
def _position_only(terms: list[Term]) -> bool:
    return all(t.position_only() for t in terms)


def _term_tensors(terms: list[Term]) -> list[Tensor]:
    return [x for t in terms for x in t.tensors()]


def _dense_bias(terms: list[Term], n: int, policy: Policy = CPU_POLICY) -> Tensor:
    total: Tensor | None = None
    for t in terms:
        if isinstance(t, QueryRelative):
            part = t.bias(n, skew=policy.relative_bias == "skew")
        else:
            part = t.dense(n) if isinstance(t, Dense) else t.bias(n)  # Dense's field ``bias`` hides the method
        total = part if total is None else total + part
    assert total is not None
    if total.stride(-1) != 1:  # e.g. the windows of a transposed table: CUDA's fused SDPA kernels
        total = total.contiguous()  # refuse such a bias and run the fp32 math kernel (T5: 1.4 → 2.2× absolute)
    return total if total.dim() == 4 else total.unsqueeze(0)


# -- planning ---------------------------------------------------------------------------------
def _window(rest: list[Term]) -> int | None:
    """The common window of ``rest`` if every term is constant outside one, else None."""
    windows = [t.constant_beyond() for t in rest]
    return None if None in windows else max(windows, default=0)  # type: ignore[type-var]


def _needs_grad(tensors: list[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def plan(q: Tensor, terms: list[Term], causal: bool, dropout: float = 0.0, training: bool = False,
         policy: Policy | None = None, keep: Tensor | None = None, documents: Tensor | None = None) -> Path:
    """The algorithm :func:`attend` uses for these arguments."""
    policy = policy or policy_for(q.device)
    terms = _resolve(terms, causal, q, policy)
    rest = [t for t in terms if not isinstance(t, LowRank)]
    low = [t for t in terms if isinstance(t, LowRank)]
    n = q.shape[-2]
    if training and dropout > 0 or any(isinstance(t, ScoreTransform) for t in terms):
        return "dense" if terms else "sdpa"
    if documents is not None:  # only the paths that take the document mask
        return _packed_plan(q, rest, low, policy)
    if not rest:
        if low and _low_rank_as_bias(q, low, policy):
            return "dense"
        pays = causal or (n <= policy.dense_max_n and not _needs_grad([q, *_term_tensors(low)]))
        if low and (pays or policy.force == "fused") and _fusable(q, low, policy):
            return "fused"
        return "sdpa"
    if (q.device.type == "cuda" and policy.use_flex and _flex_available()
            and all(type(t) in HANDLES["flex"] for t in rest)):
        return "flex"
    if q.device.type != "cpu":
        return "dense"
    w = _window(rest)
    banded_ok = w is not None and 2 * w + 1 <= policy.band_fraction * n and n >= w + 2
    if policy.force in ("dense", "flash_bias"):
        return policy.force
    if policy.force == "banded" and banded_ok:
        return "banded"
    if policy.force == "fused" and _fusable(q, rest, policy):
        return "fused"
    # a two-sided term is computed from each input row: batch-free at batch 1 by accident, never a table
    tables = _position_only(rest) and not any(isinstance(t, TwoSided) for t in rest)
    skips_blocks = causal and n >= policy.causal_fused_min_n
    if n <= policy.fused_max_n and (skips_blocks or not tables) and _fusable(q, rest, policy):
        return "fused"
    grads = _needs_grad(_term_tensors(rest))
    # asked only when it decides: a first call builds them
    fused_tables = grads and tables and _fusable(q, rest, policy)
    shortest = policy.fused_grad_max_n if fused_tables else policy.dense_grad_max_n
    learned_positions = grads and tables and n > shortest
    if n <= policy.dense_max_n and not learned_positions:
        return "dense"
    relative = any(isinstance(t, QueryRelative) for t in rest)
    if banded_ok and (relative or (grads and n >= policy.band_min_n)):
        return "banded"
    if learned_positions and fused_tables and keep is not None:  # flash-bias's fused backward takes no padding
        return "fused"
    return "flash_bias"


def _packed_plan(q: Tensor, rest: list[Term], low: list[LowRank], policy: Policy) -> Path:
    """The path for packed rows: SDPA with the boolean mask when nothing but narrow low-rank
    terms (folded) is left, FlexAttention on CUDA, else the dense bias with the mask in it."""
    if not rest and not (low and _low_rank_as_bias(q, low, policy)):
        return "sdpa"
    if (q.device.type == "cuda" and policy.use_flex and _flex_available()
            and all(type(t) in HANDLES["flex"] for t in rest)):
        return "flex"
    return "dense"


def _fusable(q: Tensor, rest: list[Term], policy: Policy) -> bool:
    """The fused C++ kernels (:mod:`.fused`, :mod:`.native`) take these terms here. For learned
    tables alone they beat the dense bias from n = 256 on (layer training step ÷ SDPA, b = 16:
    1.03 against 1.06; at n = 128 they tie): flash-bias with the fused backward, or, with
    padding, the fused path."""
    return (policy.native and q.device.type == "cpu" and q.dtype == torch.float32 and all(t.fusable() for t in rest)
            and native.kernels() is not None)


def _low_rank_as_bias(q: Tensor, low: list[LowRank], policy: Policy) -> bool:
    """Wide low-rank terms (rank ≥ ``low_rank_dense_min``): a dense u·vᵀ bias beats folding
    them into q/k (which widens every head of the fused kernel, v included). At inference when
    position-only (then cached); in training up to ``low_rank_dense_max_n``."""
    n, h = q.shape[-2], q.shape[1]
    if sum(t.u.shape[-1] for t in low) < policy.low_rank_dense_min:
        return False
    if _needs_grad(_term_tensors(list(low))):
        return n <= policy.low_rank_dense_max_n
    return _position_only(list(low)) and h * n * n * q.element_size() <= policy.dense_cache_bytes


def _resolve(terms: list[Term], causal: bool, q: Tensor, policy: Policy) -> list[Term]:
    """Toeplitz terms with an equivalent causal (low-rank) form use it under a causal mask.
    Wide position-only low-rank terms that learn (DIET-ABS, TUPE), on CPU beyond
    ``low_rank_dense_max_n`` and ``dense_grad_max_n`` up to ``dense_max_n``, become one
    batch-free [1, h, n, n] bias for flash-bias: folding them would double every head's width in
    the fused kernel. Idempotent: resolved terms come back unchanged. With a score transform
    nothing changes: it reads the bias itself, so a per-row constant is no longer harmless."""
    if any(isinstance(t, ScoreTransform) for t in terms):
        return terms
    terms = [t.causal_form if causal and isinstance(t, Toeplitz) and t.causal_form is not None else t
             for t in terms]
    low = [t for t in terms if isinstance(t, LowRank)]
    n = q.shape[-2]
    shortest = max(policy.low_rank_dense_max_n, policy.dense_grad_max_n)
    if (q.device.type == "cpu" and shortest < n <= policy.dense_max_n and low
            and sum(t.u.shape[-1] for t in low) >= policy.low_rank_dense_min
            and _needs_grad(_term_tensors(list(low))) and _position_only(list(low))):
        return [t for t in terms if not isinstance(t, LowRank)] + [Dense(_dense_bias(list(low), n))]
    return terms


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


# -- the paths ---------------------------------------------------------------------------------
def attend(
    q: Tensor, k: Tensor, v: Tensor, terms: list[Term], keep: Tensor | None, causal: bool,
    dropout: float = 0.0, training: bool = False, documents: Tensor | None = None, *,
    policy: Policy | None = None,
) -> Tensor:
    """Attention output [b, h, n, d_v], equal to :func:`posattn.attention.reference.attend`
    (``documents``: the document of each token of a packed row, [b, n])."""
    policy = policy or policy_for(q.device)
    terms = _resolve(terms, causal, q, policy)  # once: plan's own _resolve leaves resolved terms as they are
    path = plan(q, terms, causal, dropout, training, policy, keep, documents)
    return run(path, q, k, v, terms, keep, causal, dropout, training, documents, policy=policy)


def run(path: Path, q: Tensor, k: Tensor, v: Tensor, terms: list[Term], keep: Tensor | None, causal: bool,
        dropout: float = 0.0, training: bool = False, documents: Tensor | None = None, *,
        policy: Policy | None = None) -> Tensor:
    """Attention output [b, h, n, d_v] computed by ``path`` itself (:func:`attend` runs the
    path :func:`plan` picks). A term the path has no code for is refused by term type and path
    (:mod:`.dispatch`), as are terms it cannot take for a reason beyond their type: ``banded``
    needs every term constant beyond a window, ``fused`` needs terms its kernels take; and
    packed rows (``documents``) on a path without the document mask."""
    policy = policy or policy_for(q.device)
    check_terms(path, terms)
    check_documents(path, documents)
    low = [t for t in terms if isinstance(t, LowRank)]
    rest = [t for t in terms if not isinstance(t, LowRank)]
    scale = 1.0 / math.sqrt(q.shape[-1])
    d_v = v.shape[-1]
    p = dropout if training else 0.0
    if path == "sdpa":
        return _sdpa(q, k, v, low, keep, causal, scale, p, policy, documents)
    if path == "dense":
        return _dense(q, k, v, low, rest, keep, causal, scale, p, policy, documents)
    if path == "flex":
        return flex_attend(q, k, v, low, rest, keep, causal, scale, documents, formulas=policy.flex_formula,
                           tma=policy.flex_tma, autotune=policy.flex_autotune)
    if path == "fused":
        for t in rest + low:
            if not t.fusable():
                raise refused(path, t, "the fused kernels do not take this one (Term.fusable)")
        if native.kernels() is None:
            raise PositionError("the fused attention path needs the C++ kernels, which did not build here")
        return fused_attention(q * scale, k, v, kernel_inputs(rest + low), keep, causal)
    q2, k2, v2 = fold_low_rank(q, k, v, low, scale, policy.width_multiple)
    if path == "banded":
        for t in rest:
            if t.constant_beyond() is None:
                raise refused(path, t, "it is not constant beyond a window (Term.constant_beyond)")
        o = _banded(q2, k2, v2, rest, keep, causal, scale, policy)
    else:
        o = _flash_bias(q2, k2, v2, rest, keep, causal, policy)
    return o[..., :d_v]


def _sdpa(q: Tensor, k: Tensor, v: Tensor, low: list[LowRank], keep: Tensor | None, causal: bool,
          scale: float, p: float, policy: Policy, documents: Tensor | None = None) -> Tensor:
    d_v = v.shape[-1]
    if low:
        q, k, v = fold_low_rank(q, k, v, low, scale, policy.width_multiple)
        scale = 1.0
    hides = keep is not None or documents is not None
    mask = allowed_mask(q.shape[-2], keep, causal, q.device, documents=documents) if hides else None
    return _softmax_product(q, k, v, mask, causal, scale, p, policy)[..., :d_v]


_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "math": "MATH"}  # Policy.sdpa_backend -> torch.nn.attention.SDPBackend


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, causal: bool = False,
         scale: float | None = None, p: float = 0.0, policy: Policy | None = None) -> Tensor:
    """``F.scaled_dot_product_attention`` restricted to ``policy.sdpa_backend`` (default: the
    policy in force for ``q``'s device, :func:`policy_for`); "auto" calls it as it is."""
    backend = (policy or policy_for(q.device)).sdpa_backend
    if backend == "auto":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([getattr(SDPBackend, _BACKENDS[backend])]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                  scale=scale)
    except RuntimeError as e:
        if "backend" not in str(e) and "kernel" not in str(e):
            raise
        raise PositionError(f"Policy.sdpa_backend={backend!r}: PyTorch's {backend} SDPA kernel does not take "
                            f"these inputs ({q.dtype}, {q.device.type}, head dim {q.shape[-1]}, "
                            f"{'a mask, ' if mask is not None else ''}dropout {p}); use 'auto' or another "
                            f"backend ({e})") from None


def _softmax_product(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float,
                     p: float, policy: Policy) -> Tensor:
    """SDPA with ``mask`` (bool, or a float bias with −inf where hidden; None: ``causal`` alone) and
    dropout ``p``. Where :mod:`.dropout` draws the mask itself (the CPU), a dropout product is
    written out, so that it drops through :func:`.dropout.dropout` as the reference path does;
    PyTorch's CPU SDPA runs its unfused math path under dropout anyway."""
    if p == 0.0 or not hashed(q):
        return sdpa(q, k, v, mask, causal=causal and mask is None, scale=scale, p=p, policy=policy)
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is None:
        mask = allowed_mask(q.shape[-2], None, causal, q.device)  # None unless causal
    elif mask.dtype != torch.bool:  # a float bias, −inf where hidden
        s, mask = s + mask, None
    return reference.weighted_values(s, mask, v, p, True)


def _dense(q: Tensor, k: Tensor, v: Tensor, low: list[LowRank], rest: list[Term], keep: Tensor | None,
           causal: bool, scale: float, p: float, policy: Policy, documents: Tensor | None = None) -> Tensor:
    """One bias into SDPA; cached across layers and batches when it is position-only and needs
    no gradient. Low-rank terms fold, unless they are part of such a cached bias or wide
    (:func:`_low_rank_as_bias`)."""
    n, d_v = q.shape[-2], v.shape[-1]
    rest, changes = split_transforms(rest)
    if changes:
        return _transformed(q, k, v, low + rest, changes, keep, causal, scale, p, policy, documents)
    dense_terms: list[Term] = list(rest)
    cache = not _needs_grad(_term_tensors(low + rest)) and _position_only(low + rest)
    if cache:
        dense_terms = [t.first_row() for t in dense_terms + low]
        low = []
    elif low and _low_rank_as_bias(q, low, policy):
        dense_terms += low
        low = []
    if low:
        q, k, v = fold_low_rank(q, k, v, low, scale, policy.width_multiple)
        scale = 1.0
    parts = _term_tensors(dense_terms)
    bias: Tensor | None = None
    if cache:
        bias = POSITION_CACHE.get(n, parts, lambda: _dense_bias(dense_terms, n, policy).to(q.dtype))
    elif dense_terms:
        bias = _dense_bias(dense_terms, n, policy).to(q.dtype)
    ok = allowed_mask(n, keep, causal, q.device, documents=documents)
    if ok is not None:
        bias = (torch.zeros(ok.shape, dtype=q.dtype, device=q.device) if bias is None else bias).masked_fill(
            ~ok, float("-inf"))
    return _softmax_product(q, k, v, bias, causal, scale, p, policy)[..., :d_v]  # bias None: narrow low-rank terms only


def _transformed(q: Tensor, k: Tensor, v: Tensor, additive: list[Term], changes: list[Term], keep: Tensor | None,
                 causal: bool, scale: float, p: float, policy: Policy, documents: Tensor | None = None) -> Tensor:
    """Score transforms (:class:`ScoreTransform`) rewrite the scores themselves, so the scores
    are written out: the additive terms as one bias (:meth:`Term.bias`: query-relative terms
    gathered from q·Wᵀ), the transforms, then the masked softmax times v."""
    n = q.shape[-2]
    ok = allowed_mask(n, keep, causal, q.device, documents=documents)
    s = reference.transformed((q @ k.transpose(-1, -2)) * scale,
                              [_dense_bias(additive, n, policy)] if additive else [],
                              changes, ok, torch.arange(n, device=q.device)[None])
    return reference.weighted_values(s, ok, v, p, p > 0)


def _pad_to(x: Tensor, width: int) -> Tensor:
    return F.pad(x, (0, width - x.shape[-1]))


def _as_heads(weight: Tensor) -> Tensor:
    """QueryRelative weight as [h|1, 2w+1, d]."""
    return weight if weight.dim() == 3 else weight.unsqueeze(0)


def _add(a: Tensor | None, b: Tensor) -> Tensor:
    return b if a is None else a + b


def _banded(q: Tensor, k: Tensor, v: Tensor, rest: list[Term], keep: Tensor | None, causal: bool,
            scale: float, policy: Policy) -> Tensor:
    """Map the terms onto the band / left / right form of :mod:`.banded` (q, k already folded,
    q scaled): band bias B[i, r], per-head constants c, query shifts α and key shifts β."""
    n, width = q.shape[-2], q.shape[-1]
    w = _window(rest)
    assert w is not None
    bias = cl = cr = al = ar = bl = br = None
    tables = [t.table for t in rest if isinstance(t, Toeplitz)]
    if tables:
        table = tables[0]
        for t in tables[1:]:
            table = table + t
        bias = table[:, n - 1 - w:n + w][None, :, None, :]
        cl, cr = table[None, :, n - 2 - w], table[None, :, n + w]
    r = torch.arange(-w, w + 1, device=q.device)
    for t in rest:
        if isinstance(t, Toeplitz):  # summed into the band bias above
            continue
        if not isinstance(t, QueryRelative):
            raise refused("banded", t)
        wt, W = t.window, _as_heads(t.weight)
        if t.key_side:  # t_ij = scale·k_j·W[clip(i − j)]; in the band i − j = −r
            kw = torch.einsum("bhjd,hrd->bhjr", t.vec, W[:, (-r).clamp(-wt, wt) + wt]) * t.scale
            kw = F.pad(kw, (0, 0, w, w)).contiguous()  # rows j + w
            sb, sh, sj, _ = kw.stride()
            bias = _add(bias, kw.as_strided((*kw.shape[:2], n, 2 * w + 1), (sb, sh, sj, sj + 1)))
            al = _add(al, _pad_to(W[None, :, None, 2 * wt] * t.scale, width))
            ar = _add(ar, _pad_to(W[None, :, None, 0] * t.scale, width))
        else:  # t_ij = scale·q_i·W[clip(j − i)]
            bias = _add(bias, torch.einsum("bhid,hrd->bhir", t.vec, W[:, r.clamp(-wt, wt) + wt]) * t.scale)
            bl = _add(bl, _pad_to(W[None, :, None, 0] * (t.scale / scale), width))
            br = _add(br, _pad_to(W[None, :, None, 2 * wt] * (t.scale / scale), width))
    if al is not None and bl is not None:  # (q + α)·(k + β) adds α·β: take it back out
        cl = _add(cl, -(al * bl).sum(-1)[..., 0])
        if not causal:
            cr = _add(cr, -(ar * br).sum(-1)[..., 0])  # type: ignore[operator]
    if causal:
        cr = ar = br = None
    chunk = policy.band_chunk or max(64, 2 * w)
    geo = BandGeometry(w, causal, keep, max(chunk, 2 * w, 1))
    return banded_attention(q, k, v, geo, bias, cl, cr, al, ar, bl, br)


def _dense_chunk(inputs: list[Tensor], i0: int, i1: int, j0: int) -> Tensor:
    (bias,) = inputs
    bias = bias if bias.dim() == 4 else bias.unsqueeze(0)
    return bias[..., i0:i1, :].flip(-1)[..., j0:]


def _block_chunk(term: RowNormalised | TwoSided, n: int) -> ChunkFn:
    """Chunk builder of a term that computes any block of rows and keys from its small inputs
    (:meth:`RowNormalised.block`, :meth:`TwoSided.block`), over reversed keys j' (key
    j = n − 1 − j'): the block of rows i0 … i1 − 1, never an n×n table."""
    def build(inputs: Sequence[Tensor], i0: int, i1: int, j0: int) -> Tensor:
        dev = inputs[0].device
        return term.block(inputs, torch.arange(i0, i1, device=dev), torch.arange(n - 1 - j0, -1, -1, device=dev))

    return build


def _flash_bias(q: Tensor, k: Tensor, v: Tensor, rest: list[Term], keep: Tensor | None, causal: bool,
                policy: Policy) -> Tensor:
    n = q.shape[-2]
    table: Tensor | None = None
    extras: list[tuple[ChunkFn, int]] = []
    inputs: list[Tensor] = []
    for t in rest:
        if isinstance(t, Toeplitz):
            table = t.table if table is None else table + t.table
        elif isinstance(t, QueryRelative):
            extras.append((relative_chunk(n, t.window, t.scale, t.key_side), 2))
            inputs += [t.vec, t.weight]
        elif isinstance(t, Dense):
            extras.append((_dense_chunk, 1))
            inputs.append(t.dense(n))
        elif isinstance(t, (RowNormalised, TwoSided)):
            extras.append((_block_chunk(t, n), len(t.inputs())))
            inputs += t.inputs()
        else:
            raise refused("flash_bias", t)
    geo = BiasGeometry(causal, keep, policy.flash_chunk, policy.grad_chunk, extras=tuple(extras), native=policy.native)
    return flash_bias_attention(q, k, v, geo, table, inputs)

