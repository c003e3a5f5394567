"""Each mechanism's defining claim, checked against independently written formulas."""
from __future__ import annotations

import math

import pytest
import torch
from mixers.slow_mixers import COVERED as MIXERS_COVERED
from mixers.slow_mixers import slow_mixer_layer

from posattn.attention.layer import Attention
from posattn.mechanisms import build
from posattn.mechanisms.alibi import alibi_slopes
from posattn.mechanisms.t5 import t5_bucket

from .helpers import (
    NAMES,
    VARIANTS,
    context,
    dims,
    layer_mechanism,
    model,
    randomize,
    run,
    segments_for,
    skip_encoder_only,
    spec_id,
    tokens,
    with_path,
)
from .slow import COVERED, sinusoid_ref, slow_layer, t5_bucket_ref

INPUT_LEVEL = {"absolute", "sinusoidal"}
LAYER_SPECS = [n for n in NAMES if n not in INPUT_LEVEL] + [
    {"name": "tupe", "relative_bias": True},
    {"name": "cat", "kernel_size": 5, "depthwise": True, "qk_norm": True},
    {"name": "conv_qkv", "targets": "qk", "kernel_size": 3},
    {"name": "diet_abs", "sharing": "head", "rank": 3},
    {"name": "rope", "scaling": "yarn", "factor": 4.0, "original_max_len": 4},
    {"name": "dynamic_conv", "kernel_size": 3},
    {"name": "key_dynamic_conv", "kernel_size": 3},
    {"name": "diet_rel", "max_distance": 2},
    {"name": "landmark_cat", "block_size": 2, "top_k": 2, "selection": "soft"},
    {"name": "linformer", "k": 3, "sharing": "kv"},
    {"name": "convbert", "head_ratio": 1, "conv_kernel_size": 3},
    {"name": "lincat", "chunk": 3},
    {"name": "kerple", "kernel": "power"},
    {"name": "sandwich", "dim": 6},
    {"name": "dynamic_pos_bias", "log_distance": True, "norm": True, "depth": 1},
    {"name": "alibi", "heads": 3, "learned": True},
    {"name": "alibi", "learned": True, "bidirectional": "asymmetric"},
    {"name": "forgetting", "bias_init": 0.5, "post_log_scale": 2.0},
]


def attention_layer(spec, causal, path="reference", seed=0, **kw):
    d = dims(causal=causal, **kw)
    mechs = build(spec if isinstance(spec, list) else [spec], d).layers[0]
    torch.manual_seed(seed)
    attn = Attention(d, mechs, path).double()
    return randomize(attn, seed).eval(), d


# -- every mechanism against the loop-by-loop formulas ---------------------------------------

def test_every_registered_mechanism_has_a_slow_formula():
    missing = set(NAMES) - COVERED - MIXERS_COVERED - INPUT_LEVEL
    assert not missing, f"tests/core/slow.py has no formula for {sorted(missing)}"


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("spec", LAYER_SPECS, ids=spec_id)
def test_layer_matches_slow_formula(spec, causal, path):
    skip_encoder_only(spec, causal)
    attn, d = attention_layer(spec, causal, path, seed=5)
    b, n = 2, 7
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, n, d.d_model, generator=g, dtype=torch.float64)
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[1, :2] = False
    keep[1, -1] = False
    seg = torch.tensor([[0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 1, 1, 1, 1]])
    pos = torch.arange(n).expand(b, n)
    ctx = context(n, b, causal, keep=keep, segments=seg)
    got = attn(x, ctx)
    mixer = any(m.mixes for m in attn.mechanisms)
    want = slow_mixer_layer(attn, x, keep, causal, pos) if mixer else slow_layer(attn, x, keep, causal, seg, pos)
    real = keep
    torch.testing.assert_close(got[real], want[real], rtol=1e-9, atol=1e-10)


def test_input_mechanisms_match_formulas():
    d = dims()
    x = torch.randn(2, 9, d.d_model, dtype=torch.float64)
    pos = torch.tensor([list(range(9)), list(range(3, 12))])
    ctx = context(9, 2, positions=pos)
    absolute = layer_mechanism("absolute", d)
    torch.testing.assert_close(absolute.embed(x, ctx), x + absolute.embedding.weight[pos])
    sinus = layer_mechanism("sinusoidal", d)
    want = torch.tensor([[sinusoid_ref(int(p), d.d_model) for p in row] for row in pos], dtype=torch.float64)
    torch.testing.assert_close(sinus.embed(x, ctx), x + want)
    seg = torch.tensor([[0, 1, 2] * 3, [2] * 9])
    seg_in = layer_mechanism({"name": "segment", "mode": "input"}, d)
    torch.testing.assert_close(seg_in.embed(x, context(9, 2, segments=seg)), x + seg_in.embedding.weight[seg])


# -- Chang et al.: composite, Shaw, key-based ------------------------------------------------

@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_composite_is_fixed_plus_dynamic(causal, path):
    both = model(["fixed_conv", "dynamic_conv"], causal=causal, seed=1, path=path)
    comp = model(["composite"], causal=causal, seed=9, path=path)
    state = {}
    for key, t in both.state_dict().items():
        key = key.replace("mechanisms.0.beta", "mechanisms.0.fixed.beta")
        key = key.replace("mechanisms.1.weight", "mechanisms.0.dynamic.weight")
        state[key] = t
    comp.load_state_dict(state, strict=True)
    ids = tokens(2, 20, seed=3)  # longer than the kernel: clipping at ±8 is exercised
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[1, 15:] = False
    a, b = run(both, ids, keep), run(comp, ids, keep)
    torch.testing.assert_close(a[keep], b[keep], rtol=1e-12, atol=1e-12)
    # and composite is not just one of its parts
    fixed_only = model(["fixed_conv"], causal=causal, seed=1, path=path)
    fixed_only.load_state_dict({k: v for k, v in both.state_dict().items() if "mechanisms.1" not in k})
    assert (run(fixed_only, ids, keep) - a)[keep].abs().max() > 1e-3


def shaw_scores(q, k, w_rel, window, key_side=False):
    """Shaw et al. 2018 with an explicit relative-embedding tensor a[i][j] (lists, no gathers)."""
    b, h, n, dh = q.shape
    a = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            r = (i - j) if key_side else (j - i)
            a[i][j] = w_rel[min(window, max(-window, r)) + window]
    s = torch.zeros(b, h, n, n, dtype=q.dtype)
    for bi in range(b):
        for hh in range(h):
            for i in range(n):
                for j in range(n):
                    if key_side:
                        s[bi, hh, i, j] = (q[bi, hh, i] @ k[bi, hh, j] + k[bi, hh, j] @ a[i][j]) / math.sqrt(dh)
                    else:
                        s[bi, hh, i, j] = q[bi, hh, i] @ (k[bi, hh, j] + a[i][j]) / math.sqrt(dh)
    return s


@pytest.mark.parametrize("name,key_side", [("dynamic_conv", False), ("key_dynamic_conv", True)])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_dynamic_conv_is_shaw(name, key_side, causal):
    attn, d = attention_layer({"name": name, "kernel_size": 5}, causal, seed=2)
    n = 8
    x = torch.randn(2, n, d.d_model, dtype=torch.float64)
    ctx = context(n, 2, causal)
    q, k, _ = attn.project(x, ctx)
    want = shaw_scores(q, k, attn.mechanisms[0].weight, 2, key_side)
    torch.testing.assert_close(attn.scores(x, ctx), want, rtol=1e-10, atol=1e-12)


# -- Toeplitz structure ----------------------------------------------------------------------

TOEPLITZ = ["t5", "fixed_conv", "tisa", "diet_rel", "alibi",
            {"name": "t5", "num_buckets": 8, "max_distance": 10},
            {"name": "fixed_conv", "kernel_size": 3}, {"name": "diet_rel", "max_distance": 3}]


@pytest.mark.parametrize("spec", TOEPLITZ, ids=spec_id)
def test_bias_is_toeplitz(spec):
    attn, d = attention_layer(spec, causal=False, seed=4)
    n = 16
    x = torch.randn(2, n, d.d_model, dtype=torch.float64)
    ctx = context(n, 2)
    q, k, _ = attn.project(x, ctx)
    bias = attn.scores(x, ctx) - q @ k.transpose(-1, -2) / math.sqrt(d.head_dim)
    torch.testing.assert_close(bias[0], bias[1])  # input independent
    bias = bias[0]
    for off in range(-(n - 1), n):
        diag = torch.diagonal(bias, offset=off, dim1=-2, dim2=-1)  # [h, n − |off|]
        torch.testing.assert_close(diag, diag[:, :1].expand_as(diag), rtol=0, atol=1e-12)
    # not a constant: the term really depends on the offset
    assert (bias[:, 0, :] - bias[:, 0, :1]).abs().max() > 1e-4


def test_causal_decoder_alibi_equals_the_toeplitz_penalty_after_softmax():
    """In a decoder ALiBi is declared in its rank-1 form; the attention must equal −m|j−i|."""
    enc, d = attention_layer("alibi", causal=True)
    n = 9
    x = torch.randn(1, n, d.d_model, dtype=torch.float64)
    ctx = context(n, 1, causal=True)
    q, k, v = enc.project(x, ctx)
    s = q @ k.transpose(-1, -2) / math.sqrt(d.head_dim)
    r = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    slopes = torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8], dtype=torch.float64)
    s = s - slopes[:, None, None] * r.abs()
    s = s.masked_fill(r > 0, float("-inf"))
    o = torch.softmax(s, -1) @ v
    want = enc.out(o.transpose(1, 2).reshape(1, n, -1))
    for path in ("reference", "fast"):
        enc.path = path
        torch.testing.assert_close(enc(x, ctx), want, rtol=1e-10, atol=1e-12)


# -- DIET Theorem 1: rank --------------------------------------------------------------------

def score_ranks(m, ids):
    s = m.score_matrices(ids)[0][0]  # first layer, first example: [h, n, n]
    return [int(torch.linalg.matrix_rank(s[h])) for h in range(s.shape[0])]


def test_diet_abs_rank_exceeds_head_dim():
    """DIET Thm 1: A_r = XW_QW_KᵀXᵀ + P̂P̂ᵀ reaches rank d_h + d_p > d_h, input P never exceeds d_h."""
    n, dh = 20, 4  # d_model 16, 4 heads
    ids = tokens(1, n, seed=2)
    diet = model(["diet_abs"], seed=1, max_len=n)
    with torch.no_grad():  # the proof's construction: P_K = P_Q = P̂ (generic, full rank d_p)
        for block in diet.blocks:
            mech = block.attn.mechanisms[0]
            mech.p_k.copy_(mech.p_q)
    assert score_ranks(diet, ids) == [dh + dh] * 4
    wide = model([{"name": "diet_abs", "rank": 10}], seed=1, max_len=n)
    assert score_ranks(wide, ids) == [dh + 10] * 4
    for name in ("absolute", "none", "sinusoidal"):
        ranks = score_ranks(model([name], seed=1, max_len=n), ids)
        assert max(ranks) <= dh, (name, ranks)
        assert max(ranks) == dh  # the bound is reached, so the rank computation is meaningful


# -- permutation equivariance ----------------------------------------------------------------

@pytest.mark.parametrize("path", ["reference", "fast"])
def test_none_is_permutation_equivariant(path):
    ids = tokens(2, 11, seed=5)
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(0))
    m = model(["none"], seed=2, path=path)
    torch.testing.assert_close(run(m, ids)[:, perm], run(m, ids[:, perm]), rtol=1e-10, atol=1e-12)
    # a mechanism with position is not (the test can fail)
    a = model(["absolute"], seed=2, path=path)
    assert (run(a, ids)[:, perm] - run(a, ids[:, perm])).abs().max() > 1e-3


# -- causality -------------------------------------------------------------------------------

CAUSAL_SPECS = [[n] for n in NAMES] + VARIANTS


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("specs", CAUSAL_SPECS, ids=spec_id)
def test_decoder_is_causal(specs, path):
    skip_encoder_only(specs[0], True)
    m = model(specs, causal=True, seed=6, path=path)
    n, t = 14, 6
    ids = tokens(2, n, seed=1)
    changed = ids.clone()
    changed[:, t + 1:] = (ids[:, t + 1:] + 1 + torch.arange(n - t - 1)) % 37
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[1, :3] = False  # left padding on one row
    for mask in (None, keep):
        a, b = run(m, ids, mask), run(m, changed, mask)
        torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-12)
        assert (a[:, t + 1:] - b[:, t + 1:]).abs().max() > 1e-6  # the future did change


# -- T5 buckets ------------------------------------------------------------------------------

# Values of mesh_tensorflow's _relative_position_bucket (num_buckets 32, max_distance 128).
T5_BIDIRECTIONAL = {-1000: 15, -128: 15, -127: 15, -100: 15, -64: 14, -63: 13, -33: 12, -32: 12,
                    -20: 10, -16: 10, -12: 9, -9: 8, -8: 8, -7: 7, -1: 1, 0: 0, 1: 17, 7: 23,
                    8: 24, 20: 26, 64: 30, 128: 31, 1000: 31}
T5_CAUSAL = {-1000: 31, -128: 31, -100: 30, -64: 26, -32: 21, -20: 17, -16: 16, -15: 15, -1: 1,
             0: 0, 1: 0, 100: 0}


def test_t5_buckets_match_raffel():
    r = torch.tensor(list(T5_BIDIRECTIONAL))
    assert t5_bucket(r, True, 32, 128).tolist() == list(T5_BIDIRECTIONAL.values())
    r = torch.tensor(list(T5_CAUSAL))
    assert t5_bucket(r, False, 32, 128).tolist() == list(T5_CAUSAL.values())
    for bi in (True, False):
        for nb, md in ((32, 128), (16, 64), (8, 20), (10, 40)):
            r = torch.arange(-300, 301)
            want = [t5_bucket_ref(int(x), bi, nb, md) for x in r]
            assert t5_bucket(r, bi, nb, md).tolist() == want, (bi, nb, md)


def test_t5_is_shared_across_layers_by_default():
    m = model(["t5"], seed=0, n_layers=3)
    mechs = [b.attn.mechanisms[0] for b in m.blocks]
    assert all(x is mechs[0] for x in mechs)
    m = model([{"name": "t5", "share_layers": False}], seed=0, n_layers=3)
    assert len({id(b.attn.mechanisms[0]) for b in m.blocks}) == 3
    assert model(["t5"], causal=True).blocks[0].attn.mechanisms[0].bidirectional is False
    assert model(["t5"]).blocks[0].attn.mechanisms[0].num_buckets == 32
    assert model(["t5"]).blocks[0].attn.mechanisms[0].max_distance == 128


# -- ALiBi -----------------------------------------------------------------------------------

def test_alibi_slopes_match_press():
    # Press et al. 2022 §3: 8 heads -> 1/2 … 1/2^8; 16 heads -> 1/2^0.5 … 1/2^8
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)]))
    torch.testing.assert_close(alibi_slopes(16), torch.tensor([2.0 ** (-i / 2) for i in range(1, 17)]))
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]))
    # not a power of two (the official get_slopes): the 8-head slopes, then every other 16-head one
    want12 = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(want12))
    want6 = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    torch.testing.assert_close(alibi_slopes(6), torch.tensor(want6))


# -- RoPE, PI, YaRN --------------------------------------------------------------------------

def rotated(spec, q, k, positions, head_dim=8):
    d = dims(d_model=2 * head_dim, n_heads=2, max_len=16)
    mech = layer_mechanism(spec, d)
    ctx = context(q.shape[2], 1, positions=positions)
    q2, k2, _ = mech.transform_qkv(q, k, q, ctx)
    return q2, k2, mech


@pytest.mark.parametrize("spec", ["rope", {"name": "rope", "scaling": "linear", "factor": 3.0},
                                  {"name": "rope", "scaling": "yarn", "factor": 4.0}], ids=spec_id)
def test_rope_dot_products_depend_only_on_offset(spec):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 8, generator=g, dtype=torch.float64).expand(1, 2, 10, 8)
    k = torch.randn(1, 2, 1, 8, generator=g, dtype=torch.float64).expand(1, 2, 10, 8)
    base = torch.arange(10)[None]
    q0, k0, _ = rotated(spec, q, k, base)
    dots = q0 @ k0.transpose(-1, -2)  # same q and k at every position: [1, 2, 10, 10]
    for off in range(-9, 10):
        diag = torch.diagonal(dots, off, -2, -1)
        torch.testing.assert_close(diag, diag[..., :1].expand_as(diag), rtol=1e-10, atol=1e-12)
    q1, k1, _ = rotated(spec, q, k, base + 37)  # a global shift changes vectors, not dot products
    torch.testing.assert_close(q1 @ k1.transpose(-1, -2), dots, rtol=1e-10, atol=1e-12)
    assert (q1 - q0).abs().max() > 1e-3
    assert (dots[..., 0, 1] - dots[..., 0, 5]).abs().max() > 1e-6


def test_rope_frequencies_pi_and_yarn():
    dh, base = 8, 10000.0
    theta = torch.tensor([base ** (-2 * m / dh) for m in range(dh // 2)], dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 6, dh, generator=g, dtype=torch.float64)
    pos = torch.arange(6)[None]
    plain, _, m = rotated("rope", q, q, pos)
    torch.testing.assert_close(m.theta.double(), theta.float().double())
    assert m.mscale == 1.0
    # position interpolation: positions divided by the factor
    pi, _, m = rotated({"name": "rope", "scaling": "linear", "factor": 3.0}, q, q, pos * 3)
    torch.testing.assert_close(pi, plain, rtol=1e-6, atol=1e-6)
    # YaRN (Peng et al. 2023): ramp γ over r = L/λ, θ' = (1−γ)θ/s + γθ, √(1/t) = 0.1 ln s + 1
    s, L, alpha, beta = 4.0, 512, 1.0, 32.0
    yarn = {"name": "rope", "scaling": "yarn", "factor": s, "original_max_len": L}
    _, _, m = rotated(yarn, q, q, pos)
    want = []
    for th in theta.tolist():
        r = L / (2 * math.pi / th)
        gamma = 0.0 if r < alpha else 1.0 if r > beta else (r - alpha) / (beta - alpha)
        want.append((1 - gamma) * th / s + gamma * th)
    torch.testing.assert_close(m.theta.double(), torch.tensor(want).float().double())
    assert m.theta[0] == pytest.approx(theta[0].item())  # highest frequency: extrapolated as is
    assert m.theta[-1] == pytest.approx(theta[-1].item() / s, rel=1e-6)  # lowest: interpolated
    assert m.mscale == pytest.approx(0.1 * math.log(s) + 1.0)
    y, _, _ = rotated(yarn, q, q, torch.zeros(1, 6, dtype=torch.long))  # position 0: no rotation
    torch.testing.assert_close(y, q * (0.1 * math.log(s) + 1.0))
    # factor 1 is plain RoPE
    one, _, _ = rotated({"name": "rope", "scaling": "yarn", "factor": 1.0}, q, q, pos)
    torch.testing.assert_close(one, plain)


# -- TISA Eq 5 -------------------------------------------------------------------------------

def test_tisa_equation_5_by_hand():
    d = dims(n_heads=2, d_model=8)
    mech = layer_mechanism({"name": "tisa", "n_kernels": 2}, d)
    with torch.no_grad():
        mech.a.copy_(torch.tensor([[1.0, -0.5], [2.0, 0.25]]))
        mech.b.copy_(torch.tensor([[0.5, -2.0], [0.1, 1.0]]))  # |b| is used
        mech.c.copy_(torch.tensor([[0.0, 1.5], [-1.0, 3.0]]))
    n = 5
    q = torch.zeros(1, 2, n, 4, dtype=torch.float64)
    (term,) = mech.score_terms(q, q, context(n, 1))
    dense = term.dense(n)[0]
    # head 0, r = j − i = 0: 1·e^0 − 0.5·e^{−2·1.5²};  r = 2: e^{−0.5·4} − 0.5·e^{−2·0.25}
    assert dense[0, 0, 0].item() == pytest.approx(1.0 - 0.5 * math.exp(-4.5))
    assert dense[0, 1, 3].item() == pytest.approx(math.exp(-2.0) - 0.5 * math.exp(-0.5))
    # head 1, r = −3: 2·e^{−0.1·4} + 0.25·e^{−1·36};  r = 4: 2·e^{−0.1·25} + 0.25·e^{−1}
    assert dense[1, 3, 0].item() == pytest.approx(2 * math.exp(-0.4) + 0.25 * math.exp(-36.0))
    assert dense[1, 0, 4].item() == pytest.approx(2 * math.exp(-2.5) + 0.25 * math.exp(-1.0))


# -- TUPE ------------------------------------------------------------------------------------

def test_tupe_untied_cls_entries():
    attn, d = attention_layer("tupe", causal=False, seed=3)
    mech = attn.mechanisms[0]
    assert mech.untie_cls
    n = 6
    x = torch.randn(1, n, d.d_model, dtype=torch.float64)
    ctx = context(n, 1)
    scores = attn.scores(x, ctx)[0]
    W, b = attn.qkv.weight, attn.qkv.bias
    dm, dh = d.d_model, d.head_dim
    q = (x[0] @ W[:dm].T + b[:dm]).view(n, 4, dh).transpose(0, 1)
    k = (x[0] @ W[dm:2 * dm].T + b[dm:2 * dm]).view(n, 4, dh).transpose(0, 1)
    pos = scores - q @ k.transpose(-1, -2) / math.sqrt(2 * dh)  # content term scaled by 1/√(2d)
    theta1, theta2 = mech.theta[0], mech.theta[1]
    torch.testing.assert_close(pos[:, 0, :], theta1[:, None].expand(4, n))  # row 0 (incl. [0,0]) = θ1
    torch.testing.assert_close(pos[:, 1:, 0], theta2[:, None].expand(4, n - 1))  # column 0 = θ2
    p = mech.positions.weight[:n]
    pq = (p @ mech.u_q.weight.T).view(n, 4, dh).transpose(0, 1)
    pk = (p @ mech.u_k.weight.T).view(n, 4, dh).transpose(0, 1)
    torch.testing.assert_close(pos[:, 1:, 1:], (pq @ pk.transpose(-1, -2))[:, 1:, 1:] / math.sqrt(2 * dh))
    assert model(["tupe"], causal=True).blocks[0].attn.mechanisms[0].untie_cls is False


# -- depthwise_conv and the convolutional q/k/v ----------------------------------------------

def test_depthwise_conv_window_is_centered_in_encoder_and_past_only_in_decoder():
    enc = layer_mechanism("depthwise_conv", dims(causal=False))
    dec = layer_mechanism("depthwise_conv", dims(causal=True))
    assert enc.weight.shape == (16, 17) and dec.weight.shape == (16, 9)
    n = 12
    v = torch.zeros(1, 4, n, 4, dtype=torch.float64)
    v[0, :, 6] = 1.0  # an impulse at position 6
    for mech, causal in ((enc, False), (dec, True)):
        o = mech.transform_output(torch.zeros_like(v), v, context(n, 1, causal))
        touched = (o.abs().sum((0, 1, 3)) > 0).nonzero().flatten().tolist()
        assert touched == (list(range(n)) if not causal else list(range(6, n)))


def test_cat_identity_init_and_causal_filter():
    """CAT filters start as the identity (a delta), so an untrained cat model equals `none`."""
    for causal in (False, True):
        d = dims(causal=causal)
        mech = build(["cat"], d).layers[0][0].double()
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 4, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
        out = mech.transform_qkv(q, k, v, context(9, 1, causal))
        for a, b in zip(out, (q, k, v)):
            torch.testing.assert_close(a, b)


def test_conv_qkv_replaces_half_of_the_heads():
    d = dims()
    mech = layer_mechanism("conv_qkv", d)
    assert mech.n_conv == 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 9, 16, generator=g, dtype=torch.float64)
    q, k, v = (torch.randn(1, 4, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out = mech.transform_qkv(q, k, v, context(9, 1, x=x))
    for a, b in zip(out, (q, k, v)):
        torch.testing.assert_close(a[:, :2], b[:, :2])  # linear heads untouched
        assert (a[:, 2:] - b[:, 2:]).abs().min() > 0  # convolutional heads replaced


def test_conv_qkv_heads_are_not_projected_linearly():
    """The layer skips the W_QKV rows of the heads conv_qkv supplies (own_heads): q and k come
    out with h − c linear heads, v with all h, and the skipped rows get exactly no gradient."""
    m = model([{"name": "conv_qkv", "targets": "qk"}], seed=0)
    attn = m.blocks[0].attn
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert [t.shape[1] for t in attn.linear_qkv(x)] == [2, 2, 4]
    run(m, tokens(2, 9)).pow(2).sum().backward()
    rows = attn.qkv.weight.grad.view(3, 4, 4, 16).abs().sum((-1, -2))  # [q|k|v, head]
    assert (rows[:2, 2:] == 0).all() and (rows[:2, :2] > 0).all() and (rows[2] > 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_fast_and_reference_agree_on_long_clipped_inputs(causal):
    """n beyond every window (kernel 17, t5 max distance) on the Toeplitz/relative families."""
    specs = ["composite", "key_dynamic_conv", {"name": "t5", "num_buckets": 8, "max_distance": 10},
             {"name": "diet_rel", "max_distance": 5}, "alibi"]
    ref = model(specs, causal=causal, seed=2, max_len=16)
    fast = with_path(ref, "fast")
    ids = tokens(2, 30, seed=0)
    torch.testing.assert_close(run(ref, ids), run(fast, ids), rtol=1e-10, atol=1e-10)


def test_segment_attention_reads_segment_ids():
    m = model(["segment"], seed=0)
    ids = tokens(2, 10, seed=0)
    seg = segments_for(ids)
    assert (run(m, ids, segments=seg) - run(m, ids)).abs().max() > 1e-3
