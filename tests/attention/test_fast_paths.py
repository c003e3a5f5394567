"""Every fast algorithm equals the reference path, in outputs and in gradients (q, k, v, the term
tensors, and through models every mechanism parameter): bidirectional and causal, with padding,
at sizes where the chunk sizes are forced small so every chunking and merging branch runs."""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn.attention import fast, native, reference
from posattn.attention.banded import BandGeometry, banded_attention
from posattn.attention.cache import POSITION_CACHE
from posattn.attention.fast import Policy, plan, using
from posattn.attention.flash_bias import antidiag_sum
from posattn.attention.kernels import flash_fwd
from posattn.attention.layer import Attention
from posattn.attention.terms import (
    Dense,
    LowRank,
    QueryRelative,
    Term,
    Toeplitz,
    TwoSided,
    clipped_band,
    relative_index,
)
from posattn.mechanisms.conv import METHODS, conv_method, depthwise_conv1d
from posattn.models import Decoder, Encoder, ModelConfig

F64 = torch.float64
SMALL = dict(dense_max_n=0, band_min_n=0, band_fraction=1.0, band_chunk=None, flash_chunk=16, grad_chunk=8)


def rand(*shape: int, grad: bool = True, seed: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, dtype=F64, generator=g).requires_grad_(grad)


def keep_mask(b: int, n: int) -> torch.Tensor:
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[0, n - 7:] = False  # right padding
    keep[-1, :5] = False  # left padding
    keep[-1, n // 2] = False  # a hole
    return keep


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-10) -> None:
    err = (a - b).abs().max().item()
    assert err <= tol * (1 + b.abs().max().item()), f"{what}: max error {err:.2e}"


@contextmanager
def planned() -> Iterator[list[str]]:
    """The fast-path algorithms :func:`fast.plan` picks inside the block, in call order."""
    chosen: list[str] = []
    real_plan = fast.plan

    def spy(*a: Any, **kw: Any) -> str:
        chosen.append(real_plan(*a, **kw))
        return chosen[-1]

    fast.plan = spy  # type: ignore[assignment]
    try:
        yield chosen
    finally:
        fast.plan = real_plan  # type: ignore[assignment]


def compare(q, k, v, terms: list[Term], leaves: list[torch.Tensor], keep, causal: bool,
            policy: Policy, expect: str) -> None:
    assert plan(q, terms, causal, policy=policy) == expect
    out_f = fast.attend(q, k, v, terms, keep, causal, policy=policy)
    out_r = reference.attend(q, k, v, terms, keep, causal)
    assert_close(out_f, out_r, "output")
    g = torch.randn_like(out_r)
    gf = torch.autograd.grad(out_f, leaves, g, allow_unused=True, retain_graph=True)
    gr = torch.autograd.grad(out_r, leaves, g, allow_unused=True, retain_graph=True)
    for i, (a, b) in enumerate(zip(gf, gr)):
        if b is None:
            assert a is None or a.abs().max() == 0
            continue
        assert a is not None, f"leaf {i} got no gradient on the fast path"
        assert_close(a, b, f"gradient of leaf {i}")


# -- the building blocks -------------------------------------------------------------------------
def test_antidiag_sum() -> None:
    x = rand(2, 3, 5, 9, grad=False)
    ref = torch.zeros(2, 3, 13, dtype=F64)
    for i in range(5):
        for j in range(9):
            ref[..., i + j] += x[..., i, j]
    assert_close(antidiag_sum(x), ref, "anti-diagonal sums")


def test_flash_kernel_facts() -> None:
    """What the pieces rely on: is_causal aligns top-left and combines with a mask; a fully
    hidden row returns output 0 (the callers set its log-sum-exp to −inf themselves)."""
    q, k, v = (rand(1, 1, 6, 4, grad=False, seed=i) for i in range(3))
    mask = torch.zeros(1, 1, 1, 6, dtype=F64)
    mask[..., 0] = float("-inf")
    out, lse = flash_fwd(q[:, :, :3], k, v, causal=True, mask=mask)
    s = (q[:, :, :3] @ k.mT).masked_fill(torch.ones(3, 6, dtype=torch.bool).triu(1), float("-inf")) + mask
    assert torch.isfinite(lse[..., 1:]).all()
    assert_close(lse[..., 1:], torch.logsumexp(s, -1)[..., 1:], "lse")
    assert out[..., 0, :].abs().max() == 0


@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
def test_banded_attention_all_inputs(causal: bool, pad: bool) -> None:
    """The banded kernel against its own definition, every input differentiated."""
    b, h, n, d, w = 2, 3, 37, 5, 3
    q, k, v = rand(b, h, n, d), rand(b, h, n, d), rand(b, h, n, d)
    bias, cl, cr = rand(1, h, 1, 2 * w + 1), rand(1, h), rand(1, h)
    al, ar, bl, br = (rand(1, h, 1, d) for _ in range(4))
    keep = keep_mask(b, n) if pad else None
    out = banded_attention(q, k, v, BandGeometry(w, causal, keep, 6), bias, cl, cr, al, ar, bl, br)
    r = relative_index(n, q.device) - (n - 1)
    band = torch.gather(bias.expand(b, h, n, -1), -1, (r.clamp(-w, w) + w).expand(b, h, n, n))
    s = torch.where(r.abs() <= w, q @ k.mT + band,
                    torch.where(r < -w, (q + al) @ (k + bl).mT + cl[..., None, None],
                                (q + ar) @ (k + br).mT + cr[..., None, None]))
    ok = fast.allowed_mask(n, keep, causal, q.device)
    s = s if ok is None else s.masked_fill(~ok, float("-inf"))
    ref = s.softmax(-1) @ v
    assert_close(out, ref, "output")
    leaves = [q, k, v, bias, cl, cr, al, ar, bl, br]
    g = torch.randn_like(ref)
    gf = torch.autograd.grad(out, leaves, g, allow_unused=True)
    gr = torch.autograd.grad(ref, leaves, g, allow_unused=True)
    for i, (a, bb) in enumerate(zip(gf, gr)):
        if causal and i in (5, 7, 9):  # the right piece does not exist in a decoder
            assert bb is None or bb.abs().max() == 0
            continue
        assert_close(a, bb, f"gradient {i}")


# -- every term structure through fast.attend ----------------------------------------------------
def toeplitz(h: int, n: int, window: int | None, seed: int) -> tuple[Toeplitz, torch.Tensor]:
    """A Toeplitz term built as mechanisms build them (clipped from a parameter when windowed)."""
    if window is None:
        p = rand(h, 2 * n - 1, seed=seed)
        return Toeplitz(p * 1.0), p
    p = rand(h, 2 * window + 1, seed=seed)
    idx = (torch.arange(-(n - 1), n).clamp(-window, window) + window)
    return Toeplitz(p[:, idx], window=window), p


def qr(q: torch.Tensor, k: torch.Tensor, window: int, key_side: bool, per_head: bool,
       seed: int) -> tuple[QueryRelative, torch.Tensor]:
    h, d = q.shape[1], q.shape[-1]
    w = rand(*((h,) if per_head else ()), 2 * window + 1, d, seed=seed)
    return QueryRelative(k if key_side else q, w, window, 1 / math.sqrt(d), key_side=key_side), w


def structures(q, k, n: int, h: int) -> dict[str, tuple[list[Term], list[torch.Tensor], str]]:
    """name -> (terms, parameter leaves, expected path with the SMALL policy)."""
    t3, p3 = toeplitz(h, n, 3, 1)
    t5, p5 = toeplitz(h, n, 5, 2)
    tf, pf = toeplitz(h, n, None, 3)
    qq, wq = qr(q, k, 4, False, False, 4)
    qk, wk = qr(q, k, 2, True, True, 5)
    qw, ww = qr(q, k, n + 3, False, True, 9)  # wider than the sequence (Shaw without clipping)
    kw, wk2 = qr(q, k, n - 9, True, False, 10)
    u, vv = rand(1, h, n, 3, seed=6), rand(1, h, n, 3, seed=7)
    lr = LowRank(u, vv)
    dense = rand(1, h, n, n, seed=8)
    sides = [rand(b, h, n, seed=20 + i) for i, b in enumerate((q.shape[0], 1, q.shape[0], 1))]
    sided = TwoSided(*sides)
    return {
        "toeplitz-window": ([t3], [p3], "banded"),
        "two-windows+lowrank": ([t3, t5, lr], [p3, p5, u, vv], "banded"),
        "query-relative": ([qq], [wq], "banded"),
        "key-relative": ([qk], [wk], "banded"),
        "query+key-relative+toeplitz": ([qq, qk, t5], [wq, wk, p5], "banded"),
        "toeplitz-full": ([tf], [pf], "flash_bias"),
        "toeplitz-full+lowrank": ([tf, lr], [pf, u, vv], "flash_bias"),
        "toeplitz-full+query+key-relative": ([tf, qq, qk], [pf, wq, wk], "flash_bias"),
        "wide-query+key-relative": ([qw, kw], [ww, wk2], "flash_bias"),
        "dense+toeplitz": ([Dense(dense), t3], [dense, p3], "flash_bias"),
        "dense-only": ([Dense(dense)], [dense], "flash_bias"),
        "two-sided": ([sided], sides, "flash_bias"),
        "two-sided+toeplitz-full+lowrank": ([sided, tf, lr], [*sides, pf, u, vv], "flash_bias"),
        # no bias gradient (ALiBi, inference tables): the fused kernel's own backward
        "toeplitz-full-fixed": ([Toeplitz(pf.detach())], [], "flash_bias"),
        "toeplitz-fixed+dense-fixed": ([Toeplitz(pf.detach()), Dense(dense.detach())], [], "flash_bias"),
    }


@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
@pytest.mark.parametrize("name", list(structures(rand(1, 1, 45, 2), rand(1, 1, 45, 2), 45, 1)))
def test_structures(name: str, causal: bool, pad: bool) -> None:
    b, h, n, d = 2, 3, 45, 6
    q, k, v = rand(b, h, n, d, seed=10), rand(b, h, n, d, seed=11), rand(b, h, n, d, seed=12)
    terms, params, expect = structures(q, k, n, h)[name]
    keep = keep_mask(b, n) if pad else None
    compare(q, k, v, terms, [q, k, v, *params], keep, causal, Policy(**SMALL), expect)


@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
def test_wide_low_rank_terms_as_dense_bias_in_training(causal: bool, pad: bool) -> None:
    """Short inputs, rank ≥ low_rank_dense_min, gradients needed: one u·vᵀ bias, not a fold
    (alone and next to other terms); narrow ones still fold."""
    b, h, n, d = 2, 3, 45, 6
    q, k, v = rand(b, h, n, d, seed=1), rand(b, h, n, d, seed=2), rand(b, h, n, d, seed=3)
    u, w = rand(b, h, n, 20, seed=4), rand(1, h, n, 20, seed=5)
    t3, p3 = toeplitz(h, n, 3, 6)
    keep = keep_mask(b, n) if pad else None
    policy = Policy(low_rank_dense_max_n=64)
    compare(q, k, v, [LowRank(u, w)], [q, k, v, u, w], keep, causal, policy, "dense")
    compare(q, k, v, [LowRank(u, w), t3], [q, k, v, u, w, p3], keep, causal, policy, "dense")
    assert plan(q, [LowRank(u[..., :4], w[..., :4])], causal, policy=policy) == "sdpa"
    assert plan(q, [LowRank(u, w)], causal, policy=Policy(low_rank_dense_max_n=32)) == "sdpa"
    # longer (here: beyond 16), position-only and learned: one batch-free bias on flash-bias
    longer = Policy(low_rank_dense_max_n=16, dense_grad_max_n=16, flash_chunk=16, grad_chunk=8)
    u1 = rand(1, h, n, 20, seed=6)
    compare(q, k, v, [LowRank(u1, w)], [q, k, v, u1, w], keep, causal, longer, "flash_bias")
    compare(q, k, v, [LowRank(u1, w), t3], [q, k, v, u1, w, p3], keep, causal, longer, "flash_bias")
    assert plan(q, [LowRank(u, w)], causal, policy=longer) == "sdpa"  # per batch row: folded


@pytest.mark.parametrize("spec", ["diet_abs", "tupe", "t5"])
def test_learned_position_biases_at_pretraining_length(spec: str) -> None:
    """Models whose position terms learn take flash-bias past ``dense_grad_max_n`` (DIET-ABS,
    TUPE as one batch-free P_Q P_Kᵀ bias; T5's table), equal to the reference with padding."""
    ids = torch.randint(0, 23, (2, N), generator=torch.Generator().manual_seed(2))
    keep = keep_mask(2, N)
    ref = build(spec, False, "reference")
    h_ref = ref.hidden(ids, None, keep)
    g_ref = torch.autograd.grad((h_ref * keep[..., None]).pow(2).sum(), list(ref.parameters()), allow_unused=True)
    m = build(spec, False, "fast")
    policy = Policy(low_rank_dense_max_n=16, dense_grad_max_n=16, low_rank_dense_min=4, flash_chunk=16,
                    grad_chunk=8)
    with planned() as chosen, using(policy):
        h = m.hidden(ids, None, keep)
    assert set(chosen) == {"flash_bias"}
    assert_close(h * keep[..., None], h_ref * keep[..., None], "hidden states")
    g = torch.autograd.grad((h * keep[..., None]).pow(2).sum(), list(m.parameters()), allow_unused=True)
    for (name, _), a, b in zip(m.named_parameters(), g, g_ref):
        if b is not None:
            assert a is not None, f"{name} gets no gradient"
            assert_close(a, b, f"gradient of {name}")


@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
def test_dropout_with_narrow_low_rank_terms(causal: bool) -> None:
    """Training with dropout takes the dense path; narrow low-rank terms alone fold into it."""
    b, h, n, d = 2, 2, 20, 4
    q, k, v = rand(b, h, n, d, seed=1), rand(b, h, n, d, seed=2), rand(b, h, n, d, seed=3)
    low = [LowRank(rand(1, h, n, 2, seed=4), rand(1, h, n, 2, seed=5))]
    assert plan(q, low, causal, 0.5, True) == "dense"
    torch.manual_seed(0)
    out = fast.attend(q, k, v, low, keep_mask(b, n), causal, 0.5, True)
    assert out.shape == v.shape and torch.isfinite(out).all()
    torch.manual_seed(0)
    assert_close(fast.attend(q, k, v, low, keep_mask(b, n), causal, 0.0, True),
                 reference.attend(q, k, v, low, keep_mask(b, n), causal), "no dropout")


@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
def test_forced_dense_and_flash_bias_agree_for_windowed_terms(causal: bool) -> None:
    b, h, n, d = 1, 2, 40, 4
    q, k, v = rand(b, h, n, d, seed=1), rand(b, h, n, d, seed=2), rand(b, h, n, d, seed=3)
    terms, params, _ = structures(q, k, n, h)["query+key-relative+toeplitz"]
    for path in ("dense", "flash_bias"):
        compare(q, k, v, terms, [q, k, v, *params], None, causal, Policy(**SMALL, force=path), path)


def test_plan_by_length_and_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults: dense bias for short inputs; at long ones banded for query/key-relative terms
    and for clipped tables that need a gradient, flash-bias for full tables and at inference;
    no bias at all for low-rank terms; never by mechanism name. (Without the fused kernel;
    with it, see the next test.)"""
    monkeypatch.setattr(native, "kernels", lambda: None)
    h = 4
    for n, windowed, full in ((256, "dense", "dense"), (4096, "banded", "flash_bias")):
        q = torch.zeros(1, h, n, 8)
        table = torch.zeros(h, 2 * n - 1, requires_grad=True)
        assert plan(q, [Toeplitz(table, window=8)], False) == windowed
        assert plan(q, [Toeplitz(table, window=128)], True) == windowed
        assert plan(q, [Toeplitz(table)], False) == full
        assert plan(q, [LowRank(torch.zeros(1, h, n, 2), torch.zeros(1, h, n, 2))], False) == "sdpa"
        assert plan(q, [QueryRelative(q, torch.zeros(17, 8), 8, 1.0)], False) == windowed
        with torch.no_grad():
            assert plan(q, [Toeplitz(table, window=8)], False) == full
    q = torch.zeros(1, h, 2048, 8)
    assert plan(q, [Toeplitz(torch.zeros(h, 4095, requires_grad=True), window=8)], False) == "flash_bias"
    q = torch.zeros(1, h, 512, 8)  # pretraining length: tables that learn take flash-bias, the rest dense
    table = torch.zeros(h, 1023, requires_grad=True)
    assert plan(q, [Toeplitz(table, window=8)], False) == "flash_bias"
    assert plan(q, [Toeplitz(table), QueryRelative(q, torch.zeros(17, 8), 8, 1.0)], False) == "dense"
    with torch.no_grad():
        assert plan(q, [Toeplitz(table)], False) == "dense"
    q = torch.zeros(1, h, 4096, 8)
    assert plan(q, [Toeplitz(torch.zeros(h, 8191), window=1500)], False) == "flash_bias"


def test_plan_with_the_fused_table_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fused kernels build (tables alone, float32), learned tables leave the dense
    bias from ``fused_grad_max_n`` on instead of ``dense_grad_max_n``: flash-bias with the fused
    backward, or with padding the fused path."""
    monkeypatch.setattr(native, "kernels", lambda: object())
    h, n = 4, 256
    q = torch.zeros(1, h, n, 8)
    table = torch.zeros(h, 2 * n - 1, requires_grad=True)
    assert plan(q, [Toeplitz(table)], False) == "flash_bias"
    assert plan(q, [Toeplitz(table, window=8)], True) == "flash_bias"
    assert plan(q[..., :128, :], [Toeplitz(table[:, 128:-128])], False) == "dense"
    keep = torch.ones(1, n, dtype=torch.bool)
    assert plan(q, [Toeplitz(table)], False, keep=keep) == "fused"                       # padding
    assert plan(q.double(), [Toeplitz(table.double())], False) == "dense"                 # float64
    assert plan(q, [Toeplitz(table)], False, policy=Policy(native=False)) == "dense"      # turned off
    with torch.no_grad():
        assert plan(q, [Toeplitz(table)], False) == "dense"                               # no gradient


def test_term_methods() -> None:
    """What the fast path asks of a term structure, answered by the structure itself."""
    h, n = 2, 6
    same = rand(1, h, n, 3, grad=False).expand(4, h, n, 3)
    varied = rand(4, h, n, 3, grad=False)
    table = rand(h, 2 * n - 1, grad=False)
    q = rand(4, h, n, 3, grad=False)
    relative = QueryRelative(q, rand(5, 3, grad=False), 2, 0.5)
    bias = rand(4, h, n, n, grad=False)
    assert LowRank(same, same).position_only() and not LowRank(same, varied).position_only()
    assert Toeplitz(table).position_only() and not relative.position_only()
    assert Dense(bias[:1].expand(4, h, n, n)).position_only() and not Dense(bias).position_only()
    assert LowRank(same, same).first_row().u.shape[0] == 1 and Dense(bias).first_row().bias.shape[0] == 1
    assert [t.constant_beyond() for t in (Toeplitz(table), Toeplitz(table, window=3), relative, Dense(bias))] \
        == [None, 3, 2, None]
    assert LowRank(same, varied).tensors()[1] is varied and relative.tensors() == [q, relative.weight]
    assert_close(relative.bias(n), relative.dense(n), "gathered query-relative bias")
    key = QueryRelative(q, rand(h, 5, 3, grad=False), 2, 0.5, key_side=True)
    assert_close(key.bias(n), key.dense(n), "gathered key-relative bias")


# -- every mechanism through a model -------------------------------------------------------------
N = 40
SPECS: list[Any] = [
    "none", "absolute", "sinusoidal", "rope", "alibi", "diet_abs", "segment", "tupe", "cat",
    "conv_qkv", "depthwise_conv", "fixed_conv", "dynamic_conv", "composite", "key_dynamic_conv",
    "diet_rel", "tisa",
    {"name": "t5", "num_buckets": 8, "max_distance": 12},
    {"name": "diet_rel", "max_distance": 5},
    {"name": "tupe", "relative_bias": True},
    {"name": "tisa", "n_kernels": 2},
    ["composite", {"name": "t5", "num_buckets": 8, "max_distance": 12}, "diet_abs"],
    ["composite", "t5", "segment"],
    ["key_dynamic_conv", "dynamic_conv", "tisa"],
    "kerple", {"name": "kerple", "kernel": "power"}, "sandwich", "dynamic_pos_bias", "forgetting",
    {"name": "alibi", "learned": True, "heads": 1},
]


def spec_id(spec: Any) -> str:
    specs = spec if isinstance(spec, list) else [spec]
    return "+".join(s if isinstance(s, str) else s["name"] + "(" + ",".join(
        f"{k}={v}" for k, v in s.items() if k != "name") + ")" for s in specs)


def build(spec: Any, causal: bool, path: str) -> torch.nn.Module:
    specs = spec if isinstance(spec, list) else [spec]
    cfg = ModelConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=2, d_ff=8, max_len=64,
                      n_segments=3, mechanisms=specs, attn_path=path)
    torch.manual_seed(0)
    m = (Decoder if causal else Encoder)(cfg).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=F64) * 0.3)
    return m


def against_reference(spec: Any, causal: bool, policies: dict[str, Policy]) -> set[str]:
    """Hidden states and every parameter's gradient of the fast model under each policy (padding)
    against the reference model; returns the paths the policies took."""
    ids = torch.randint(0, 23, (2, N), generator=torch.Generator().manual_seed(2))
    keep = keep_mask(2, N)
    ref = build(spec, causal, "reference")
    h_ref = ref.hidden(ids, None, keep)
    w = torch.randn(h_ref.shape, dtype=F64, generator=torch.Generator().manual_seed(3)) * keep[..., None]
    g_ref = torch.autograd.grad((h_ref * w).sum(), list(ref.parameters()), allow_unused=True)
    seen = set()
    for what, policy in policies.items():
        m = build(spec, causal, "fast")
        with planned() as chosen, using(policy):
            h = m.hidden(ids, None, keep)
        seen.update(chosen)
        assert_close(h * keep[..., None], h_ref * keep[..., None], f"{what}: hidden states")
        g = torch.autograd.grad((h * w).sum(), list(m.parameters()), allow_unused=True)
        for (name, _), a, b in zip(m.named_parameters(), g, g_ref):
            if b is None:
                continue
            assert a is not None, f"{what}: {name} gets no gradient"
            assert_close(a, b, f"{what}: gradient of {name}")
    return seen


@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_models_on_every_path(spec: Any, causal: bool) -> None:
    """Hidden states and every parameter's gradient, fast (each applicable path, small chunks,
    padding) vs reference."""
    policies = {path: Policy(**SMALL, force=path) for path in ("banded", "flash_bias", "dense")}  # type: ignore[arg-type]
    assert against_reference(spec, causal, policies) <= {"sdpa", "dense", "banded", "flash_bias"}


def backward_ops(t: torch.Tensor) -> set[str]:
    """The names of the autograd nodes that produced ``t``."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [nxt for nxt, _ in node.next_functions]
    return names


@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
@pytest.mark.parametrize("spec", ["absolute", {"name": "conv_qkv", "fraction": 0.5}], ids=spec_id)
def test_split_qkv_projection_equals_the_reference(spec: Any, causal: bool) -> None:
    """``Policy.split_qkv``: the QKV projection as three products on W_QKV's rows (with and
    without heads a mechanism supplies itself) gives the reference's hidden states and gradients,
    and its backward stacks no q, k, v gradients (no unbind or split of one product)."""
    against_reference(spec, causal, {"split": Policy(split_qkv=True)})
    ids = torch.randint(0, 23, (2, N), generator=torch.Generator().manual_seed(2))
    m = build(spec, causal, "fast")
    fused = backward_ops(m.hidden(ids, None, None))
    with using(Policy(split_qkv=True)):
        split = backward_ops(m.hidden(ids, None, None))
    assert fused & {"UnbindBackward0", "SplitWithSizesBackward0"}
    assert not split & {"UnbindBackward0", "SplitWithSizesBackward0"}, split


@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
@pytest.mark.parametrize("spec", ["dynamic_conv", "key_dynamic_conv", "composite", "deberta", "transformer_xl"])
def test_skewed_relative_bias_equals_the_reference(spec: str, causal: bool) -> None:
    """The dense bias of query/key-relative terms built by skewing (``relative_bias="skew"``:
    pads and views, no scatter in the backward) gives the reference's outputs and gradients."""
    policy = Policy(**SMALL, force="dense", relative_bias="skew")  # type: ignore[arg-type]
    assert against_reference(spec, causal, {"skew": policy}) == {"dense"}


@pytest.mark.parametrize("n,window", [(1, 0), (6, 0), (9, 2), (5, 8), (33, 16)])
def test_clipped_band_is_the_clipped_gather(n: int, window: int) -> None:
    prod = rand(2, 3, n, 2 * window + 1)
    idx = (relative_index(n, prod.device) - (n - 1)).clamp(-window, window) + window
    gathered = prod.gather(-1, idx.expand(2, 3, n, n))
    skewed = clipped_band(prod, n, window)
    assert torch.equal(skewed, gathered)
    g = rand(2, 3, n, n, grad=False)
    assert_close(torch.autograd.grad(skewed, prod, g)[0], torch.autograd.grad(gathered, prod, g)[0], "gradient")


@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_toeplitz_bias_from_views_is_the_indexed_table(n: int) -> None:
    """The fast path's Toeplitz bias (unfolded windows of the table, no scatter in its backward)
    equals the reference's indexed table, gradient included."""
    t = Toeplitz(rand(3, 2 * n - 1))
    fast, ref = t.bias(n), t.dense(n)
    assert fast.shape == ref.shape == (1, 3, n, n) and torch.equal(fast, ref)
    g = rand(1, 3, n, n, grad=False)
    assert_close(torch.autograd.grad(fast, t.table, g)[0], torch.autograd.grad(ref, t.table, g)[0], "gradient")


@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
@pytest.mark.parametrize("name", posattn.names())
def test_dense_bias_reaches_sdpa_unit_stride(name: str, causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float bias the dense path hands to SDPA is unit-stride in its last dim: CUDA's fused
    kernels refuse any other and SDPA falls back to its fp32 math kernel (T5's table is an
    embedding's transpose, whose unfolded windows had stride h: a T5 encoder ran at 2.2× absolute)."""
    try:
        m = build(name, causal, "fast")
    except posattn.PositionError:
        pytest.skip(f"{name} has no {'decoder' if causal else 'encoder'}")
    strides = []
    real = F.scaled_dot_product_attention

    def spy(*a: Any, attn_mask: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        if attn_mask is not None and attn_mask.is_floating_point():
            strides.append(attn_mask.stride(-1))
        return real(*a, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ids = torch.randint(0, 23, (2, N), generator=torch.Generator().manual_seed(2))
    with using(Policy(force="dense", relative_bias="skew")):
        m.hidden(ids, None, keep_mask(2, N))
        m.hidden(ids)
    assert all(s == 1 for s in strides), strides


@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
def test_narrow_tisa_is_clipped_and_exact(causal: bool) -> None:
    """TISA kernels that underflow to exactly 0 beyond a window declare it; the banded path
    then equals the reference, gradients of a, b, c included."""
    ids = torch.randint(0, 23, (2, N), generator=torch.Generator().manual_seed(5))
    keep = keep_mask(2, N)
    models = {}
    for path in ("reference", "fast"):
        m = build({"name": "tisa", "n_kernels": 3}, causal, path)
        with torch.no_grad():
            for blk in m.blocks:
                blk.attn.mechanisms[0].b.fill_(3.0)
        models[path] = m
    terms = models["fast"].blocks[0].attn.mechanisms[0].score_terms(
        torch.zeros(2, 2, N, 8, dtype=F64), None, models["fast"].context(ids, None, keep, None))
    assert terms[0].window is not None and 2 * terms[0].window + 1 <= N  # float64: exp underflows at −745
    with using(Policy(**SMALL, force="banded")):  # type: ignore[arg-type]
        h = models["fast"].hidden(ids, None, keep)
    h_ref = models["reference"].hidden(ids, None, keep)
    assert_close(h * keep[..., None], h_ref * keep[..., None], "hidden")
    params = [p for n_, p in models["fast"].named_parameters() if "mechanisms" in n_]
    ref_params = [p for n_, p in models["reference"].named_parameters() if "mechanisms" in n_]
    for a, b in zip(torch.autograd.grad((h * keep[..., None]).sum(), params),
                    torch.autograd.grad((h_ref * keep[..., None]).sum(), ref_params)):
        assert_close(a, b, "TISA parameter gradient")


def test_layer_never_names_a_mechanism() -> None:
    import inspect

    from posattn.attention import banded, flash_bias, layer

    source = "".join(inspect.getsource(mod) for mod in (fast, banded, flash_bias, layer))
    for name in posattn.names():
        if name in ("none", "cat", "segment"):  # ordinary words
            continue
        assert f'"{name}"' not in source and f"'{name}'" not in source, name


# -- inference cache ----------------------------------------------------------------------------
def test_position_cache_reused_across_layers_and_batches_and_invalidated() -> None:
    POSITION_CACHE.clear()
    cfg = ModelConfig(vocab_size=23, d_model=16, n_layers=3, n_heads=2, d_ff=8, max_len=64,
                      mechanisms=["t5"], attn_path="fast")
    m = Encoder(cfg).eval()
    with torch.no_grad():
        a = m.hidden(torch.randint(0, 23, (2, 30)))
        m.hidden(torch.randint(0, 23, (3, 30)))
        assert POSITION_CACHE.misses == 1 and POSITION_CACHE.hits == 5  # 3 layers × 2 batches
        m.blocks[0].attn.mechanisms[0].bias.weight.add_(1.0)  # shared T5 table changes
        ids = torch.randint(0, 23, (2, 30))
        b = m.hidden(ids)
        assert POSITION_CACHE.misses == 2
    ref = Encoder(ModelConfig(**{**cfg.to_dict(), "attn_path": "reference"})).eval()
    ref.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert_close(b, ref.hidden(ids), "after invalidation", 2e-5)
    assert a.shape == (2, 30, 16)


def test_low_rank_position_terms_cached_at_inference() -> None:
    POSITION_CACHE.clear()
    cfg = ModelConfig(vocab_size=23, d_model=32, n_layers=2, n_heads=2, d_ff=8, max_len=64,
                      mechanisms=[{"name": "diet_abs", "sharing": "layer"}], attn_path="fast")
    m = Encoder(cfg).eval()
    ids = torch.randint(0, 23, (2, 30))
    with torch.no_grad():
        q = torch.zeros(1, 2, 30, 16)
        low = m.blocks[0].attn.mechanisms[0].score_terms(q, q, m.context(ids, None, None, None))
        assert plan(q, low, False) == "dense"
        m.hidden(ids)
        m.hidden(ids)
    assert POSITION_CACHE.misses == 1 and POSITION_CACHE.hits == 3
    h = m.hidden(ids)  # with grad: a dense bias at this short length (folded when longer), no cache
    assert POSITION_CACHE.misses == 1 and POSITION_CACHE.hits == 3
    trainable = [LowRank(low[0].u.requires_grad_(), low[0].v)]
    assert plan(q, trainable, False) == "dense"
    assert plan(q, trainable, False, policy=Policy(low_rank_dense_max_n=16)) == "sdpa"
    # at pretraining length a learned position-only P_Q P_Kᵀ is one batch-free bias for flash-bias
    assert plan(q, trainable, False, policy=Policy(low_rank_dense_max_n=16, dense_grad_max_n=16)) == "flash_bias"
    assert h.requires_grad


# -- convolutions -------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 5, 9, 130])
def test_conv_methods_agree(k: int) -> None:
    x = rand(2, 150, 6)
    w = rand(6, k)
    causal_only = k % 2 == 0
    for causal in ([True] if causal_only else [True, False]):
        left = k - 1 if causal else (k - 1) // 2
        # reference: PyTorch's own grouped convolution and its autograd backward
        ref = F.conv1d(F.pad(x.transpose(1, 2), (left, k - 1 - left)), w.unsqueeze(1), groups=6).transpose(1, 2)
        # native: float32 (test_native); compiled: an inductor build per shape (its own test below)
        outs = {name: f(x, w, left) for name, f in METHODS.items() if name not in ("native", "compiled")}
        g = torch.randn_like(ref)
        g_ref = torch.autograd.grad(ref, [x, w], g)
        for name, o in outs.items():
            assert_close(o, ref, f"{name} output")
            for a, b in zip(torch.autograd.grad(o, [x, w], g), g_ref):
                assert_close(a, b, f"{name} gradient")
        (gw,) = torch.autograd.grad(METHODS["conv1d"](x.detach(), w, left), [w], g)  # ∂w alone
        assert_close(gw, g_ref[1], "conv1d weight gradient without input gradient")
    assert conv_method(k) == ("shift" if k <= 4 else "fft" if k >= 112 else "conv1d")
    y = depthwise_conv1d(x, w[0], True, torch.ones(2, 150, dtype=torch.bool))
    assert y.shape == x.shape


@pytest.mark.parametrize("k,causal", [(3, False), (4, True)])
def test_compiled_conv_equals_shift_and_add(k: int, causal: bool) -> None:
    """The compiled shift-and-add (``Policy.compiled_conv`` off the CPU) against PyTorch's grouped
    convolution, outputs and both gradients, here compiled for the CPU; chosen only off the CPU
    and only when the policy asks."""
    x, w = rand(2, 40, 6), rand(6, k)
    left = k - 1 if causal else (k - 1) // 2
    ref = F.conv1d(F.pad(x.transpose(1, 2), (left, k - 1 - left)), w.unsqueeze(1), groups=6).transpose(1, 2)
    out = METHODS["compiled"](x, w, left)
    assert_close(out, ref, "compiled output")
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, [x, w], g), torch.autograd.grad(ref, [x, w], g)):
        assert_close(a, b, "compiled gradient")
    assert conv_method(k, x) != "compiled"
    meta = torch.empty(2, 40, 6, device="meta")
    with using(Policy(compiled_conv=True)):
        assert conv_method(k, meta) == "compiled" and conv_method(k, x) != "compiled"
    assert conv_method(k, meta) == "shift"


def test_attention_module_uses_policy_override() -> None:
    dims = posattn.mechanisms.Dims(16, 2, 1, 64, 2, False)
    mech = posattn.mechanisms.build(["fixed_conv"], dims).layers[0]
    attn = Attention(dims, mech).double()
    ctx = posattn.mechanisms.Context(positions=torch.arange(40).expand(1, 40),
                                     segments=torch.zeros(1, 40, dtype=torch.long), keep=None, causal=False)
    x = rand(1, 40, 16)
    with using(Policy(**SMALL, force="banded")):  # type: ignore[arg-type]
        a = attn(x, ctx)
    attn.path = "reference"
    assert_close(a, attn(x, ctx), "layer output")


def _sdpa_ops(fn: Any) -> set[str]:
    """The SDPA operators one call of ``fn`` dispatched (forward and backward)."""
    with torch.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.events() if "scaled_dot_product" in e.name}


@pytest.mark.parametrize("path", ["sdpa", "dense"])
def test_sdpa_backend_restricts_the_kernel_and_keeps_the_numbers(path: str) -> None:
    """``Policy.sdpa_backend`` sends every SDPA call of the path to that kernel alone (the CPU has
    flash and math): the operator PyTorch dispatched changes, the output and the gradients do not
    (float32, the flash kernel's own precision), eager and compiled; a kernel that cannot take
    the inputs is one clear error, not a silent fallback."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 16, generator=g).requires_grad_() for _ in range(3))
    terms = [] if path == "sdpa" else [Toeplitz(torch.randn(2, 47, generator=g))]

    def step(backend: str, compiled: bool = False) -> list[torch.Tensor]:
        for t in (q, k, v):
            t.grad = None
        policy = Policy(force=path, sdpa_backend=backend)  # type: ignore[arg-type]

        def f() -> torch.Tensor:
            return fast.attend(q, k, v, terms, None, False, policy=policy)
        out = (torch.compile(f) if compiled else f)()
        out.pow(2).sum().backward()
        return [out.detach(), *(t.grad for t in (q, k, v))]  # type: ignore[list-item]

    ops = {b: _sdpa_ops(lambda b=b: step(b)) for b in ("flash", "math")}
    assert any("flash" in op for op in ops["flash"]) and not any("math" in op for op in ops["flash"])
    assert any("math" in op for op in ops["math"]) and not any("flash" in op for op in ops["math"])
    want = step("auto")
    for got in (step("flash"), step("math"), step("math", compiled=True)):
        for a, b, what in zip(got, want, ("output", "dq", "dk", "dv")):
            assert_close(a, b, what, 1e-5)
    with pytest.raises(posattn.PositionError, match="sdpa_backend='efficient'.*does not take these inputs"):
        step("efficient")
