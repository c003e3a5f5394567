"""The counter-based CPU dropout: Bernoulli(p) masks, reproducible from torch's seed, the same
mask in the backward, and the same drops in the reference and the fast attention paths."""
from __future__ import annotations

import math

import pytest
import torch

from posattn.attention import dropout as dmod
from posattn.attention import fast, native, reference
from posattn.attention.dropout import Dropout, dropout, hashed

from .test_fast_paths import assert_close, keep_mask, rand, structures


@pytest.fixture(scope="module", autouse=True)
def lib():
    assert native.kernels() is not None, "a C++ compiler is here, so the kernels must build"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_rate_and_scale(p: float, dtype: torch.dtype) -> None:
    x = torch.rand(1000, 1003, dtype=dtype) + 0.5          # no zeros of its own; odd size: a partial chunk
    assert hashed(x)
    y = dropout(x, p, True)
    dropped = y == 0
    n = x.numel()
    assert abs(dropped.sum().item() - p * n) < 6 * math.sqrt(n * p * (1 - p))   # binomial, 6 sigma
    torch.testing.assert_close(y[~dropped], x[~dropped] / (1 - p))


def test_masks_are_reproducible_independent_and_thread_count_free() -> None:
    x = torch.ones(4, 300_000)
    torch.manual_seed(7)
    a, b = dropout(x, 0.3, True), dropout(x, 0.3, True)
    torch.manual_seed(7)
    assert torch.equal(dropout(x, 0.3, True), a)          # torch's seed decides the mask
    ma, mb = (a == 0).double().flatten(), (b == 0).double().flatten()
    assert abs(torch.corrcoef(torch.stack([ma, mb]))[0, 1]) < 0.01        # successive calls: new masks
    assert abs(torch.corrcoef(torch.stack([ma[1:], ma[:-1]]))[0, 1]) < 0.01  # neighbours independent
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(7)
        assert torch.equal(dropout(x, 0.3, True), a)
    finally:
        torch.set_num_threads(threads)


def test_backward_uses_the_forward_mask() -> None:
    x = rand(3, 50, 7)
    y = dropout(x, 0.4, True)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, torch.where(y == 0, 0.0, g / 0.6))
    torch.autograd.gradcheck(lambda t: dmod._HashDropout.apply(t, 0.4, 123), (rand(2, 9),))


def test_identity_and_fallbacks() -> None:
    x = torch.randn(64, 64)
    assert dropout(x, 0.5, False) is x and dropout(x, 0.0, True) is x
    assert torch.equal(dropout(x, 1.0, True), torch.zeros_like(x))
    half = x.bfloat16()
    assert not hashed(half)
    y = dropout(half, 0.5, True)                              # torch's dropout where the kernel does not apply
    assert y.dtype == torch.bfloat16 and 0.3 < (y == 0).float().mean().item() < 0.7
    module = Dropout(0.25)
    assert "p=0.25" in repr(module) and module.eval()(x) is x


@pytest.mark.parametrize("causal", [False, True], ids=["enc", "dec"])
@pytest.mark.parametrize("name", ["none", "toeplitz-window", "two-windows+lowrank", "query+key-relative+toeplitz"])
def test_fast_path_drops_what_the_reference_drops(name: str, causal: bool) -> None:
    """Training with dropout: the fast path (dense product on the CPU) equals the reference on the
    same seed, in outputs and gradients."""
    b, h, n, d = 2, 2, 24, 4
    q, k, v = rand(b, h, n, d, seed=1), rand(b, h, n, d, seed=2), rand(b, h, n, d, seed=3)
    outs = []
    for attend in (fast.attend, reference.attend):
        terms, params, _ = structures(q, k, n, h)[name] if name != "none" else ([], [], "")  # fresh leaves
        torch.manual_seed(0)
        o = attend(q, k, v, terms, keep_mask(b, n), causal, 0.3, True)
        outs.append((o, torch.autograd.grad(o.square().sum(), [q, k, v, *params])))
    (o1, g1), (o2, g2) = outs
    undropped = reference.attend(q, k, v, terms, keep_mask(b, n), causal)
    assert (o1 - undropped).abs().max() > 0.1                 # dropout did act
    assert_close(o1, o2, "output")
    for a, c in zip(g1, g2):
        assert_close(a, c, "gradient")
