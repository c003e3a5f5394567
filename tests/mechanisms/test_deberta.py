"""DeBERTa's disentangled attention (He et al. 2021, Eq 2-4): equal to transformers' DebertaV2
self-attention with copied weights (clipped distances and DeBERTa-v2's log buckets, each term
alone), the scores against a slow reference written from the equations, the buckets against
transformers' function, every fast path equal to the reference path in outputs and gradients,
causality, the neutral start and clear errors."""
from __future__ import annotations

import math

import pytest
import torch
from core.helpers import model

from posattn.attention import fast
from posattn.attention.layer import Attention
from posattn.errors import PositionError
from posattn.mechanisms import Dims, build, properties
from posattn.mechanisms.base import Context
from posattn.mechanisms.deberta import TERMS, log_bucket

from .paths import assert_causal_and_decodes_as_recompute, assert_fast_equals_reference

H, DH = 2, 16
D = H * DH


def dims(causal: bool = False) -> Dims:
    return Dims(d_model=D, n_heads=H, n_layers=1, max_len=64, n_segments=1, causal=causal)


def layer(causal: bool = False, seed: int = 0, **options) -> Attention:
    d = dims(causal)
    torch.manual_seed(seed)
    attn = Attention(d, build([{"name": "deberta", **options}], d).layers[0], "reference").double()
    with torch.no_grad():
        attn.mechanisms[0].relative.weight.normal_()
    return attn.eval()


def ctx(n: int, b: int = 2, causal: bool = False, keep=None, start: int = 0) -> Context:
    pos = torch.arange(start, start + n).expand(b, n)
    return Context(positions=pos, segments=torch.zeros_like(pos), keep=keep, causal=causal)


# -- equal to transformers' DebertaV2 ---------------------------------------------------------

def transformers_attention(k: int, buckets: int, kinds: tuple[str, ...]):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

    cfg = transformers.DebertaV2Config(hidden_size=D, num_attention_heads=H, relative_attention=True,
                                       pos_att_type=list(kinds), max_relative_positions=k, position_buckets=buckets,
                                       share_att_key=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                       max_position_embeddings=64)
    torch.manual_seed(0)
    return DisentangledSelfAttention(cfg).double().eval()


def copied(theirs, k: int, buckets: int, kinds: tuple[str, ...]) -> Attention:
    """posattn's layer with transformers' weights: W_QKV from query/key/value_proj, the position
    projections, and an identity output projection (transformers' module returns the heads merged)."""
    ours = layer(max_relative_positions=k, position_buckets=buckets, pos_att_type=list(kinds))
    mech = ours.mechanisms[0]
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat([theirs.query_proj.weight, theirs.key_proj.weight, theirs.value_proj.weight]))
        ours.qkv.bias.copy_(torch.cat([theirs.query_proj.bias, theirs.key_proj.bias, theirs.value_proj.bias]))
        ours.out.weight.copy_(torch.eye(D))
        ours.out.bias.zero_()
        for mine, name in ((mech.pos_key, "pos_key_proj"), (mech.pos_query, "pos_query_proj")):
            if mine is not None:
                mine.weight.copy_(getattr(theirs, name).weight)
                mine.bias.copy_(getattr(theirs, name).bias)
    return ours


@pytest.mark.parametrize(("k", "buckets", "n"), [(4, 0, 13), (40, 0, 13), (24, 8, 40)],
                         ids=["clipped", "unclipped", "log-buckets"])
@pytest.mark.parametrize("kinds", [("c2p", "p2c"), ("c2p",), ("p2c",)], ids=["both", "c2p", "p2c"])
def test_equal_to_transformers_debertav2_attention_with_copied_weights(k, buckets, n, kinds):
    """transformers' DisentangledSelfAttention (random init, no download) and posattn's layer
    with its weights give the same attention output, on both paths, with key padding; transformers
    takes the relative embeddings P as an argument, posattn holds them (copied in)."""
    theirs = transformers_attention(k, buckets, kinds)
    ours = copied(theirs, k, buckets, kinds)
    P = ours.mechanisms[0].relative.weight.detach()
    assert P.shape == (2 * (buckets or k), D)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, n, D, generator=g, dtype=torch.float64)
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[1, -3:] = False
    want = theirs(x, keep[:, None, None, :], rel_embeddings=P)[0]
    plain = Attention(dims(), [], "reference").double()
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("mechanisms.")})
    assert (plain(x, ctx(n, keep=keep)) - want)[keep].abs().max() > 1e-2  # the position terms matter
    for path in ("reference", "fast"):
        ours.path = path
        got = ours(x, ctx(n, keep=keep))
        # transformers takes √(3 d_h) in float32: agreement to 1e-7, not to float64's last digit
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-6, atol=1e-7)


def test_the_layer_norm_of_p_is_debertav2s():
    """``layer_norm``: P goes through the LayerNorm that transformers' DebertaV2Encoder applies
    (``get_rel_embedding`` with norm_rel_ebd="layer_norm") before the attention reads it."""
    from transformers import DebertaV2Config
    from transformers.models.deberta_v2.modeling_deberta_v2 import DebertaV2Encoder

    theirs = transformers_attention(24, 8, TERMS)
    ours = copied(theirs, 24, 8, TERMS)
    normed = layer(max_relative_positions=24, position_buckets=8, layer_norm=True)
    normed.load_state_dict(ours.state_dict(), strict=False)
    cfg = DebertaV2Config(hidden_size=D, num_attention_heads=H, num_hidden_layers=1, intermediate_size=8,
                          relative_attention=True, position_buckets=8, max_relative_positions=24,
                          norm_rel_ebd="layer_norm")
    encoder = DebertaV2Encoder(cfg).double()
    mech = normed.mechanisms[0]
    with torch.no_grad():
        encoder.rel_embeddings.weight.copy_(mech.relative.weight)
        encoder.LayerNorm.weight.normal_()
        encoder.LayerNorm.bias.normal_()
        mech.norm.weight.copy_(encoder.LayerNorm.weight)
        mech.norm.bias.copy_(encoder.LayerNorm.bias)
    x = torch.randn(2, 30, D, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    want = theirs(x, torch.ones(2, 1, 1, 30, dtype=torch.bool), rel_embeddings=encoder.get_rel_embedding())[0]
    for path in ("reference", "fast"):
        normed.path = path
        torch.testing.assert_close(normed(x, ctx(30)), want, rtol=1e-6, atol=1e-7)


def test_log_buckets_are_transformers_buckets():
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    d = torch.arange(-3000, 3001)
    for buckets, m in ((256, 512), (8, 24), (16, 100), (4, 9)):
        assert torch.equal(log_bucket(d, buckets, m), make_log_bucket_position(d, buckets, m).long()), (buckets, m)


@pytest.mark.parametrize(("options", "window"), [({"max_relative_positions": 5}, 5),
                                                 ({"max_relative_positions": 24, "position_buckets": 8}, None)])
def test_the_window_is_where_the_index_stops_changing(options, window):
    mech = layer(**options).mechanisms[0]
    w = mech.window
    assert window is None or w == window
    far = torch.arange(w, w + 500)
    assert (mech.index(far) == mech.index(far[:1])).all() and (mech.index(-far) == mech.index(-far[:1])).all()
    assert mech.index(torch.tensor([w - 1])) != mech.index(torch.tensor([w])) or \
        mech.index(torch.tensor([1 - w])) != mech.index(torch.tensor([-w]))  # w is the least such distance


# -- the equations, entry by entry ------------------------------------------------------------

def slow_index(distance: int, span: int, buckets: int, max_position: int) -> int:
    """δ(i, j) = clamp(i − j + k, 0, 2k − 1) (Eq 3); with buckets, of DeBERTa-v2's bucket(i − j)."""
    if buckets:
        mid = buckets // 2
        if abs(distance) > mid:
            far = math.ceil(math.log(abs(distance) / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
            distance = int(math.copysign(far, distance))
    return max(0, min(2 * span - 1, distance + span))


@pytest.mark.parametrize("options", [{"max_relative_positions": 3},
                                     {"max_relative_positions": 9, "position_buckets": 4},
                                     {"max_relative_positions": 3, "pos_att_type": ["p2c"]}], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_scores_are_the_papers_disentangled_terms(options, causal):
    """s_ij = (q_i·k_j + q_i·K^r[δ(i,j)] + k_j·Q^r[δ(i,j)])/√((1 + terms) d_h), K^r = P W_{k,r} + b,
    Q^r = P W_{q,r} + b, loops over heads, queries and keys."""
    attn = layer(causal, **options)
    mech = attn.mechanisms[0]
    n, b = 11, 2
    x = torch.randn(b, n, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = attn.scores(x, ctx(n, causal=causal)).detach()
    proj = x @ attn.qkv.weight.T + attn.qkv.bias
    q, k = proj[..., :D].view(b, n, H, DH), proj[..., D:2 * D].view(b, n, H, DH)
    kinds = options.get("pos_att_type", ["c2p", "p2c"])
    scale = math.sqrt((1 + len(kinds)) * DH)
    P = mech.relative.weight
    want = torch.zeros(b, H, n, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(H):
            for i in range(n):
                for j in range(n):
                    p = P[slow_index(i - j, mech.span, mech.buckets, mech.max_relative)]
                    s = q[bi, i, h] @ k[bi, j, h]
                    if "c2p" in kinds:
                        s = s + q[bi, i, h] @ (mech.pos_key.weight @ p + mech.pos_key.bias)[h * DH:(h + 1) * DH]
                    if "p2c" in kinds:
                        s = s + k[bi, j, h] @ (mech.pos_query.weight @ p + mech.pos_query.bias)[h * DH:(h + 1) * DH]
                    want[bi, h, i, j] = s / scale
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-10)


# -- fast paths, causality, translation ------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("path", ["dense", "banded", "flash_bias", "fused"])
def test_every_fast_path_equals_the_reference_in_outputs_and_gradients(path, causal):
    """Outputs and the gradients of q, k, v, P and both projections (window 4 < n / 8, so the
    banded path takes the terms too; the fused kernels in float32, as they run)."""
    dtype = torch.float32 if path == "fused" else torch.float64
    n = 40
    mech = layer(causal, max_relative_positions=4).mechanisms[0].to(dtype)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, H, n, DH, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(3))
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[0, :6] = False
    policy = fast.Policy(flash_chunk=16, grad_chunk=8, band_chunk=8)
    assert_fast_equals_reference(mech, lambda: ctx(n, causal=causal), q, k, v, keep, list(mech.parameters()),
                                 lambda t: fast.run(path, q, k, v, t, keep, causal, policy=policy),
                                 grad_tol=1e-4, causal=causal)


def test_the_decoder_is_causal_and_cached_decoding_equals_recompute():
    m = model({"name": "deberta", "max_relative_positions": 4}, causal=True, seed=3)
    assert_causal_and_decodes_as_recompute(m, paths=("reference",))


def test_position_ids_do_not_enter():
    """The terms are built from offsets j − i: shifted position ids change nothing."""
    attn = layer(max_relative_positions=3)
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    torch.testing.assert_close(attn(x, ctx(9, start=21)), attn(x, ctx(9)), rtol=0, atol=0)


# -- retrofit start, parameters, errors ------------------------------------------------------

def test_rescale_false_keeps_the_layers_scale_and_gives_a_neutral_start():
    attn = layer(rescale=False)
    mech = attn.mechanisms[0]
    assert not layer().mechanisms[0].start_at_zero()  # c2c over √3: no neutral start
    assert mech.start_at_zero() and properties({"name": "deberta", "rescale": False}, dims())["acts_on"] == ["score"]
    plain = Attention(dims(), [], "reference").double()
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if not k.startswith("mechanisms.")})
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out = attn(x, ctx(8))
    torch.testing.assert_close(out, plain(x, ctx(8)), rtol=0, atol=1e-14)
    out.pow(2).sum().backward()
    assert mech.pos_key.weight.grad.abs().max() > 0 and mech.pos_query.weight.grad.abs().max() > 0


def test_the_string_form_of_pos_att_type_is_the_list():
    assert layer(pos_att_type="p2c|c2p").mechanisms[0].kinds == ("p2c", "c2p")
    assert layer(pos_att_type="c2p").mechanisms[0].kinds == ("c2p",)


def test_positional_parameters_are_p_and_the_two_projections():
    d = Dims(d_model=32, n_heads=4, n_layers=3, max_len=64, n_segments=1, causal=False)
    assert properties("deberta", d)["positional_params"] == 2 * 64 * 32 + 3 * 2 * (32 * 32 + 32)  # P shared
    assert properties({"name": "deberta", "position_buckets": 16, "max_relative_positions": 40}, d)[
        "positional_params"] == 2 * 16 * 32 + 3 * 2 * (32 * 32 + 32)
    assert properties({"name": "deberta", "pos_att_type": ["c2p"]}, d)["positional_params"] == 2 * 64 * 32 + 3 * (
        32 * 32 + 32)
    assert properties({"name": "deberta", "layer_norm": True}, d)["positional_params"] == 2 * 64 * 32 + 2 * 32 + 3 * (
        2 * (32 * 32 + 32))  # one LayerNorm, shared like P


@pytest.mark.parametrize(("options", "message"), [
    ({"pos_att_type": ["c2c"]}, r"pos_att_type must name c2p and/or p2c once each, got \['c2c'\]"),
    ({"pos_att_type": []}, "pos_att_type must name c2p and/or p2c"),
    ({"pos_att_type": ["c2p", "c2p"]}, r"pos_att_type must name c2p and/or p2c once each, got \['c2p', 'c2p'\]"),
    ({"max_relative_positions": 0}, "max_relative_positions must be a positive integer, got 0"),
    ({"position_buckets": 2}, "position_buckets must be 0 .no buckets. or an integer >= 4, got 2"),
    ({"position_buckets": 16, "max_relative_positions": 8},
     "with position_buckets = 16 the log buckets start at distance 8, so max_relative_positions must exceed 9, got 8"),
])
def test_bad_options_are_refused_with_one_clear_error(options, message):
    with pytest.raises(PositionError, match=f"^deberta: {message}"):
        build([{"name": "deberta", **options}], dims())
