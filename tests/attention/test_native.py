"""The fused C++ backward for learned Toeplitz tables (posattn/attention/csrc), against the
float64 reference and the pure-PyTorch flash-bias backward it replaces."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from posattn.attention import fast, native, reference
from posattn.attention.fast import Policy, plan
from posattn.attention.terms import LowRank, QueryRelative, Term, Toeplitz, TwoSided

from .test_fast_paths import keep_mask

if shutil.which("c++") is None or not native.enabled():
    pytest.skip("the fused CPU kernels need a C++ compiler and an AVX2 CPU", allow_module_level=True)


@pytest.fixture(scope="module")
def lib():
    built = native.kernels()
    assert built is not None, "a C++ compiler is here, so the fused kernels must build"
    return built


@pytest.fixture
def calls(lib, monkeypatch):
    """Counts the fused kernel's calls through :func:`native.kernels`."""
    seen: list[int] = []

    class Counting:
        biased_forward = lib.biased_forward

        def biased_backward(self, *args):
            seen.append(1)
            return lib.biased_backward(*args)

    monkeypatch.setattr(native, "kernels", lambda: Counting())
    return seen


def inputs(b: int, h: int, ht: int, n: int, d: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    table = torch.randn(ht, 2 * n - 1, generator=g, dtype=torch.float64)
    return [q, k, v, table]


def gradients(leaves: list[torch.Tensor], causal: bool, path: str, grad_out: torch.Tensor) -> list[torch.Tensor]:
    """Output and gradients of q, k, v and the table, on the reference path or the fast path
    forced to flash-bias, in the leaves' dtype."""
    q, k, v, table = (x.detach().requires_grad_() for x in leaves)
    terms = [Toeplitz(table)]
    if path == "reference":
        out = reference.attend(q, k, v, terms, None, causal)
    else:
        policy = Policy(force="flash_bias")
        assert plan(q, terms, causal, policy=policy) == "flash_bias"
        out = fast.attend(q, k, v, terms, None, causal, policy=policy)
    return [out, *torch.autograd.grad(out, [q, k, v, table], grad_out.to(out.dtype))]


@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
@pytest.mark.parametrize("b, h, ht, n, d", [(2, 3, 3, 37, 8), (2, 3, 1, 37, 8), (1, 2, 2, native.BLOCK + 45, 16)])
def test_fused_backward_equals_the_reference(calls, causal, b, h, ht, n, d):
    leaves = inputs(b, h, ht, n, d, seed=n + ht)
    grad_out = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = gradients(leaves, causal, "reference", grad_out)
    got = gradients([x.float() for x in leaves], causal, "fast", grad_out)
    assert len(calls) == 1
    for name, a, r in zip(["output", "dq", "dk", "dv", "dtable"], got, ref):
        err = (a.double() - r).abs().max().item()
        assert err <= 2e-5 * (1 + r.abs().max().item()), f"{name}: max error {err:.2e}"


def test_fused_and_pytorch_backward_agree(lib, monkeypatch):
    """The kernel and the chunked PyTorch backward it replaces give the same float32 gradients."""
    leaves = [x.float() for x in inputs(2, 4, 4, 300, 16, seed=3)]
    grad_out = torch.randn(2, 4, 300, 16, generator=torch.Generator().manual_seed(2))
    fused = gradients(leaves, False, "fast", grad_out)
    monkeypatch.setattr(native, "kernels", lambda: None)
    plain = gradients(leaves, False, "fast", grad_out)
    for name, a, r in zip(["output", "dq", "dk", "dv", "dtable"], fused, plain):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("path", ["flash_bias", "fused"])
def test_inside_a_layer_heads_are_strided_views_that_require_grad(calls, path):
    """In a layer q, k, v are [b, n, h, d] projections seen as [b, h, n, d] (strided, read in place)
    that require grad, and the kernels' worker threads have grad mode on."""
    torch.manual_seed(0)
    x = torch.randn(2, 40, 3, 8, requires_grad=True)
    table = torch.randn(3, 79, requires_grad=True)

    def attend(fn) -> list[torch.Tensor]:
        q, k, v = (x * 1.5).transpose(1, 2), (x * 0.5).transpose(1, 2), x.flip(1).transpose(1, 2)
        assert not q.is_contiguous()
        out = fn(q, k, v, [Toeplitz(table)])
        return [out, *torch.autograd.grad(out.pow(2).sum(), [x, table])]

    got = attend(lambda q, k, v, t: fast.attend(q, k, v, t, None, False, policy=Policy(force=path)))
    ref = attend(lambda q, k, v, t: reference.attend(q, k, v, t, None, False))
    assert len(calls) == 1
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)


def test_not_used_where_it_does_not_apply(calls):
    """float64, padding, or a second term: the PyTorch backward (the kernel handles one table)."""
    q, k, v, table = (x.requires_grad_() for x in inputs(1, 2, 2, 40, 8, seed=0))
    policy = Policy(force="flash_bias")
    fast.attend(q, k, v, [Toeplitz(table)], None, False, policy=policy).sum().backward()
    q32, k32, v32, t32 = (x.detach().float().requires_grad_() for x in (q, k, v, table))
    keep = torch.ones(1, 40, dtype=torch.bool)
    keep[0, -3:] = False
    fast.attend(q32, k32, v32, [Toeplitz(t32)], keep, False, policy=policy).sum().backward()
    assert calls == []


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("POSATTN_NATIVE", "0")
    native._kernels.cache_clear()
    try:
        assert not native.enabled() and native.kernels() is None
    finally:
        monkeypatch.delenv("POSATTN_NATIVE")
        native._kernels.cache_clear()


def test_compiled_code_finds_the_kernels_off_without_tracing_their_build(lib):
    """Inside ``torch.compile`` the kernels are off (dynamo cannot trace a C++ extension), and
    :func:`native.kernels` says so before reaching its cached build: tracing through the cache
    would warn the user on every compiled run that takes a convolution."""
    from posattn.mechanisms.conv import conv_method

    x = torch.randn(1, 8, 4)
    assert conv_method(3, x) == "native"
    torch._dynamo.reset()
    step = torch.compile(lambda x: x * (native.kernels() is not None) + (conv_method(3, x) == "native"),
                         backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = step(x)
    assert torch.equal(out, torch.zeros_like(x))
    assert [str(w.message) for w in seen if "posattn" in str(w.message)] == []


def test_a_killed_build_does_not_hang_the_next(lib, tmp_path):
    """A build killed mid-way leaves torch's ``lock`` file behind, on which torch waits forever;
    the next process must load the kernels regardless (here: from a copy of this build)."""
    build = native._build_directory()
    copy = tmp_path / build.name
    shutil.copytree(build, copy, ignore=shutil.ignore_patterns("*lock"))
    (copy / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "from posattn.attention import native; print(native.kernels())"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "posattn_native" in done.stdout, done.stderr
    assert not (copy / "lock").exists()


def test_kernel_rejects_bad_input(lib):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match="table must be"):
        lib.biased_backward(q, q, q, torch.randn(3, 15), None, None, None, None, None, q, torch.randn(1, 2, 8), q,
                            False, 4)
    with pytest.raises(RuntimeError, match="float32"):
        lib.biased_backward(q.double(), q, q, torch.randn(2, 15), None, None, None, None, None, q,
                            torch.randn(1, 2, 8), q, False, 4)
    with pytest.raises(RuntimeError, match="keep must be"):
        lib.biased_forward(q, q, q, None, None, None, None, None, torch.ones(1, 8), False, 4)
    with pytest.raises(RuntimeError, match="lowrank must be"):
        lib.biased_forward(q, q, q, None, None, None, torch.randn(2, 1, 1, 8, 3), None, None, False, 4)
    with pytest.raises(RuntimeError, match="sided must be"):
        lib.biased_forward(q, q, q, None, None, None, None, torch.randn(4, 1, 1, 8), None, False, 4)


def relative_weight(h: int, d: int, window: int, per_head: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*((h,) if per_head else ()), 2 * window + 1, d, generator=g, dtype=torch.float64)


CASES = {  # name -> [(kind, window or rank, per_head)]: kind "table", "q" (query-relative),
    #          "k" (key-relative), "low" (u·vᵀ, u per head [1, h, n, r], v per batch row [b, 1, n, r])
    #          or "sided" (two-sided: a, b per batch row [b, h, n], x, y shared by the batch [1, h, n])
    "table": [("table", 0, True)],
    "query-relative": [("q", 3, True)],
    "key-relative": [("k", 2, False)],
    "query-relative wider than n": [("q", 50, False)],
    "key-relative wider than n": [("k", 50, True)],
    "two query windows + key + table": [("q", 2, True), ("q", 5, False), ("k", 4, True), ("table", 0, True)],
    "low-rank": [("low", 2, True)],
    "two low-rank + query-relative + table": [("low", 1, True), ("low", 3, True), ("q", 2, True), ("table", 0, True)],
    "two-sided": [("sided", 0, True)],
    "two two-sided + low-rank + table": [("sided", 0, True), ("sided", 0, True), ("low", 2, True), ("table", 0, True)],
}


def case_weights(specs: list[tuple[str, int, bool]], table: torch.Tensor, b: int, h: int, n: int,
                 d: int) -> list[torch.Tensor]:
    """The leaves of each term of ``specs``: a table, W of a relative term, or u and v."""
    out = []
    for i, (kind, size, per_head) in enumerate(specs):
        g = torch.Generator().manual_seed(10 + i)
        if kind == "table":
            out.append(table)
        elif kind == "low":
            out += [torch.randn(1, h, n, size, generator=g, dtype=torch.float64),
                    torch.randn(b, 1, n, size, generator=g, dtype=torch.float64)]
        elif kind == "sided":
            out += [torch.randn(*shape, generator=g, dtype=torch.float64)
                    for shape in ((b, h, n), (1, h, n), (b, h, n), (1, h, n))]
        else:
            out.append(relative_weight(h, d, size, per_head, seed=i))
    return out


def case_terms(specs: list[tuple[str, int, bool]], leaves: list[torch.Tensor], q: torch.Tensor,
               k: torch.Tensor) -> list[Term]:
    it = iter(leaves)
    return [Toeplitz(next(it)) if kind == "table" else LowRank(next(it), next(it)) if kind == "low"
            else TwoSided(next(it), next(it), next(it), next(it)) if kind == "sided"
            else QueryRelative(k if kind == "k" else q, next(it), size, 0.3, key_side=kind == "k")
            for kind, size, _ in specs]


@pytest.mark.parametrize("block", [None, 16], ids=["one-block", "3-blocks"])
@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_path_equals_the_reference(calls, monkeypatch, case, causal, pad, block):
    """Forward and backward kernels (tables, clipped query/key-relative bands summed and
    widened, low-rank factors concatenated, two-sided vectors summed; padding keys hidden) against
    the float64 reference: outputs and every gradient, including W's, u's, v's and a, x, b, y's;
    in one block of query rows, and in three (a decoder's kernels skip the keys after each block,
    the last block is short)."""
    if block is not None:
        monkeypatch.setattr(native, "BLOCK", block)
    b, h, n, d = 2, 3, 37, 8
    q, k, v, table = inputs(b, h, h, n, d, seed=7)
    keep = keep_mask(b, n) if pad else None
    specs = CASES[case]
    weights = case_weights(specs, table, b, h, n, d)

    def run(dtype: torch.dtype, path: str) -> list[torch.Tensor]:
        qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        ws = [w.detach().to(dtype).requires_grad_() for w in weights]
        terms = case_terms(specs, ws, qq, kk)
        if path == "reference":
            out = reference.attend(qq, kk, vv, terms, keep, causal)
        else:
            policy = Policy(force="fused")
            assert plan(qq, terms, causal, policy=policy, keep=keep) == "fused"
            out = fast.attend(qq, kk, vv, terms, keep, causal, policy=policy)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
        return [out, *torch.autograd.grad(out, [qq, kk, vv, *ws], g)]

    ref, got = run(torch.float64, "reference"), run(torch.float32, "fast")
    assert len(calls) == 1
    for i, (a, r) in enumerate(zip(got, ref)):
        err = (a.double() - r).abs().max().item()
        assert err <= 3e-5 * (1 + r.abs().max().item()), f"tensor {i}: max error {err:.2e}"


def test_default_plans_with_the_kernels():
    """Query-relative terms up to fused_max_n (float32, with or without padding); in a decoder
    from causal_fused_min_n on, tables too; learned tables with padding beyond fused_grad_max_n:
    fused."""
    w = torch.zeros(9, 8, requires_grad=True)
    for n in (64, 1024):
        q = torch.zeros(1, 2, n, 8, requires_grad=True)
        keep = torch.ones(1, n, dtype=torch.bool)
        assert plan(q, [QueryRelative(q, w, 4, 1.0)], False) == "fused"
        assert plan(q, [QueryRelative(q, w, 4, 1.0)], False, keep=keep) == "fused"
        assert plan(q, [QueryRelative(q, w, 4, 1.0)], False, policy=Policy(native=False)) != "fused"
    assert plan(q, [QueryRelative(q, w, 4, 1.0)], True, policy=Policy(fused_max_n=512)) == "banded"
    q = torch.zeros(1, 2, 256, 8)
    table = torch.zeros(2, 511, requires_grad=True)
    assert plan(q, [Toeplitz(table)], False, keep=torch.ones(1, 256, dtype=torch.bool)) == "fused"
    assert plan(q, [Toeplitz(table)], False) == "flash_bias"
    assert plan(q, [Toeplitz(table)], True) == "flash_bias"  # one block: nothing to skip
    for n in (512, 2048):
        q = torch.zeros(1, 2, n, 8)
        table = torch.zeros(2, 2 * n - 1, requires_grad=True)
        assert plan(q, [Toeplitz(table)], True) == "fused"
        assert plan(q, [Toeplitz(table)], False) == "flash_bias"
        with torch.no_grad():
            assert plan(q, [Toeplitz(table)], True) == "fused"
        assert plan(q, [Toeplitz(table)], True, policy=Policy(causal_fused_min_n=4096)) == "flash_bias"


def test_default_plans_for_two_sided_terms():
    """An encoder's two-sided term (forget gates): fused up to fused_max_n at any batch (at batch 1
    it is batch-free, yet no position table), flash-bias beyond, dense without the kernels."""
    for b, n in ((1, 64), (16, 512), (1, 4096)):
        q = torch.zeros(b, 2, n, 8, requires_grad=True)
        sided = [TwoSided(*(torch.zeros(b, 2, n, requires_grad=True) for _ in range(4)))]
        assert plan(q, sided, False) == "fused"
        with torch.no_grad():
            assert plan(q, sided, False) == "fused"
        assert plan(q, sided, False, policy=Policy(native=False)) == ("dense" if n <= 512 else "flash_bias")
    q = torch.zeros(1, 2, 8192, 8)
    assert plan(q, [TwoSided(*(torch.zeros(1, 2, 8192) for _ in range(4)))], False) == "flash_bias"


def test_default_plans_for_narrow_low_rank_terms():
    """Narrow u·vᵀ terms alone (segment, causal ALiBi): fused in a decoder and at inference, a
    q/k fold into SDPA for an encoder's training step and, in an encoder, beyond dense_max_n."""
    q = torch.zeros(1, 2, 128, 64, requires_grad=True)
    low = [LowRank(torch.zeros(1, 2, 128, 2, requires_grad=True), torch.zeros(1, 1, 128, 2))]
    assert plan(q, low, True) == "fused"
    assert plan(q, low, True, policy=Policy(dense_max_n=64)) == "fused"  # a decoder at any length
    assert plan(q, low, False) == "sdpa"
    with torch.no_grad():
        assert plan(q, low, False) == "fused"
        assert plan(q, low, False, policy=Policy(native=False)) == "sdpa"
        assert plan(q, low, False, policy=Policy(dense_max_n=64)) == "sdpa"
    assert plan(q.to("meta"), low, True) == "sdpa"  # CPU kernels: never for another device


@pytest.mark.parametrize("k", [1, 2, 3, 9, 31])
def test_native_depthwise_convolution_equals_grouped_conv1d(lib, k):
    """The C++ depthwise convolution (channels last) against PyTorch's grouped Conv1d in float64:
    output, ∂x and ∂w, causal and centered; float32 inputs take it by default."""
    from posattn.mechanisms.conv import METHODS, conv_method, depthwise_conv1d

    g = torch.Generator().manual_seed(k)
    x64 = torch.randn(2, 150, 20, generator=g, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(20, k, generator=g, dtype=torch.float64, requires_grad=True)
    x, w = (t.detach().float().requires_grad_() for t in (x64, w64))
    for causal in [True] if k % 2 == 0 else [True, False]:
        left = k - 1 if causal else (k - 1) // 2
        ref = F.conv1d(F.pad(x64.transpose(1, 2), (left, k - 1 - left)), w64.unsqueeze(1), groups=20).transpose(1, 2)
        out = METHODS["native"](x, w, left)
        grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        for a, r in zip([out, *torch.autograd.grad(out, [x, w], grad.float())],
                        [ref, *torch.autograd.grad(ref, [x64, w64], grad)]):
            torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-4)
    assert conv_method(k, x) == "native" and conv_method(k, x64) != "native"
    assert conv_method(200, x) == "fft"
    keep = torch.ones(2, 150, dtype=torch.bool)
    keep[0, 140:] = False
    y = depthwise_conv1d(x, w[0], True, keep)   # one shared filter, padding zeroed first
    torch.testing.assert_close(y, METHODS["conv1d"](x * keep[..., None], w[0].expand(20, k), k - 1))
