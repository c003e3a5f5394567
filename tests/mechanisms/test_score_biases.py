"""The score-table mechanisms of issue 27 against slow references written from their papers'
formulas (KERPLE, Sandwich, dynamic position bias, ALiBi's options, the forget gate), their
parameterisation rules, and their errors. Reference = fast, causality and the registry-wide
properties are in tests/core (every registered mechanism and the option variants of
``core.helpers.VARIANTS``)."""
from __future__ import annotations

import math

import pytest
import torch
from core.helpers import context, dims, layer_mechanism, model, run, tokens

from posattn.attention.decode import KVCache, blockers
from posattn.attention.terms import LowRank, Toeplitz, TwoSided
from posattn.errors import PositionError
from posattn.mechanisms import build
from posattn.mechanisms.alibi import alibi_slopes

N = 9


def bias_of(spec, causal=False, n=N, seed=0, x=None, **kw):
    """The mechanism's score term as a dense [b|1, h, n, n] tensor (and the mechanism)."""
    d = dims(causal=causal, **kw)
    mech = layer_mechanism(spec, d, seed)
    q = torch.zeros(2, d.n_heads, n, d.head_dim, dtype=torch.float64)
    (term,) = mech.score_terms(q, q, context(n, 2, causal, x=x))
    return term.dense(n), mech


def offset_grid(n):
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    return i, j


# -- KERPLE ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["log", "power"])
def test_kerple_is_the_papers_kernel(kernel):
    mech = layer_mechanism({"name": "kerple", "kernel": kernel}, dims())
    with torch.no_grad():  # parameters inside their ranges, including the largest power
        mech.r1.copy_(torch.tensor([0.3, 1.0, 2.5, 0.05]))
        mech.r2.copy_(torch.tensor([0.2, 0.9, 1.7, 2.0]))
    q = torch.zeros(1, 4, N, 4, dtype=torch.float64)
    bias = mech.score_terms(q, q, context(N, 1))[0].dense(N).detach()
    for h in range(4):
        r1, r2 = float(mech.r1[h].detach()), float(mech.r2[h].detach())
        for i in range(N):
            for j in range(N):
                want = -r1 * math.log(1 + r2 * abs(i - j)) if kernel == "log" else -r1 * abs(i - j) ** r2
                assert abs(float(bias[0, h, i, j]) - want) < 1e-12


def test_kerple_keeps_its_parameters_in_range_by_clamping():
    """Below 1e-2 a parameter acts as 1e-2 (the authors' clamp); the power's r₂ acts as at most 2."""
    d = dims()
    mech = layer_mechanism({"name": "kerple", "kernel": "power"}, d)
    with torch.no_grad():
        mech.r1.copy_(torch.tensor([-1.0, 0.5, 0.5, 0.5]))
        mech.r2.copy_(torch.tensor([1.0, -3.0, 5.0, 1.5]))
    r1, r2 = mech.parameters_in_range()
    torch.testing.assert_close(r1, torch.tensor([1e-2, 0.5, 0.5, 0.5], dtype=torch.float64))
    torch.testing.assert_close(r2, torch.tensor([1.0, 1e-2, 2.0, 1.5], dtype=torch.float64))
    table = mech.table(5)
    (table * torch.arange(4.0, dtype=torch.float64)[:, None]).sum().backward()
    assert mech.r1.grad[0] == 0 and mech.r2.grad[1] == 0 and mech.r2.grad[2] == 0  # held at the bound
    assert mech.r1.grad[1:].abs().min() > 0 and mech.r2.grad[3] != 0
    assert torch.isfinite(mech.r2.grad).all()  # no 0·log 0 at distance 0


def test_kerple_log_is_the_default_and_decays_with_distance():
    bias, mech = bias_of("kerple")
    assert mech.kernel == "log"
    row = bias[0, :, N - 1, :]  # the last query: distances N−1 … 0
    assert (row[:, 1:] >= row[:, :-1]).all() and (row[:, -1] == 0).all()


# -- Sandwich ----------------------------------------------------------------------------------

def sinusoid(pos, d):
    """Vaswani et al. §3.5: PE[p, 2k] = sin(p·10000^{−2k/d}), PE[p, 2k+1] = cos(p·10000^{−2k/d})."""
    return [math.sin(pos / 10000 ** (2 * (c // 2) / d)) if c % 2 == 0 else math.cos(pos / 10000 ** (2 * (c // 2) / d))
            for c in range(d)]


@pytest.mark.parametrize("dim", [2, 8, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_sandwich_is_the_inner_product_of_sinusoids_scaled_per_head(dim, causal):
    H = 4
    bias, _ = bias_of({"name": "sandwich", "dim": dim}, causal=causal, n=N)
    for h in range(H):
        for i in range(N):
            for j in range(N):
                dot = sum(a * b for a, b in zip(sinusoid(i, dim), sinusoid(j, dim)))
                want = (dot - dim / 2) / (8 * (h + 1) / H)
                assert abs(float(bias[0, h, i, j]) - want) < 1e-9
    assert (bias <= 1e-12).all() and (torch.diagonal(bias, dim1=-2, dim2=-1).abs() < 1e-12).all()


def test_sandwich_has_no_parameters_and_is_shared_by_layers_via_the_context():
    d = dims(n_layers=2)
    layers = build(["sandwich"], d).layers
    assert not list(layers[0][0].parameters())
    ctx = context(N)
    q = torch.zeros(1, 4, N, 4)
    a, b = layers[0][0].score_terms(q, q, ctx)[0], layers[1][0].score_terms(q, q, ctx)[0]
    assert a.table.data_ptr() == b.table.data_ptr()  # computed once per forward pass


# -- dynamic position bias ---------------------------------------------------------------------

@pytest.mark.parametrize("log_distance", [False, True])
def test_dynamic_pos_bias_is_an_mlp_of_the_signed_distance(log_distance):
    bias, mech = bias_of({"name": "dynamic_pos_bias", "log_distance": log_distance, "hidden": 5, "depth": 2})
    lin = [m for m in mech.mlp if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in lin] == [(5, 1), (5, 5), (4, 5)]
    for i in range(N):
        for j in range(N):
            delta = torch.tensor([float(i - j)], dtype=torch.float64)
            if log_distance:
                delta = torch.sign(delta) * torch.log(delta.abs() + 1)
            v = torch.nn.functional.silu(lin[0](delta))
            v = torch.nn.functional.silu(lin[1](v))
            torch.testing.assert_close(bias[0, :, i, j], lin[2](v), rtol=0, atol=1e-12)
    assert (bias[0, :, 1, 0] - bias[0, :, 0, 1]).abs().max() > 1e-6  # i − j is signed


def test_dynamic_pos_bias_defaults_and_sharing():
    d = dims(n_layers=3)
    layers = build(["dynamic_pos_bias"], d).layers
    assert all(layer[0] is layers[0][0] for layer in layers)  # one MLP for every layer
    assert layers[0][0].mlp[0].out_features == d.d_model // 4
    layers = build([{"name": "dynamic_pos_bias", "share_layers": False}], d).layers
    assert len({id(layer[0]) for layer in layers}) == 3


def test_dynamic_pos_bias_starts_at_zero_and_still_trains():
    mech = layer_mechanism("dynamic_pos_bias", dims())
    assert mech.start_at_zero()
    table = mech.table(N)
    assert (table == 0).all()
    (table * torch.randn(table.shape, dtype=torch.float64)).sum().backward()
    assert mech.mlp[-1].weight.grad.abs().max() > 0


# -- ALiBi options -----------------------------------------------------------------------------

def alibi_bias(past, future, n=N):
    """−m·(i − j) below the diagonal, −m'·(j − i) above, per head ([H] slopes)."""
    i, j = offset_grid(n)
    r = (j - i).double()
    return torch.where(r <= 0, past[:, None, None] * r, -future[:, None, None] * r)


def test_alibi_on_a_subset_of_heads():
    bias, mech = bias_of({"name": "alibi", "heads": 3}, n_heads=4)
    want = torch.cat([alibi_slopes(3).double(), torch.zeros(1, dtype=torch.float64)])
    torch.testing.assert_close(mech.slopes, want)
    torch.testing.assert_close(bias[0], alibi_bias(want, want))
    assert (bias[0, 3] == 0).all() and (bias[0, :3].abs().sum((-1, -2)) > 0).all()


def test_alibi_learned_slopes_start_geometric():
    fresh = build([{"name": "alibi", "learned": True}], dims()).layers[0][0]
    assert [n for n, _ in fresh.named_parameters()] == ["log_slopes"]
    torch.testing.assert_close(fresh.slopes, alibi_slopes(4))
    bias, mech = bias_of({"name": "alibi", "learned": True}, seed=2)
    torch.testing.assert_close(bias[0], alibi_bias(mech.slopes, mech.slopes).detach())


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("spec,causal", [
    ({"name": "alibi", "learned": True}, False), ({"name": "alibi", "learned": True, "heads": 2}, True),
    ({"name": "alibi", "learned": True, "bidirectional": "asymmetric"}, False),
])
def test_alibi_learned_slopes_receive_gradients(spec, causal, path):
    m = model([spec], causal=causal, seed=0, path=path, dtype=torch.float32)
    run(m, tokens(2, N)).pow(2).sum().backward()
    mech = m.blocks[0].attn.mechanisms[0]
    k = spec.get("heads", 4)
    for name, p in mech.named_parameters():
        assert p.shape == (k,) and p.grad is not None and p.grad.abs().min() > 0, name


def test_alibi_asymmetric_has_its_own_future_slopes():
    bias, mech = bias_of({"name": "alibi", "learned": True, "bidirectional": "asymmetric"}, seed=1)
    past, future = mech.slopes.detach(), mech.future_slopes().detach()
    assert (past - future).abs().max() > 1e-3  # randomised apart
    torch.testing.assert_close(bias[0].detach(), alibi_bias(past, future))
    assert (bias[0] - bias[0].transpose(-1, -2)).abs().max() > 1e-3  # not symmetric


def test_alibi_learned_slopes_stay_positive():
    mech = build([{"name": "alibi", "learned": True}], dims()).layers[0][0]
    with torch.no_grad():
        mech.log_slopes.fill_(-50.0)
    assert (mech.slopes > 0).all()


def test_alibi_causal_form_in_a_decoder_with_head_subset_and_learned_slopes():
    """The rank-1 decoder form gives the Toeplitz penalty's softmax for every option."""
    for spec in ({"name": "alibi", "heads": 2}, {"name": "alibi", "heads": 3, "learned": True}):
        m = model([spec], causal=True, seed=4)
        ids = tokens(2, 11, seed=1)
        ref = run(m, ids)
        for block in m.blocks:
            block.attn.path = "fast"
        torch.testing.assert_close(run(m, ids), ref, rtol=1e-10, atol=1e-10)


# -- the forget gate ---------------------------------------------------------------------------

def test_forgetting_decoder_term_is_the_sum_of_log_gates_between_key_and_query():
    d = dims(causal=True)
    mech = layer_mechanism({"name": "forgetting", "bias_init": 0.0}, d, seed=1)
    x = torch.randn(2, N, d.d_model, dtype=torch.float64)
    q = torch.zeros(2, 4, N, 4, dtype=torch.float64)
    (term,) = mech.score_terms(q, q, context(N, 2, True, x=x))
    assert isinstance(term, LowRank) and term.u.shape[-1] == 2  # folded into q/k
    dense = term.dense(N).detach()
    gates = torch.sigmoid(x @ mech.gates.weight.T + mech.gates.bias).detach()  # [b, n, h]
    for b in range(2):
        for h in range(4):
            for i in range(N):
                for j in range(i + 1):
                    want = sum(math.log(float(gates[b, t, h])) for t in range(j + 1, i + 1))
                    assert abs(float(dense[b, h, i, j]) - want) < 1e-10
    assert (dense[..., 1:, 0] < 0).all()  # a decay: log σ < 0


def test_forgetting_encoder_decays_towards_the_future_with_its_own_gates():
    d = dims()
    mech = layer_mechanism("forgetting", d, seed=2)
    assert mech.gates.out_features == 2 * d.n_heads
    x = torch.randn(1, N, d.d_model, dtype=torch.float64)
    q = torch.zeros(1, 4, N, 4, dtype=torch.float64)
    (term,) = mech.score_terms(q, q, context(N, 1, False, x=x))
    assert isinstance(term, TwoSided)
    bias = term.dense(N)
    log_f = torch.nn.functional.logsigmoid(x @ mech.gates.weight.T + mech.gates.bias)[0].detach()  # [n, 2h]
    for h in range(4):
        for i in range(N):
            for j in range(N):
                lo, hi, g = (j + 1, i, h) if j <= i else (i + 1, j, h + 4)
                want = sum(float(log_f[t, g]) for t in range(lo, hi + 1))
                assert abs(float(bias[0, h, i, j].detach()) - want) < 1e-10


def test_two_sided_term_and_its_gradient_equal_the_two_triangles() -> None:
    """TwoSided's dense form (one select, a backward of row and column sums) and its row blocks
    against autograd through the two triangles written out, in float64, with broadcast inputs."""
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(2, 3, N, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    x, y = (torch.randn(1, 3, N, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight = torch.randn(2, 3, N, N, generator=g, dtype=torch.float64)
    term = TwoSided(a, x, b, y)
    got = term.dense(N)
    lower = torch.ones(N, N, dtype=torch.bool).tril()
    want = (a[..., :, None] + x[..., None, :]) * lower + (b[..., :, None] + y[..., None, :]) * ~lower
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grads = torch.autograd.grad((got * weight).sum(), (a, x, b, y))
    wants = torch.autograd.grad((want * weight).sum(), (a, x, b, y))
    for got_g, want_g in zip(grads, wants):
        torch.testing.assert_close(got_g, want_g, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *v: TwoSided(*v).dense(N), (a, x, b, y))
    rows = torch.tensor([[5, 0, N - 1], [2, 2, 7]])
    torch.testing.assert_close(term.rows(rows, N), torch.stack([want[i, :, rows[i]] for i in range(2)]))


def test_forgetting_reads_the_input_so_cached_decoding_recomputes():
    from posattn import Decoder, ModelConfig

    m = Decoder(ModelConfig(vocab_size=30, d_model=16, n_heads=2, n_layers=1, max_len=16, mechanisms=["forgetting"]))
    assert blockers(m.mechanisms()) == ["forgetting"]
    with pytest.raises(PositionError, match="forgetting.*cannot decode incrementally"):
        m.decode(torch.zeros(1, 4, dtype=torch.long), KVCache())


def test_forgetting_has_no_position_structure_but_others_do():
    d = dims()
    assert layer_mechanism("forgetting", d).position_structures(N, context(N)) == []
    for name in ("kerple", "sandwich", "dynamic_pos_bias"):
        (s,) = layer_mechanism(name, d).position_structures(N, context(N))
        assert s.kind == "offsets" and s.data.shape == (4, 2 * N - 1)


def test_table_mechanisms_declare_toeplitz_terms():
    for spec in ("kerple", "sandwich", "dynamic_pos_bias", {"name": "alibi", "learned": True}):
        mech = layer_mechanism(spec, dims())
        q = torch.zeros(1, 4, N, 4, dtype=torch.float64)
        (term,) = mech.score_terms(q, q, context(N, 1))
        assert isinstance(term, Toeplitz) and term.table.shape == (4, 2 * N - 1)


def test_positional_parameter_counts():
    from posattn.mechanisms import Dims, properties

    d, H, L = 32, 4, 3
    for causal in (False, True):
        dm = Dims(d, H, L, 64, 3, causal)
        count = {name: properties(name, dm)["positional_params"]
                 for name in ("kerple", "sandwich", "dynamic_pos_bias", "forgetting")}
        w = d // 4
        assert count["kerple"] == 2 * H * L  # r₁, r₂ per head and layer
        assert count["sandwich"] == 0
        assert count["dynamic_pos_bias"] == (w + w) + (w * w + w) + (w * H + H)  # one MLP, shared
        assert count["forgetting"] == (d + 1) * H * (1 if causal else 2) * L  # gates per layer
    dm = Dims(d, H, L, 64, 3, False)
    assert properties({"name": "alibi", "learned": True, "heads": 3}, dm)["positional_params"] == 3 * L
    assert properties({"name": "alibi", "learned": True, "bidirectional": "asymmetric"}, dm)[
        "positional_params"] == 2 * H * L


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("spec", ["kerple", "sandwich", "dynamic_pos_bias", "forgetting",
                                  {"name": "alibi", "learned": True, "heads": 3}])
def test_fused_kernels_take_the_new_terms(spec, causal):
    """float32 through the fused C++ kernels (learned tables, the forget gate's rank-2 term):
    outputs and parameter gradients equal the reference path's."""
    from posattn.attention import native
    from posattn.attention.fast import Policy, using

    if native.kernels() is None:
        pytest.skip("the fused kernels did not build here")
    ids = tokens(2, 40, seed=1)
    keep = torch.ones(2, 40, dtype=torch.bool)
    keep[1, :6] = False
    results = []
    for path in ("reference", "fast"):
        m = model([spec], causal=causal, seed=3, path=path, dtype=torch.float32, max_len=64)
        with using(Policy(force="fused")):
            h = run(m, ids, keep)
        loss = (h * keep[..., None]).pow(2).sum()
        results.append((h, torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)))
    (h_ref, g_ref), (h_fast, g_fast) = results
    torch.testing.assert_close(h_fast[keep], h_ref[keep], rtol=2e-5, atol=2e-5)
    for a, b in zip(g_fast, g_ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# -- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,causal,match", [
    ({"name": "alibi", "heads": 5}, False, r"^alibi: heads must be an integer in 1 … 4 .*got 5"),
    ({"name": "alibi", "heads": 0}, False, r"^alibi: heads must be an integer in 1 … 4"),
    ({"name": "alibi", "bidirectional": "left"}, False, r"^alibi: unknown bidirectional form 'left'"),
    ({"name": "alibi", "bidirectional": "asymmetric", "learned": True}, True,
     r"^alibi: bidirectional='asymmetric' .* causal decoder"),
    ({"name": "alibi", "bidirectional": "asymmetric"}, False, r"^alibi: bidirectional='asymmetric' needs learned=True"),
    ({"name": "kerple", "kernel": "gauss"}, False, r"^kerple: unknown kernel 'gauss'; valid: log, power"),
    ({"name": "sandwich", "dim": 7}, False, r"^sandwich: dim \(d'\) must be an even integer >= 2, got 7"),
    ({"name": "sandwich", "dim": 0}, True, r"^sandwich: dim"),
    ({"name": "dynamic_pos_bias", "depth": 0}, False, r"^dynamic_pos_bias: depth must be an integer >= 1"),
    ({"name": "dynamic_pos_bias", "hidden": 0}, False, r"^dynamic_pos_bias: hidden must be a positive integer"),
    ({"name": "forgetting", "gate": 1}, False, r"^forgetting: unknown option\(s\) gate"),
])
def test_bad_options_are_refused_by_name(spec, causal, match):
    with pytest.raises(PositionError, match=match):
        build([spec], dims(causal=causal))
