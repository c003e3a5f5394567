"""RoPE's rescalings, partial rotary and their errors: the inverse frequencies and attention factor
of each scaling equal transformers' ``ROPE_INIT_FUNCTIONS``; partial rotary equals x-transformers'
``apply_rotary_pos_emb``; the rotations join the reference, fast and causal checks of every option."""
from __future__ import annotations

import math

import pytest
import torch
from core.helpers import context, dims, model, run, spec_id, tokens, with_path
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from x_transformers.x_transformers import RotaryEmbedding, apply_rotary_pos_emb

from posattn.errors import PositionError
from posattn.mechanisms import build

HEAD = 32


def opt_id(options: dict) -> str:
    return spec_id({"name": "rope", **options})


def rope(options: dict, max_len: int = 16, head_dim: int = HEAD, causal: bool = False):
    d = dims(causal=causal, d_model=2 * head_dim, n_heads=2, max_len=max_len)
    return build([{"name": "rope", **options}], d).layers[0][0]


def hf(rope_type: str, params: dict, fraction: float = 1.0, max_len: int = 16, seq_len: int | None = None):
    """transformers' inverse frequencies and attention factor for a config with these rope parameters."""
    config = LlamaConfig(hidden_size=2 * HEAD, num_attention_heads=2, head_dim=HEAD, max_position_embeddings=max_len,
                         rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0,
                                          "partial_rotary_factor": fraction, **params})
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


def same(theta: torch.Tensor, mscale: float, want: tuple[torch.Tensor, float]) -> None:
    # posattn computes in float64 and rounds to float32 once; transformers computes in float32
    torch.testing.assert_close(theta, want[0], rtol=4e-7, atol=0)
    assert mscale == pytest.approx(want[1], rel=1e-12)


FRACTIONS = [1.0, 0.5]


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("factor", [1.0, 2.5, 8.0])
def test_linear_yarn_llama3_match_transformers(factor, fraction):
    L = 64
    common = {"factor": factor, "original_max_len": L, "fraction": fraction}
    m = rope({"scaling": "linear", **common})
    same(m.theta, m.mscale, hf("linear", {"factor": factor}, fraction))
    m = rope({"scaling": "yarn", "yarn_ramp": "dimension", **common})
    extended = int(factor * L)  # transformers' max_position_embeddings after YaRN
    same(m.theta, m.mscale, hf("yarn", {"factor": factor, "original_max_position_embeddings": L}, fraction, extended))
    m = rope({"scaling": "yarn", "yarn_ramp": "dimension", "beta_fast": 16.0, "beta_slow": 2.0,
              "attention_factor": 1.3, **common})
    same(m.theta, m.mscale, hf("yarn", {"factor": factor, "original_max_position_embeddings": L, "beta_fast": 16.0,
                                        "beta_slow": 2.0, "attention_factor": 1.3}, fraction, extended))
    for low, high in ((1.0, 4.0), (2.0, 8.0)):
        m = rope({"scaling": "llama3", "low_freq_factor": low, "high_freq_factor": high, **common})
        same(m.theta, m.mscale, hf("llama3", {"factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                                              "original_max_position_embeddings": L}, fraction))


def test_llama3_covers_all_three_bands():
    """The comparison above is not vacuous: some frequencies are kept, some divided, some smoothed."""
    m, plain = rope({"scaling": "llama3", "factor": 8.0, "original_max_len": 64}), rope({})
    ratio = plain.theta / m.theta
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1.01) & (ratio < 7.9)).any()


def test_yarn_ramps_agree_at_the_ends_and_differ_between():
    """``ratio`` (the paper's Eq. 18) and ``dimension`` (the released code) extrapolate the highest
    and interpolate the lowest frequencies alike; in the ramp they differ."""
    opts = {"scaling": "yarn", "factor": 4.0, "original_max_len": 4096}  # both ends outside the ramp
    paper, code = rope(opts), rope({**opts, "yarn_ramp": "dimension"})
    torch.testing.assert_close(paper.theta[[0, -1]], code.theta[[0, -1]])
    assert (paper.theta - code.theta).abs().max() > 1e-4
    assert paper.mscale == code.mscale == pytest.approx(0.1 * math.log(4.0) + 1)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("factor", [1.0, 2.0, 3.0])
def test_dynamic_matches_transformers_at_every_length(factor, fraction):
    L = 16
    m = rope({"scaling": "dynamic", "factor": factor, "original_max_len": L, "fraction": fraction})
    for n in (5, 16, 17, 40, 100):
        theta, mscale = m.frequencies(context(n, 1))
        same(theta, mscale, hf("dynamic", {"factor": factor}, fraction, max_len=L, seq_len=n))
    assert torch.equal(m.frequencies(context(16, 1))[0], rope({"fraction": fraction}).theta)  # plain up to L
    assert not torch.equal(m.frequencies(context(40, 1))[0], rope({"fraction": fraction}).theta)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_ntk_is_dynamic_ntk_at_the_extended_length_and_x_transformers_base_rescale(factor, fraction):
    """NTK-aware: base · s^{r/(r−2)}; transformers' dynamic with factor 1 at length s·L is the same
    base, and x-transformers' ``base_rescale_factor`` is this rescaling."""
    L = 16
    m = rope({"scaling": "ntk", "factor": factor, "original_max_len": L, "fraction": fraction})
    same(m.theta, m.mscale, hf("dynamic", {"factor": 1.0}, fraction, max_len=L, seq_len=int(factor * L)))
    xt = RotaryEmbedding(int(HEAD * fraction), base_rescale_factor=factor)
    torch.testing.assert_close(m.theta, xt.inv_freq, rtol=4e-7, atol=0)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_longrope_matches_transformers_short_and_long(factor, fraction):
    L, r = 16, int(HEAD * fraction)
    g = torch.Generator().manual_seed(0)
    short = (1 + torch.rand(r // 2, generator=g)).tolist()
    long = (1 + 8 * torch.rand(r // 2, generator=g)).tolist()
    opts = {"scaling": "longrope", "factor": factor, "original_max_len": L, "fraction": fraction,
            "short_factor": short, "long_factor": long}
    params = {"factor": factor, "original_max_position_embeddings": L, "short_factor": short, "long_factor": long}
    m = rope(opts)
    for n in (8, 16, 17, 64):
        theta, mscale = m.frequencies(context(n, 1))
        same(theta, mscale, hf("longrope", params, fraction, seq_len=n))
    theta, mscale = rope({**opts, "attention_factor": 1.7}).frequencies(context(64, 1))
    same(theta, mscale, hf("longrope", {**params, "attention_factor": 1.7}, fraction, seq_len=64))


def interleaved(x: torch.Tensor, rotated: int) -> torch.Tensor:
    """x-transformers' channel order (pairs 2m, 2m+1) for posattn's (pairs m, m + r/2)."""
    half = rotated // 2
    order = [c for m in range(half) for c in (m, m + half)] + list(range(rotated, x.shape[-1]))
    return x[..., order]


@pytest.mark.parametrize("rotated", [32, 16, 8])
def test_partial_rotary_matches_x_transformers(rotated):
    g = torch.Generator().manual_seed(1)
    n = 12
    q = torch.randn(2, 2, n, HEAD, generator=g)
    m = rope({"fraction": rotated / HEAD})
    got, _, _ = m.transform_qkv(q, q, q, context(n, 2))
    xt = RotaryEmbedding(rotated)
    freqs, scale = xt.forward_from_seq_len(n)
    want = apply_rotary_pos_emb(interleaved(q, rotated), freqs, scale)
    torch.testing.assert_close(interleaved(got, rotated), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[..., rotated:], q[..., rotated:], rtol=0, atol=0)  # passed through exactly


def test_partial_rotary_passes_the_rest_through_under_every_scaling_factor():
    """The attention factor (YaRN, LongRoPE) scales the rotated channels only, as transformers does."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 6, HEAD, generator=g)
    m = rope({"fraction": 0.25, "scaling": "yarn", "factor": 4.0})
    got, _, _ = m.transform_qkv(q, q, q, context(6, 1))
    torch.testing.assert_close(got[..., 8:], q[..., 8:], rtol=0, atol=0)
    torch.testing.assert_close(got[:, :, 0, :8], q[:, :, 0, :8] * m.mscale)  # position 0: only the factor


SPECS = [{"fraction": 0.5}, {"fraction": 0.25, "scaling": "ntk", "factor": 4.0},
         {"scaling": "llama3", "factor": 4.0, "original_max_len": 4},
         {"scaling": "yarn", "factor": 4.0, "original_max_len": 4, "yarn_ramp": "dimension"},
         {"scaling": "dynamic", "factor": 2.0, "original_max_len": 4},
         {"scaling": "longrope", "factor": 4.0, "original_max_len": 6, "short_factor": [1.0, 1.5] * 4,
          "long_factor": [2.0, 6.0] * 4}]
SIZES = {"d_model": 32, "n_heads": 2}  # head dimension 16


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("options", SPECS, ids=opt_id)
def test_fast_path_equals_reference_outputs_and_gradients(options, causal):
    m = model({"name": "rope", **options}, causal=causal, seed=3, **SIZES)
    fast = with_path(m, "fast")
    ids = tokens(2, 9, seed=1)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, -2:] = False
    outs, grads = [], []
    for net in (m, fast):
        h = run(net, ids, keep)
        outs.append(h)
        grads.append(torch.autograd.grad(h[keep].pow(2).sum(), list(net.parameters()), allow_unused=True))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-9)
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("options", SPECS, ids=opt_id)
def test_decoder_is_causal(options):
    """Changing token t changes no output before t (every option, both paths)."""
    for path in ("reference", "fast"):
        m = model({"name": "rope", **options}, causal=True, seed=4, path=path, **SIZES)
        ids = tokens(1, 10, seed=2)
        other = ids.clone()
        other[0, 6] = (other[0, 6] + 1) % 30
        a, b = run(m, ids), run(m, other)
        torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
        assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-6


def offset_dots(options: dict, shift: int) -> torch.Tensor:
    """q·k of one fixed q and k rotated at every position pair of 0…9 (+ shift)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, HEAD, generator=g, dtype=torch.float64).expand(1, 2, 10, HEAD)
    k = torch.randn(1, 2, 1, HEAD, generator=g, dtype=torch.float64).expand(1, 2, 10, HEAD)
    m = rope(options, max_len=64, causal=True).double()
    q2, k2, _ = m.transform_qkv(q, k, q, context(10, 1, positions=torch.arange(10)[None] + shift))
    return q2 @ k2.transpose(-1, -2)


@pytest.mark.parametrize("options", [{"fraction": 0.5}, {"fraction": 0.25, "scaling": "ntk", "factor": 4.0},
                                     {"scaling": "llama3", "factor": 4.0, "original_max_len": 8},
                                     {"scaling": "yarn", "factor": 4.0, "yarn_ramp": "dimension"}], ids=opt_id)
def test_scores_depend_on_the_offset_only(options):
    dots = offset_dots(options, 0)
    for off in range(-9, 10):
        diag = torch.diagonal(dots, off, -2, -1)
        torch.testing.assert_close(diag, diag[..., :1].expand_as(diag), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(offset_dots(options, 23), dots, rtol=1e-6, atol=1e-6)
    assert (dots[..., 0, 1] - dots[..., 0, 5]).abs().max() > 1e-3


def test_length_dependent_scalings_change_with_the_length_and_recompute_when_decoding():
    """dynamic and longrope read the current length: a shift past L changes the scores, and a
    decoding cache cannot keep keys rotated at a shorter length."""
    from posattn.attention.decode import mode

    opts = {"scaling": "dynamic", "factor": 2.0, "original_max_len": 12}
    assert (offset_dots(opts, 0) - offset_dots(opts, 20)).abs().max() > 1e-3
    assert mode(rope(opts)) is None and mode(rope({})) == "rows"


@pytest.mark.parametrize(("options", "message"), [
    ({"fraction": 0.0}, r"fraction must be in \(0, 1\]"),
    ({"fraction": 1.5}, r"fraction must be in \(0, 1\]"),
    ({"fraction": 0.3}, "must be a positive even number"),  # 0.3 · 32 = 9 channels
    ({"fraction": 1 / 32}, "must be a positive even number"),
    ({"scaling": "ntkk"}, "unknown scaling 'ntkk'; valid: none, linear, ntk, dynamic, yarn, llama3, longrope"),
    ({"scaling": "linear", "factor": 0.5}, "scaling factor must be >= 1, got 0.5"),
    ({"scaling": "longrope", "factor": 2.0}, "longrope needs short_factor and long_factor"),
    ({"scaling": "longrope", "short_factor": [1.0] * 16}, "long_factor is missing"),
    ({"scaling": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 16}, "short_factor must hold 16"),
    ({"scaling": "longrope", "short_factor": [1.0] * 16, "long_factor": [0.0] * 16}, "long_factor must hold 16 posit"),
    ({"scaling": "llama3", "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "0 < low_freq_factor < high_freq_f"),
    ({"scaling": "yarn", "yarn_ramp": "index"}, "yarn_ramp must be 'ratio' or 'dimension'"),
    ({"scaling": "yarn", "attention_factor": -1.0}, "attention_factor must be > 0"),
    ({"scaling": "linear", "attention_factor": 2.0}, "attention_factor applies to the yarn and longrope scalings"),
    ({"scaling": "ntk", "fraction": 1 / 16}, "ntk scaling needs more than 2 rotated channels"),
    ({"scale_base": 0.0}, "scale_base must be > 0"),
], ids=lambda v: v if isinstance(v, str) else opt_id(v))
def test_bad_options_are_refused_with_one_clear_error(options, message):
    with pytest.raises(PositionError, match=message):
        rope(options)


def test_length_scaled_offers_every_scaling_and_longrope_needs_its_factors():
    from posattn.mechanisms import REGISTRY

    cls = REGISTRY["rope"]
    assert cls.length_scalings == ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope")
    assert cls.length_scaled({"fraction": 0.5}, "llama3", 4.0, 128) == {
        "fraction": 0.5, "scaling": "llama3", "factor": 4.0, "original_max_len": 128}
    with pytest.raises(PositionError, match="longrope needs the model's rope options short_factor and long_fac"):
        cls.length_scaled({}, "longrope", 2.0, 128)
    given = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    assert cls.length_scaled(given, "longrope", 2.0, 16)["long_factor"] == [2.0] * 4
