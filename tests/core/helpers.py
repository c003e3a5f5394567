"""Shared helpers for the core tests: tiny models with randomised weights, inputs, path swaps."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import posattn
from posattn.attention.layer import Attention
from posattn.mechanisms import REGISTRY, Context, Dims, build
from posattn.models import Decoder, Encoder, ModelConfig

VOCAB = 37
NAMES = posattn.names()
MIXERS = [n for n in NAMES if REGISTRY[n].mixes]  # replace softmax(s)·V (tests/mixers)


def skip_encoder_only(spec: Any, causal: bool) -> None:
    """Skip a decoder case of a mechanism that refuses decoders (tests/mixers checks the error)."""
    from posattn.mechanisms import runs_in_decoder

    if causal and not runs_in_decoder(spec, dims()):
        pytest.skip("encoder-only mechanism")

# Option variants beyond the defaults, checked reference-vs-fast and for causality as well.
VARIANTS: list[Any] = [
    [{"name": "rope", "scaling": "yarn", "factor": 4.0, "original_max_len": 8}],
    [{"name": "rope", "scaling": "linear", "factor": 2.0}],
    [{"name": "rope", "scaling": "ntk", "factor": 4.0}],
    [{"name": "rope", "fraction": 0.5, "scaling": "llama3", "factor": 4.0, "original_max_len": 8}],
    [{"name": "rope", "scaling": "dynamic", "factor": 2.0, "original_max_len": 8}],
    [{"name": "rope", "scaling": "longrope", "factor": 4.0, "original_max_len": 8, "short_factor": [1.0, 1.5],
      "long_factor": [2.0, 6.0]}],
    [{"name": "t5", "share_layers": False, "num_buckets": 8, "max_distance": 12}],
    [{"name": "fixed_conv", "kernel_size": 3}],
    [{"name": "dynamic_conv", "kernel_size": 5}],
    [{"name": "key_dynamic_conv", "kernel_size": 5}],
    [{"name": "composite", "kernel_size": 3}],
    [{"name": "depthwise_conv", "kernel_size": 5}],
    [{"name": "conv_qkv", "targets": "qk", "fraction": 0.25, "kernel_size": 3}],
    [{"name": "cat", "kernel_size": 5, "depthwise": True, "qk_norm": True}],
    [{"name": "cat", "targets": "v"}],
    [{"name": "diet_abs", "sharing": "head", "rank": 6}],
    [{"name": "diet_abs", "sharing": "layer"}],
    [{"name": "diet_rel", "max_distance": 3}],
    [{"name": "segment", "mode": "input"}],
    [{"name": "tupe", "relative_bias": True}],
    [{"name": "tupe", "untie_cls": True}],
    [{"name": "tisa", "n_kernels": 2, "mode": "supplement"}, "absolute"],
    [{"name": "kerple", "kernel": "power"}],
    [{"name": "sandwich", "dim": 16}],
    [{"name": "dynamic_pos_bias", "log_distance": True, "norm": True, "depth": 3, "share_layers": False}],
    [{"name": "alibi", "heads": 3, "learned": True}],
    [{"name": "alibi", "learned": True, "bidirectional": "asymmetric"}],
    [{"name": "forgetting", "bias_init": 1.0, "post_log_scale": 0.5}],
    [{"name": "xpos", "fraction": 0.5, "scale_base": 8.0, "scaling": "yarn", "factor": 2.0, "original_max_len": 8}],
    [{"name": "deberta", "max_relative_positions": 9, "position_buckets": 4, "pos_att_type": ["p2c"],
      "layer_norm": True}],
    [{"name": "deberta", "max_relative_positions": 3, "rescale": False}, "transformer_xl"],
    ["kerple", "forgetting", "t5"],
    ["cat", "tisa"],
    ["rope", "alibi", "diet_abs", "segment"],
    ["sinusoidal", "composite", "depthwise_conv", "t5"],
    ["conv_qkv", "key_dynamic_conv", "tupe", "diet_rel"],
]


def spec_id(specs: Any) -> str:
    if isinstance(specs, (str, dict)):
        specs = [specs]
    out = []
    for s in specs:
        if isinstance(s, str):
            out.append(s)
        else:
            opts = ",".join(f"{k}={v}" for k, v in s.items() if k != "name")
            out.append(f"{s['name']}({opts})")
    return "+".join(out)


def config(mechanisms: Any, **kw: Any) -> ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=4, d_ff=24, max_len=24,
                n_segments=3, mechanisms=mechanisms, attn_path="reference")
    base.update(kw)
    return ModelConfig(**base)


def randomize(model: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> torch.nn.Module:
    """Perturb every parameter so no term sits at an identity/zero init (e.g. cat's delta filter)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)
    return model


def model(mechanisms: Any, causal: bool = False, dtype: torch.dtype = torch.float64, seed: int = 0,
          path: str = "reference", **kw: Any):
    if isinstance(mechanisms, (str, dict)):
        mechanisms = [mechanisms]
    torch.manual_seed(seed)
    m = (Decoder if causal else Encoder)(config(mechanisms, attn_path=path, **kw)).to(dtype)
    randomize(m, seed)
    return m.eval()


def set_path(m: torch.nn.Module, path: str) -> torch.nn.Module:
    for mod in m.modules():
        if isinstance(mod, Attention):
            mod.path = path
    return m


def with_path(m: torch.nn.Module, path: str) -> torch.nn.Module:
    return set_path(copy.deepcopy(m), path)


def run(m, ids, mask=None, segments=None, positions=None):
    if isinstance(m, Decoder):
        return m.hidden(ids, None, mask, positions)
    return m.hidden(ids, segments, mask, positions)


def tokens(b: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def segments_for(ids: torch.Tensor) -> torch.Tensor:
    seg = torch.zeros_like(ids)
    seg[:, ids.shape[1] // 2:] = 1
    seg[0, -2:] = 2
    return seg


def dims(causal: bool = False, d_model: int = 16, n_heads: int = 4, n_layers: int = 1,
         max_len: int = 24, n_segments: int = 3) -> Dims:
    return Dims(d_model, n_heads, n_layers, max_len, n_segments, causal)


def layer_mechanism(spec: Any, d: Dims, seed: int = 0):
    """One (layer-level or input-level) mechanism instance with randomised parameters."""
    built = build([spec], d)
    mech = built.input[0] if built.input else built.layers[0][0]
    return randomize(mech.double(), seed)


def context(n: int, b: int = 2, causal: bool = False, keep=None, segments=None, positions=None,
            x=None) -> Context:
    pos = torch.arange(n).expand(b, n) if positions is None else positions
    seg = torch.zeros(b, n, dtype=torch.long) if segments is None else segments
    return Context(positions=pos, segments=seg, keep=keep, causal=causal, x=x)
