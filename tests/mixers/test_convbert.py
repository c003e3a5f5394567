"""convbert against Hugging Face's ConvBertSelfAttention, weights copied across."""
from __future__ import annotations

import pytest
import torch

from posattn.attention.layer import Attention
from posattn.mechanisms import Context, Dims, build

transformers = pytest.importorskip("transformers")
from transformers.models.convbert.modeling_convbert import ConvBertConfig, ConvBertSelfAttention  # noqa: E402


def layer_pair(n_heads: int, head_ratio: int, kernel: int, d: int = 32):
    dims = Dims(d, n_heads, 1, 64, 1, False)
    mechs = build([{"name": "convbert", "head_ratio": head_ratio, "conv_kernel_size": kernel}], dims).layers[0]
    ours = Attention(dims, mechs, "fast").double().eval()
    cfg = ConvBertConfig(hidden_size=d, num_attention_heads=n_heads, head_ratio=head_ratio,
                         conv_kernel_size=kernel, attention_probs_dropout_prob=0.0)
    hf = ConvBertSelfAttention(cfg).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
        half = d // 2
        w, bias = ours.qkv.weight, ours.qkv.bias
        w.zero_(), bias.zero_()
        for i, lin in enumerate((hf.query, hf.key, hf.value)):  # attention half of q, k, v
            w[i * d: i * d + half], bias[i * d: i * d + half] = lin.weight, lin.bias
        w[2 * d + half:], bias[2 * d + half:] = hf.conv_out_layer.weight, hf.conv_out_layer.bias
        m = mechs[0]
        m.depthwise.copy_(hf.key_conv_attn_layer.depthwise.weight[:, 0])
        m.pointwise.weight.copy_(hf.key_conv_attn_layer.pointwise.weight[..., 0])
        m.pointwise.bias.copy_(hf.key_conv_attn_layer.bias[:, 0])
        m.span_kernel.load_state_dict(hf.conv_kernel_layer.state_dict())
        ours.out.weight.copy_(torch.eye(d)), ours.out.bias.zero_()
    return ours, hf, dims


@pytest.mark.parametrize("n_heads,head_ratio,kernel", [(4, 2, 9), (4, 1, 3), (4, 4, 5), (2, 4, 7)])
def test_matches_transformers(n_heads, head_ratio, kernel):
    ours, hf, _ = layer_pair(n_heads, head_ratio, kernel)
    x = torch.randn(2, 11, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ctx = Context(positions=torch.arange(11).expand(2, 11), segments=torch.zeros(2, 11, dtype=torch.long),
                  keep=None, causal=False)
    for path in ("reference", "fast"):
        ours.path = path
        torch.testing.assert_close(ours(x, ctx), hf(x)[0], rtol=1e-10, atol=1e-10)
