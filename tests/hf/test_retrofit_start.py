"""How each mechanism starts inside a pretrained model when ``add_mechanisms`` is given no ``init``:
a mechanism with a neutral start leaves the pretrained model's outputs unchanged and still
trains; every other mechanism starts at its own initialisation."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from posattn import PositionError  # noqa: E402
from posattn.hf import add_mechanisms  # noqa: E402  (the documented import)
from posattn.mechanisms import REGISTRY, Dims, build  # noqa: E402

from .test_retrofit import IDS, MASK, logits, tiny  # noqa: E402

# the mechanisms documented (posattn.hf.retrofit, the Hugging Face guide) to start neutral
DOCUMENTED_NEUTRAL = {"tisa", "t5", "diet_rel", "diet_abs", "fixed_conv", "dynamic_conv", "key_dynamic_conv",
                      "composite", "depthwise_conv", "cat", "segment", "none"}
# what a BERT self-attention cannot take, with the reason add_mechanisms gives
REFUSED = {name: "acts on the input" if cls.placement_for({}) == "input" else "reads the layer's input x"
           for name, cls in REGISTRY.items() if cls.placement_for({}) == "input" or cls.reads_layer_input}


def has_neutral_start(name: str) -> bool:
    return build([name], Dims(16, 4, 2, 40, 2, False)).layers[0][0].start_at_zero()


NEUTRAL = [name for name in REGISTRY if name not in REFUSED and has_neutral_start(name)]
OWN_START = [name for name in REGISTRY if name not in REFUSED and name not in NEUTRAL]


def test_the_documented_neutral_starts_exist():
    assert {"absolute", "sinusoidal", "conv_qkv", "convbert"} <= set(REFUSED)
    assert DOCUMENTED_NEUTRAL <= set(NEUTRAL)
    assert {"alibi", "rope", "tupe", "linformer", "lincat"} <= set(OWN_START)


@pytest.mark.parametrize("name", NEUTRAL)
def test_a_neutral_start_leaves_the_pretrained_model_unchanged_and_trains(name):
    model = tiny("bert")
    before = logits(model)
    add_mechanisms(model, [name])
    torch.testing.assert_close(logits(model), before, atol=2e-6, rtol=1e-5)
    params = [p for n, p in model.named_parameters() if ".position_mechanisms." in n]
    if not params:  # "none": nothing to train
        return
    model.train()
    out = model(input_ids=IDS, attention_mask=MASK).logits
    (out[MASK.bool()] ** 2).mean().backward()
    assert any(float(p.grad.abs().max()) > 0 for p in params if p.grad is not None), name


@pytest.mark.parametrize("name", OWN_START)
def test_a_mechanism_without_one_starts_at_its_own_initialisation(name):
    """``add_mechanisms(model, ["alibi"])`` works; ``init="zero"`` is refused by name."""
    torch.manual_seed(1)
    added = add_mechanisms(tiny("bert"), [name])
    torch.manual_seed(1)
    default = add_mechanisms(tiny("bert"), [name], init="default")
    torch.testing.assert_close(logits(added), logits(default), atol=0, rtol=0)
    assert logits(added).isfinite().all()
    with pytest.raises(PositionError, match=f"which {name} does not have"):
        add_mechanisms(tiny("bert"), [name], init="zero")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_a_bert_attention_cannot_take_is_refused_by_name(name):
    with pytest.raises(PositionError, match=f"{name}.*{REFUSED[name]}|{REFUSED[name]}"):
        add_mechanisms(tiny("bert"), [name])
