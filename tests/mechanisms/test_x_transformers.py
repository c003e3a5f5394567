"""Equal to x-transformers where it has the mechanism: ALiBi on a subset of heads
(``alibi_num_heads``), the dynamic position bias and data-dependent ALiBi (the forget gate). The
x-transformers modules are built as its ``AttentionLayers`` builds them, their weights copied into
posattn's, and the attention layers' outputs compared on both of posattn's paths."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from core.helpers import context, dims

from posattn.attention.layer import Attention
from posattn.mechanisms import build

xt = pytest.importorskip("x_transformers.x_transformers")

D, H, N = 16, 4, 11


def layers(spec, causal, dtype=torch.float64):
    """posattn's attention layer with ``spec`` and x-transformers' attention with the same
    q/k/v/out weights (no biases, as x-transformers), both in ``dtype``."""
    d = dims(causal=causal, d_model=D, n_heads=H)
    torch.manual_seed(0)
    ours = Attention(d, build([spec], d).layers[0], "reference", bias=False).to(dtype).eval()
    theirs = xt.Attention(D, heads=H, dim_head=D // H, causal=causal,
                          data_dependent_alibi=spec["name"] == "forgetting").to(dtype).eval()
    theirs.attend.attn_fn = partial(torch.softmax, dim=-1)  # its softmax runs in float32; compare in float64
    with torch.no_grad():
        q, k, v = ours.qkv.weight.chunk(3)
        theirs.to_q.weight.copy_(q)
        theirs.to_k.weight.copy_(k)
        theirs.to_v.weight.copy_(v)
        theirs.to_out.weight.copy_(ours.out.weight)
    return ours, theirs


def compare(ours, theirs, causal, rel_pos=None, dtype=torch.float64):
    x = torch.randn(2, N, D, generator=torch.Generator().manual_seed(1), dtype=dtype)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        want = theirs(x, rel_pos=rel_pos)
        for path in ("reference", "fast"):
            ours.path = path
            got = ours(x, context(N, 2, causal))
            torch.testing.assert_close(got, want, **tol)
    return want


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_alibi_on_a_subset_of_heads_equals_alibi_num_heads(k, causal):
    ours, theirs = layers({"name": "alibi", "heads": k}, causal)
    rel_pos = xt.AlibiPositionalBias(heads=k, total_heads=H).double()  # AttentionLayers' alibi_num_heads
    compare(ours, theirs, causal, rel_pos)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("options", [{}, {"log_distance": True}, {"norm": True, "depth": 3}],
                         ids=["plain", "log_distance", "norm_depth3"])
def test_dynamic_pos_bias_equals_x_transformers(options, causal):
    spec = {"name": "dynamic_pos_bias", **options}
    f32 = torch.float32  # x-transformers' DynamicPositionBias feeds its MLP float32 distances
    ours, theirs = layers(spec, causal, f32)
    # AttentionLayers(dynamic_pos_bias=True): DynamicPositionBias(dim = dim // 4, heads, ...)
    rel_pos = xt.DynamicPositionBias(dim=D // 4, heads=H, depth=options.get("depth", 2),
                                     log_distance=options.get("log_distance", False),
                                     norm=options.get("norm", False))
    mech = ours.mechanisms[0]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        theirs_layers = [m for m in rel_pos.modules() if isinstance(m, torch.nn.Linear)]
        our_layers = [m for m in mech.mlp if isinstance(m, torch.nn.Linear)]
        assert len(theirs_layers) == len(our_layers)
        for a, b in zip(theirs_layers, our_layers):
            a.weight.copy_(torch.randn(a.weight.shape, generator=g, dtype=f32))
            a.bias.copy_(torch.randn(a.bias.shape, generator=g, dtype=f32) * 0.5)
            b.weight.copy_(a.weight)
            b.bias.copy_(a.bias)
        # x-transformers' hidden layers are Sequential(Linear, norm, SiLU); its first norm is its
        # own bias-free LayerNorm (a gamma), the others torch's
        their_norms = [seq[1] for seq in rel_pos.mlp[:-1]] if options.get("norm") else []
        our_norms = [m for m in mech.mlp if isinstance(m, torch.nn.LayerNorm)]
        assert len(their_norms) == len(our_norms)
        for a, b in zip(their_norms, our_norms):
            gamma = torch.rand(b.weight.shape, generator=g, dtype=f32) + 0.5
            if isinstance(a, xt.LayerNorm):
                a.gamma.copy_(gamma)
                b.bias.zero_()
            else:
                a.weight.copy_(gamma)
                a.bias.copy_(torch.randn(a.bias.shape, generator=g, dtype=f32))
                b.bias.copy_(a.bias)
            b.weight.copy_(gamma)
    compare(ours, theirs, causal, rel_pos, f32)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_forgetting_gate_equals_data_dependent_alibi(causal):
    ours, theirs = layers({"name": "forgetting", "bias_init": 0.5}, causal)
    g = torch.Generator().manual_seed(4)
    gate = theirs.data_dependent_alibi.to_forget_gates[0]
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g, dtype=torch.float64))
        gate.bias.copy_(torch.randn(gate.bias.shape, generator=g, dtype=torch.float64) + 1.0)
        ours.mechanisms[0].gates.weight.copy_(gate.weight)
        ours.mechanisms[0].gates.bias.copy_(gate.bias)
    assert gate.weight.shape == (H * (1 if causal else 2), D)
    out = compare(ours, theirs, causal)
    # not vacuous: without the gate's bias term the output differs
    plain = xt.Attention(D, heads=H, dim_head=D // H, causal=causal).double()
    plain.load_state_dict({k: v for k, v in theirs.state_dict().items() if "forget" not in k})
    x = torch.randn(2, N, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        assert (plain(x) - out).abs().max() > 1e-3
