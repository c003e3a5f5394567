"""The fast attention path equals the reference path: outputs and gradients (w.r.t. the
embedded input and every parameter), encoder and decoder, with and without padding, for every
registered mechanism (defaults), a set of option variants, and a few compositions."""
from __future__ import annotations

import pytest
import torch

from posattn.mechanisms import REGISTRY

from .helpers import MIXERS, NAMES, VARIANTS, model, run, segments_for, skip_encoder_only, spec_id, tokens, with_path

B, N = 3, 12


def padding_mask() -> torch.Tensor:
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 9:] = False  # right padding
    keep[2, :4] = False  # left padding
    return keep


def forward_and_grads(m, ids, keep, segments):
    """Hidden states and gradients of a fixed loss over the real positions."""
    captured = []
    hook = m.tokens.register_forward_hook(lambda mod, inp, out: captured.append(out) or None)
    try:
        h = run(m, ids, keep, segments)
    finally:
        hook.remove()
    g = torch.Generator().manual_seed(7)
    w = torch.randn(h.shape, generator=g, dtype=torch.float64).to(h.dtype)
    real = torch.ones(ids.shape, dtype=h.dtype) if keep is None else keep.to(h.dtype)
    loss = (h * w * real[..., None]).sum()
    params = [p for _, p in m.named_parameters()]
    grads = torch.autograd.grad(loss, captured + params, allow_unused=True)
    names = ["<embedded input>"] + [n for n, _ in m.named_parameters()]
    return h, {n: (torch.zeros_like(t) if gr is None else gr)
               for n, t, gr in zip(names, captured + params, grads)}


def tol(dtype):
    return 1e-10 if dtype == torch.float64 else 2e-5


def close(a, b, dtype, what):
    err = (a - b).abs().max().item() if a.numel() else 0.0
    bound = tol(dtype) * (1.0 + a.abs().max().item())
    assert err <= bound, f"{what}: max |reference − fast| = {err:.3e} > {bound:.1e}"


def check_paths(specs, causal, padded, dtype):
    ref = model(specs, causal=causal, dtype=dtype, seed=3)
    fast = with_path(ref, "fast")
    ids = tokens(B, N, seed=1)
    keep = padding_mask() if padded else None
    segments = None if causal else segments_for(ids)
    h_ref, g_ref = forward_and_grads(ref, ids, keep, segments)
    h_fast, g_fast = forward_and_grads(fast, ids, keep, segments)
    real = torch.ones(B, N, dtype=torch.bool) if keep is None else keep
    close(h_ref[real], h_fast[real], dtype, "hidden states")
    assert g_ref.keys() == g_fast.keys()
    for name in g_ref:
        close(g_ref[name], g_fast[name], dtype, f"gradient of {name}")
    # the comparison is not vacuous: the loss reaches the input and the mechanism's parameters
    assert g_ref["<embedded input>"].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("name", NAMES)
def test_fast_equals_reference(name, causal, padded, dtype):
    skip_encoder_only(name, causal)
    check_paths([name], causal, padded, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("specs", VARIANTS, ids=spec_id)
def test_fast_equals_reference_variants(specs, causal):
    skip_encoder_only(specs[0], causal)
    check_paths(specs, causal, padded=True, dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("name", [n for n in NAMES
                                  if n not in ("none", "sinusoidal", "rope", "xpos", "alibi", "sandwich")])
def test_every_positional_parameter_is_trained(name, causal):
    """Each mechanism's own parameters receive a gradient on both paths (they are really used)."""
    skip_encoder_only(name, causal)
    for path in ("reference", "fast"):
        m = model([name], causal=causal, seed=2, path=path)
        ids = tokens(2, N, seed=4)
        h = run(m, ids, None, None if causal else segments_for(ids))
        h.pow(2).sum().backward()
        mechs = m.mechanisms()
        params = {id(p): (n, p) for mech in mechs for n, p in mech.named_parameters()}
        assert params, f"{name} has no parameters"
        for n, p in params.values():
            assert p.grad is not None and p.grad.abs().max() > 0, f"{name}.{n} gets no gradient ({path})"


LOW_RANK_OR_NOTHING = ["none", "absolute", "sinusoidal", "rope", "cat", "conv_qkv", "diet_abs", "segment",
                       "tupe", "depthwise_conv"]


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
# the softmax path's structure; score transforms write their scores out (tests/mechanisms/test_cope.py)
@pytest.mark.parametrize("name", [n for n in NAMES if n not in MIXERS and REGISTRY[n].cost_class != "score_transform"])
def test_fast_path_structure(name, causal, monkeypatch):
    """The fast path never materialises Shaw's n×n×d tensor or a low-rank n×n term, and with
    only low-rank terms (or causal ALiBi in a decoder) and no padding it hands SDPA no mask.
    One attention call per layer: SDPA, or the fused kernels (relative and low-rank terms, no
    mask at all)."""
    import torch.nn.functional as F

    from posattn.attention import fast, terms

    def refuse(*args, **kwargs):
        raise AssertionError("materialised on the fast path")

    monkeypatch.setattr(terms.QueryRelative, "relative_embeddings", refuse)
    monkeypatch.setattr(terms.QueryRelative, "dense", refuse)
    monkeypatch.setattr(terms.LowRank, "dense", refuse)
    masks = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(fast.F, "scaled_dot_product_attention", spy)
    real_fused = fast.fused_attention

    def fused_spy(*args, **kwargs):
        masks.append("fused")
        return real_fused(*args, **kwargs)

    monkeypatch.setattr(fast, "fused_attention", fused_spy)
    m = model([name], causal=causal, path="fast", dtype=torch.float32)
    ids = tokens(2, N)
    h = run(m, ids, None, None if causal else segments_for(ids))
    h.sum().backward()
    assert len(masks) == 2  # one call per layer
    if name in LOW_RANK_OR_NOTHING or (causal and name == "alibi"):
        assert all(mk is None or isinstance(mk, str) for mk in masks), f"{name}: a mask was built with nothing to hide"
