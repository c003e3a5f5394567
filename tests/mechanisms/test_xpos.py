"""xPos (Sun et al. 2022), registered as ``xpos`` and the same as ``{"name": "rope", "xpos": true}``:
both equal to x-transformers' rotary xPos (vectors and a whole attention layer with copied
weights), scores that depend on i − j only with the factor ζ^{(i−j)/B} (a decay in a decoder, the
authors' growth for later keys in an encoder), reference and fast paths equal, causal, and cached
decoding equal to recomputation."""
from __future__ import annotations

import pytest
import torch
from core.helpers import VOCAB, context, dims, model, run, tokens, with_path
from x_transformers.x_transformers import Attention as XAttention
from x_transformers.x_transformers import RotaryEmbedding, apply_rotary_pos_emb

from posattn.attention.decode import KVCache
from posattn.attention.layer import Attention
from posattn.errors import PositionError
from posattn.mechanisms import REGISTRY, build

HEAD = 16


# the registered name and rope's option: one implementation, both checked
FORMS = {"xpos": {"name": "xpos"}, "rope+xpos": {"name": "rope", "xpos": True}}


def spec(form: str = "xpos", **options) -> dict:
    return {**FORMS[form], **options}


def xpos(max_len: int, fraction: float = 1.0, scale_base: float = 8.0, form: str = "xpos", causal: bool = True,
         **options):
    d = dims(causal=causal, d_model=2 * HEAD, n_heads=2, max_len=max_len)
    return build([spec(form, fraction=fraction, scale_base=scale_base, **options)], d)


def order(rotated: int, width: int = HEAD) -> list[int]:
    """x-transformers' channel order (pairs 2m, 2m+1) from posattn's (pairs m, m + r/2)."""
    half = rotated // 2
    return [c for m in range(half) for c in (m, m + half)] + list(range(rotated, width))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rotated", [16, 8])
def test_rotated_vectors_match_x_transformers(rotated, form):
    """With the same centre (x-transformers centres at n // 2, posattn at max_len // 2) q and k are
    the same vectors, q scaled by ζ^{(i−c)/B} and k by its inverse."""
    n = 11
    mech = xpos(max_len=n, fraction=rotated / HEAD, form=form).layers[0][0]
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, n, HEAD, generator=g), torch.randn(2, 2, n, HEAD, generator=g)
    q2, k2, _ = mech.transform_qkv(q, k, q, context(n, 2, causal=True))
    freqs, scale = RotaryEmbedding(rotated, use_xpos=True, scale_base=8.0).forward_from_seq_len(n)
    keep = order(rotated)
    torch.testing.assert_close(q2[..., keep], apply_rotary_pos_emb(q[..., keep], freqs, scale), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k2[..., keep], apply_rotary_pos_emb(k[..., keep], freqs, scale ** -1.0),
                               rtol=1e-5, atol=1e-6)
    assert (scale - 1).abs().max() > 0.1  # the decay is really there


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rotated", [16, 8])
def test_attention_layer_matches_x_transformers_with_copied_weights(rotated, form):
    """x-transformers' causal Attention with rotary xPos, its weights copied into a posattn layer
    built for another max_len (another centre: it cancels in every score)."""
    n, b = 13, 2
    torch.manual_seed(0)
    theirs = XAttention(2 * HEAD, dim_head=HEAD, heads=2, causal=True).double()
    mechs = xpos(max_len=40, fraction=rotated / HEAD, form=form).layers[0]
    d = mechs[0].dims
    ours = Attention(d, mechs, "reference").double()
    rows = torch.cat([torch.tensor(order(rotated)).argsort() + h * HEAD for h in range(2)])  # posattn ← x-t rows
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat([theirs.to_q.weight[rows], theirs.to_k.weight[rows], theirs.to_v.weight]))
        ours.qkv.bias.zero_()
        ours.out.weight.copy_(theirs.to_out.weight)
        ours.out.bias.zero_()
    x = torch.randn(b, n, 2 * HEAD, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rotary = RotaryEmbedding(rotated, use_xpos=True, scale_base=8.0).double()
    want = theirs(x, rotary_pos_emb=rotary.forward_from_seq_len(n))
    for path in ("reference", "fast"):
        ours.path = path
        torch.testing.assert_close(ours(x, context(n, b, causal=True)), want, rtol=1e-5, atol=1e-6)


def scores(shift: int, fraction: float = 1.0, causal: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 1, HEAD, generator=g, dtype=torch.float64).expand(1, 2, 10, HEAD)
    k = torch.randn(1, 2, 1, HEAD, generator=g, dtype=torch.float64).expand(1, 2, 10, HEAD)
    mech = xpos(max_len=32, fraction=fraction, causal=causal).layers[0][0].double()
    q2, k2, _ = mech.transform_qkv(q, k, q, context(10, 1, causal=causal, positions=torch.arange(10)[None] + shift))
    return q2 @ k2.transpose(-1, -2)


@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "encoder"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_scores_depend_on_the_offset_only(fraction, causal):
    dots = scores(0, fraction, causal)
    for off in range(-9, 10):
        diag = torch.diagonal(dots, off, -2, -1)
        torch.testing.assert_close(diag, diag[..., :1].expand_as(diag), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(scores(41, fraction, causal), dots, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "encoder"])
def test_the_decay_is_zeta_to_the_offset_over_scale_base(causal):
    """q_i·k_j = Σ_m ζ_m^{(i−j)/B} · (RoPE's pair-m product): with one channel pair non-zero the
    ratio to plain RoPE is ζ_m^{(i−j)/B} exactly (ζ_m = (2m/r + 0.4)/1.4), below the diagonal a
    decay and, in an encoder (the authors' torchscale form), above it the same factor, a growth."""
    d = dims(causal=causal, d_model=2 * HEAD, n_heads=2, max_len=32)
    plain = build(["rope"], d).layers[0][0].double()
    mech = build([spec(scale_base=8.0)], d).layers[0][0].double()
    n, m = 10, 3
    q = torch.zeros(1, 2, n, HEAD, dtype=torch.float64)
    q[..., m], q[..., m + HEAD // 2] = 1.0, 0.5
    ctx = context(n, 1, causal=causal)
    a, b, _ = mech.transform_qkv(q, q, q, ctx)
    c, e, _ = plain.transform_qkv(q, q, q, context(n, 1, causal=causal))
    zeta = (2 * m / HEAD + 0.4) / 1.4
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    torch.testing.assert_close((a @ b.transpose(-1, -2)) / (c @ e.transpose(-1, -2)),
                               (zeta ** ((i - j) / 8.0)).double().expand(1, 2, n, n), rtol=1e-5, atol=0)


def test_fast_path_equals_reference_and_decoder_is_causal():
    """(The encoder, and the defaults, in tests/core/test_reference_vs_fast.py.)"""
    m = model(spec(fraction=0.5, scale_base=16.0), causal=True, seed=3, d_model=32, n_heads=2)
    fast = with_path(m, "fast")
    ids = tokens(2, 9, seed=1)
    outs, grads = [], []
    for net in (m, fast):
        h = run(net, ids)
        outs.append(h)
        grads.append(torch.autograd.grad(h.pow(2).sum(), list(net.parameters())))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-9)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-9)
    other = ids.clone()
    other[:, 5] = (other[:, 5] + 1) % 30
    for net in (m, fast):
        a, b = run(net, ids), run(net, other)
        torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=0)
        assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-6


def test_cached_decoding_equals_recompute():
    """The fixed centre keeps keys rotated and scaled at their own positions valid in the cache."""
    m = model(spec(scale_base=16.0), causal=True, seed=5, d_model=32, n_heads=2)
    ids = tokens(2, 12, seed=3)
    with torch.no_grad():
        full = m(ids)
        cache = KVCache()
        parts = [m.decode(ids[:, :4], cache)] + [m.decode(ids[:, t:t + 1], cache) for t in range(4, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)


def test_hugging_face_loading_restores_the_xpos_and_rotary_tables(tmp_path):
    """transformers builds on the meta device and leaves non-persistent buffers empty; the
    rotation's θ and ζ are recomputed, so the loaded model is the saved one exactly."""
    import posattn
    from posattn import Decoder, ModelConfig
    from posattn.hf import PosattnForCausalLM

    options = spec(fraction=0.5, scaling="yarn", factor=2.0, original_max_len=8)
    torch.manual_seed(0)
    saved = Decoder(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_len=32, mechanisms=[options]))
    folder = posattn.save(saved.eval(), tmp_path / "dec")
    loaded = PosattnForCausalLM.from_pretrained(folder).eval()
    ids = tokens(2, 20, seed=6)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, saved(ids))


def test_the_registered_name_is_rope_with_xpos():
    """One implementation: the same parameters-free module, the same outputs, rope's options less
    ``xpos`` (always on), the same length rescalings, and errors that name ``xpos``."""
    options = {"fraction": 0.5, "scale_base": 16.0, "scaling": "yarn", "factor": 2.0, "original_max_len": 8}
    ids = tokens(2, 12, seed=7)
    a = model(spec("xpos", **options), causal=True, seed=4, d_model=32, n_heads=2)
    b = model(spec("rope+xpos", **options), causal=True, seed=4, d_model=32, n_heads=2)
    assert torch.equal(run(a, ids), run(b, ids))
    xp, rope = REGISTRY["xpos"], REGISTRY["rope"]
    assert issubclass(xp, rope) and xp.option_names() == ["scale_base"] + [
        o for o in rope.option_names() if o not in ("xpos", "scale_base")]
    assert xp.length_scalings == rope.length_scalings
    assert xp.length_scaled({"scale_base": 64.0}, "yarn", 4.0, 128) == {
        "scale_base": 64.0, "scaling": "yarn", "factor": 4.0, "original_max_len": 128}
    d = dims(causal=True, d_model=32, n_heads=2)
    with pytest.raises(PositionError, match="^xpos: unknown option.s. xpos; valid options: scale_base, base, "):
        build([{"name": "xpos", "xpos": False}], d)
    with pytest.raises(PositionError, match=r"^xpos: fraction must be in \(0, 1\], got 0"):
        build([{"name": "xpos", "fraction": 0.0}], d)
    with pytest.raises(PositionError, match="^xpos: unknown scaling 'ntkk'"):
        build([{"name": "xpos", "scaling": "ntkk"}], d)


def test_hugging_face_retrofit_takes_xpos_in_an_encoder():
    """A pretrained BERT takes xpos as it takes rope (its own start: a rotation has no neutral one)."""
    pytest.importorskip("transformers")
    from hf.test_retrofit import logits, tiny

    from posattn.hf import add_mechanisms

    model_ = add_mechanisms(tiny("bert"), [{"name": "xpos", "scale_base": 32.0}])
    assert logits(model_).isfinite().all()
    assert model_.config.posattn_retrofit["mechanisms"] == [{"name": "xpos", "scale_base": 32.0}]
