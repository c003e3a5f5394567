"""``generate`` with a key/value cache equals recomputing the prefix; blocked mechanisms fall back."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from posattn.hf import PosattnConfig, PosattnForCausalLM  # noqa: E402


def lm(mechanisms: list) -> PosattnForCausalLM:
    torch.manual_seed(0)
    model = PosattnForCausalLM(PosattnConfig(kind="decoder", vocab_size=40, d_model=16, n_layers=2, n_heads=2,
                                             max_len=64, mechanisms=mechanisms)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def generate(model, ids, use_cache: bool, **kw):
    return model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=use_cache, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, **kw)


@pytest.mark.parametrize("mechanisms", [["rope"], ["alibi"], ["t5"], ["tisa"], ["diet_rel"], ["diet_abs"],
                                        ["cat", "rope"], ["composite"],
                                        ["absolute", {"name": "tisa", "mode": "supplement"}]])
def test_cached_generate_equals_recompute(mechanisms):
    model = lm(mechanisms)
    ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(2))
    steps = []
    decode = model.posattn.decode
    model.posattn.decode = lambda x, cache: steps.append(x.shape[1]) or decode(x, cache)
    cached = generate(model, ids, True)
    assert steps == [6] + [1] * 9  # the prompt once, then one token per step
    plain = generate(model, ids, False)
    assert torch.equal(cached.sequences, plain.sequences)
    for a, b in zip(cached.logits, plain.logits):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_beam_search_reorders_the_cache():
    model = lm(["cat", "alibi"])
    ids = torch.randint(1, 40, (1, 5), generator=torch.Generator().manual_seed(3))
    a = model.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=True, pad_token_id=0)
    b = model.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("mechanisms", [["depthwise_conv"], ["rope"]])
def test_fallback_recomputes_with_a_warning(mechanisms):
    model = lm(mechanisms)
    ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if mechanisms == ["rope"]:
        mask[0, 0] = 0  # padding: no cache
    with pytest.warns(UserWarning, match="recomputes the whole prefix"):
        cached = generate(model, ids, True, attention_mask=mask)
    assert torch.equal(cached.sequences, generate(model, ids, False, attention_mask=mask).sequences)
