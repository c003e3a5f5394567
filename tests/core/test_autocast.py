"""Mixed precision: a bf16-autocast training step works for every mechanism (CPU autocast here;
the same code path runs under CUDA autocast in `posattn pretrain --precision bf16`)."""
from __future__ import annotations

import pytest
import torch

import posattn
from posattn.models import Decoder, Encoder, ModelConfig


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("name", posattn.names())
def test_bf16_autocast_step(name, causal):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_len=24, mechanisms=[name])
    try:
        model = (Decoder if causal else Encoder)(cfg)
    except posattn.PositionError as e:
        pytest.skip(str(e))
    ids = torch.randint(0, 40, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids) if causal else model.mlm_logits(model(ids))
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
