"""Every property `posattn mechanisms` reports is backed by behaviour: inductive, translation
invariant, acts_on and positional_params, for every registered mechanism."""
from __future__ import annotations

import pytest
import torch

from posattn.attention import reference
from posattn.errors import PositionError
from posattn.mechanisms import Dims, properties
from posattn.mechanisms.base import Softmax

from .helpers import NAMES, context, dims, layer_mechanism, model, run, skip_encoder_only, spec_id, tokens

MAX_LEN = 12


def props(name, causal=False, **kw):
    d = Dims(kw.get("d_model", 16), kw.get("n_heads", 4), kw.get("n_layers", 2), kw.get("max_len", MAX_LEN),
             3, causal)
    return properties(name, d)


# -- inductive -------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("name", NAMES)
def test_inductive_claim(name, causal):
    skip_encoder_only(name, causal)
    m = model([name], causal=causal, seed=1, max_len=MAX_LEN)
    long = tokens(2, MAX_LEN + 6, seed=2)
    for path in ("reference", "fast"):
        for mod in m.modules():
            if hasattr(mod, "path"):
                mod.path = path
        if props(name, causal)["inductive"]:
            h = run(m, long)
            assert torch.isfinite(h).all()
            if causal:  # the prefix computed at length > max_len equals the short run
                short = run(m, long[:, :8])
                torch.testing.assert_close(h[:, :8], short, rtol=1e-10, atol=1e-10)
        else:
            with pytest.raises(PositionError, match=rf"^{name}: .*{MAX_LEN + 6}.*{MAX_LEN}"):
                run(m, long)
            run(m, long[:, :MAX_LEN])  # its own length is fine


# -- translation invariance ------------------------------------------------------------------

def shifted_outputs(name, causal, path):
    """(unshifted, left-padded, position-offset) hidden states of the same real tokens."""
    m = model([name], causal=causal, seed=4, path=path, max_len=24)
    n, pad, off = 9, 5, 7
    ids = tokens(2, n, seed=3)
    seg = torch.tensor([[0] * 4 + [1] * 5, [0] * 2 + [1] * 5 + [2] * 2])
    base = run(m, ids, None, None if causal else seg)
    # left padding: the real tokens move to positions pad … pad + n − 1, padding masked out
    ids_p = torch.cat([tokens(2, pad, seed=9), ids], 1)
    seg_p = torch.cat([torch.zeros(2, pad, dtype=torch.long), seg], 1)
    keep = torch.ones(2, pad + n, dtype=torch.bool)
    keep[:, :pad] = False
    padded = run(m, ids_p, keep, None if causal else seg_p)[:, pad:]
    # explicit position ids offset by `off`
    positions = torch.arange(off, off + n).expand(2, n)
    offset = run(m, ids, None, None if causal else seg, positions)
    return base, padded, offset


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("name", NAMES)
def test_translation_invariance_claim(name, causal, path):
    skip_encoder_only(name, causal)
    base, padded, offset = shifted_outputs(name, causal, path)
    if props(name, causal)["translation_invariant"]:
        torch.testing.assert_close(padded, base, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(offset, base, rtol=1e-10, atol=1e-10)
    else:
        assert (padded - base).abs().max() > 1e-4, (
            f"{name} claims not translation invariant, but a shift changes nothing")
        assert (offset - base).abs().max() > 1e-4, f"{name} ignores the position ids"


# -- acts_on ---------------------------------------------------------------------------------

def changed(a, b):
    return bool((a - b).abs().max() > 1e-8)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("spec", NAMES + [{"name": "segment", "mode": "input"},
                                          {"name": "cat", "targets": "kv"},
                                          {"name": "conv_qkv", "targets": "v"},
                                          {"name": "cat", "targets": "v", "qk_norm": True}],
                         ids=spec_id)
def test_acts_on_claim(spec, causal):
    """The places a mechanism changes are exactly the places `acts_on` names."""
    name = spec if isinstance(spec, str) else spec["name"]
    skip_encoder_only(spec, causal)
    d = dims(causal=causal, n_layers=2)
    claimed = set(properties(spec, Dims(16, 4, 2, 24, 3, causal))["acts_on"])
    mech = layer_mechanism(spec, d, seed=3)
    b, n = 2, 10
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, n, 16, generator=g, dtype=torch.float64)
    q, k, v, o = (torch.randn(b, 4, n, 4, generator=g, dtype=torch.float64) for _ in range(4))
    seg = torch.tensor([[0] * 5 + [1] * 5, [1] * 4 + [2] * 6])
    ctx = context(n, b, causal, segments=seg, x=x)
    mech.check(ctx)
    acted = set()
    if changed(mech.embed(x, ctx), x):
        acted.add("input")
    q2, k2, v2 = mech.transform_qkv(q, k, v, ctx)
    acted |= {t for t, a, a2 in (("q", q, q2), ("k", k, k2), ("v", v, v2)) if changed(a, a2)}
    if mech.score_terms(q, k, ctx):
        acted.add("score")
    if changed(mech.transform_output(o, v, ctx), o):
        acted.add("output")
    if mech.mixes:  # a mixer's output differs from softmax attention on the same q, k, v
        softmax = Softmax("reference", reference.attend, None, causal)
        if changed(mech.mix(q, k, v, [], ctx, softmax), softmax(q, k, v)):
            acted.add("mixer")
    assert acted == claimed, f"{name}: acts on {sorted(acted)}, claims {sorted(claimed)}"
    assert claimed <= {"input", "q", "k", "v", "score", "output", "mixer"}
    if name != "none":
        assert acted


# -- positional parameter counts -------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("name", NAMES)
def test_positional_params_are_the_parameters_the_mechanism_adds(name, causal):
    """positional_params = (parameters of a model with the mechanism) − (the same model with none)."""
    def count(m):
        return sum(p.numel() for p in m.parameters())

    skip_encoder_only(name, causal)
    for layers in (1, 3):
        with_mech = model([name], causal=causal, n_layers=layers, max_len=MAX_LEN)
        without = model(["none"], causal=causal, n_layers=layers, max_len=MAX_LEN)
        p = props(name, causal, n_layers=layers)["positional_params"]
        assert p == count(with_mech) - count(without)


def test_positional_params_formulas():
    d, H, n, L = 32, 4, 64, 3
    kw = dict(d_model=d, n_heads=H, max_len=n, n_layers=L)
    assert props("absolute", **kw)["positional_params"] == n * d
    assert props("none", **kw)["positional_params"] == 0
    assert props("sinusoidal", **kw)["positional_params"] == 0
    assert props("rope", **kw)["positional_params"] == 0
    assert props("alibi", **kw)["positional_params"] == 0
    assert props("tisa", **kw)["positional_params"] == 3 * 5 * H * L  # TISA: 3·S·H·L
    assert props({"name": "tisa", "n_kernels": 2}, **kw)["positional_params"] == 3 * 2 * H * L
    assert props("t5", **kw)["positional_params"] == 32 * H  # shared across layers
    assert props({"name": "t5", "share_layers": False}, **kw)["positional_params"] == 32 * H * L
    assert props("fixed_conv", **kw)["positional_params"] == H * 17 * L  # H·(2k+1) per layer
    assert props({"name": "fixed_conv", "kernel_size": 5}, **kw)["positional_params"] == H * 5 * L
    assert props("dynamic_conv", **kw)["positional_params"] == 17 * (d // H) * L  # W_C shared by heads
    assert props("composite", **kw)["positional_params"] == (H * 17 + 17 * (d // H)) * L
    assert props("diet_rel", **kw)["positional_params"] == H * (2 * n - 1) * L
    assert props("diet_abs", **kw)["positional_params"] == 2 * H * n * (d // H) * L
    assert props({"name": "diet_abs", "sharing": "layer"}, **kw)["positional_params"] == 2 * H * n * (d // H)
    assert props({"name": "diet_abs", "sharing": "head", "rank": 3}, **kw)["positional_params"] == 2 * n * 3 * L
    assert props("segment", **kw)["positional_params"] == H * 3 * 3 * L
    # TUPE: n·d shared positions + per layer U_Q, U_K (2d²) + the two untying scalars per head
    assert props("tupe", **kw)["positional_params"] == n * d + L * (2 * d * d + 2 * H)
    assert props("cat", **kw)["positional_params"] == 3 * 3 * d * L  # three per-channel filters of 3 taps
    assert props({"name": "cat", "depthwise": False}, **kw)["positional_params"] == 3 * 3 * L  # shared
    # mixers: what each adds beside the layer's q/k/v/out projections
    assert props("lincat", **kw)["positional_params"] == 3 * 3 * d * L  # CAT's filters only
    assert props("landmark_cat", **kw)["positional_params"] == 3 * 3 * d * L  # hard: fixed block mean
    assert props({"name": "landmark_cat", "selection": "soft", "block_size": 8}, **kw)["positional_params"] \
        == (3 * 3 * d + 8) * L  # soft: a learned length-B landmark filter
    assert props("linformer", **kw)["positional_params"] == 2 * H * 32 * n * L  # E, F per head, k = 32
    assert props({"name": "linformer", "sharing": "kv", "k": 8}, **kw)["positional_params"] == 8 * n * L
    assert props({"name": "linformer", "sharing": "layer", "k": 8}, **kw)["positional_params"] == 8 * n
    assert props("diet_abs_lin", **kw)["positional_params"] == (2 * H * 32 * n + H * (n + 32) * (d // H)) * L
    heads, K = H // 2, 9  # ConvBERT: depthwise d·K, pointwise d·d/2 + d/2, span kernel (d/2 + 1)·heads·K
    assert props("convbert", **kw)["positional_params"] == (d * K + (d + 1) * d // 2 + (d // 2 + 1) * heads * K) * L


def test_properties_report_paper_and_defaults():
    for name in NAMES:
        p = props(name)
        assert p["name"] == name and p["paper"] and isinstance(p["acts_on"], list)
        assert isinstance(p["inductive"], bool) and isinstance(p["translation_invariant"], bool)
