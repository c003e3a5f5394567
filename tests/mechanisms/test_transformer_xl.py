"""Transformer-XL's relative attention (Dai et al. 2019, §3.3): the scores against a slow reference
written from the paper's A^rel_ij, terms (a)-(d), every fast path equal to the reference path
in outputs and gradients (no dense fallback), causality, translation invariance, the neutral
start and cached decoding."""
from __future__ import annotations

import math

import pytest
import torch
from core.helpers import model

from posattn.attention import fast
from posattn.attention.layer import Attention
from posattn.attention.terms import LowRank, QueryRelative, Toeplitz
from posattn.mechanisms import Dims, build
from posattn.mechanisms.base import Context

from .paths import assert_causal_and_decodes_as_recompute, assert_fast_equals_reference

H, DH = 2, 8
D = H * DH


def dims(causal: bool) -> Dims:
    return Dims(d_model=D, n_heads=H, n_layers=1, max_len=16, n_segments=1, causal=causal)


def layer(causal: bool, seed: int = 0) -> Attention:
    d = dims(causal)
    torch.manual_seed(seed)
    attn = Attention(d, build(["transformer_xl"], d).layers[0], "reference").double()
    with torch.no_grad():  # W_R, u, v of the size of q and k, so every term counts
        mech = attn.mechanisms[0]
        mech.w_r.weight.normal_(0, 0.3)
        mech.u.normal_()
        mech.v.normal_()
    return attn.eval()


def ctx(n: int, b: int = 2, causal: bool = False, start: int = 0) -> Context:
    pos = torch.arange(start, start + n).expand(b, n)
    return Context(positions=pos, segments=torch.zeros_like(pos), keep=None, causal=causal)


def sinusoid(distance: int) -> torch.Tensor:
    """R_{i−j}: Vaswani et al. §3.5 at the distance i − j, [sin(δ/10⁴^{2m/d}), cos(·)] interleaved."""
    out = []
    for c in range(D):
        ang = distance / 10000.0 ** (2 * (c // 2) / D)
        out.append(math.sin(ang) if c % 2 == 0 else math.cos(ang))
    return torch.tensor(out, dtype=torch.float64)


def slow_scores(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """A^rel_ij/√d_h, term by term and entry by entry (Dai et al. 2019, §3.3), from the layer's
    weights: (a) q_i·k_j, (b) q_i·W_R R_{i−j}, (c) u·k_j, (d) v·W_R R_{i−j}."""
    mech = attn.mechanisms[0]
    b, n, _ = x.shape
    proj = x @ attn.qkv.weight.T + attn.qkv.bias
    q, k = proj[..., :D].view(b, n, H, DH), proj[..., D:2 * D].view(b, n, H, DH)
    out = torch.zeros(b, H, n, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(H):
            for i in range(n):
                for j in range(n):
                    wr = (mech.w_r.weight @ sinusoid(i - j))[h * DH:(h + 1) * DH]
                    a = q[bi, i, h] @ k[bi, j, h]
                    terms = a + q[bi, i, h] @ wr + mech.u[h] @ k[bi, j, h] + mech.v[h] @ wr
                    out[bi, h, i, j] = terms / math.sqrt(DH)
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_scores_are_the_papers_four_terms(causal):
    attn = layer(causal)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = attn.scores(x, ctx(7, causal=causal))
    torch.testing.assert_close(got.detach(), slow_scores(attn, x).detach(), rtol=1e-10, atol=1e-10)


def test_each_term_has_its_exact_structure():
    """(b) query-relative over every offset, (c) rank 1, (d) a position-only Toeplitz table."""
    mech = layer(False).mechanisms[0]
    n = 9
    q, k = torch.randn(2, H, n, DH, dtype=torch.float64), torch.randn(2, H, n, DH, dtype=torch.float64)
    b, c, d = mech.score_terms(q, k, ctx(n))
    assert isinstance(b, QueryRelative) and b.window == n - 1 and not b.key_side
    assert isinstance(c, LowRank) and c.u.shape[-1] == 1
    assert isinstance(d, Toeplitz) and d.table.shape == (H, 2 * n - 1)


def make_inputs(n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, H, n, DH, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("path", ["dense", "flash_bias", "fused"])
def test_every_fast_path_equals_the_reference_in_outputs_and_gradients(path, causal, padded):
    """Each path the planner may take for these terms (the fused kernels in float32, as they
    run), outputs and the gradients of q, k, v, W_R, u and v."""
    dtype = torch.float32 if path == "fused" else torch.float64
    n = 37
    attn = layer(causal)
    mech = attn.mechanisms[0].to(dtype)
    q, k, v = make_inputs(n, dtype)
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[1, :5] = False
    keep = keep if padded else None
    policy = fast.Policy(flash_chunk=16, grad_chunk=8)
    assert_fast_equals_reference(mech, lambda: ctx(n, causal=causal), q, k, v, keep, list(mech.parameters()),
                                 lambda t: fast.run(path, q, k, v, t, keep, causal, policy=policy),
                                 grad_tol=1e-4, causal=causal)


def test_long_inputs_take_the_linear_memory_paths():
    """No n×n bias: the fused kernels up to their length (float32), flash-bias beyond."""
    mech = layer(False).mechanisms[0].float()
    for n, path in ((64, "fused"), (1024, "fused"), (5000, "flash_bias")):
        q = torch.randn(1, H, n, DH)
        with torch.no_grad():
            assert fast.plan(q, mech.score_terms(q, q, ctx(n, 1)), False) == path, n


def test_the_decoder_is_causal_and_cached_decoding_equals_recompute():
    assert_causal_and_decodes_as_recompute(model("transformer_xl", causal=True, seed=3))


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_scores_depend_on_offsets_only(causal):
    """Shifted position ids change nothing: the terms are built from offsets j − i alone."""
    attn = layer(causal)
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(attn(x, ctx(9, causal=causal, start=13)), attn(x, ctx(9, causal=causal)),
                               rtol=0, atol=0)
    scores = attn.scores(x[:1, :1].expand(1, 9, D), ctx(9, 1))  # one token repeated: a Toeplitz matrix
    for off in range(-8, 9):
        diag = torch.diagonal(scores, off, -2, -1)
        torch.testing.assert_close(diag, diag[..., :1].expand_as(diag), rtol=1e-12, atol=1e-12)


def test_a_neutral_start_adds_nothing_and_trains():
    attn, plain = layer(False), layer(False)
    plain.mechanisms = torch.nn.ModuleList()
    mech = attn.mechanisms[0]
    assert mech.start_at_zero()
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = attn(x, ctx(8))
    torch.testing.assert_close(out, plain(x, ctx(8)), rtol=0, atol=1e-14)
    out.pow(2).sum().backward()
    assert mech.u.grad.abs().max() > 0 and mech.w_r.weight.grad.abs().max() > 0


def test_positional_parameters_are_w_r_u_and_v():
    from posattn.mechanisms import properties

    d = Dims(d_model=32, n_heads=4, n_layers=3, max_len=64, n_segments=1, causal=True)
    assert properties("transformer_xl", d)["positional_params"] == 3 * (32 * 32 + 2 * 4 * 8)
