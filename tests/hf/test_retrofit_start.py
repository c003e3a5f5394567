"""How each mechanism starts inside a pretrained model when ``add_mechanisms`` is given no ``init``:
a mechanism with a neutral start leaves the pretrained model's outputs unchanged and still
trains; every other mechanism starts at its own initialisation."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from posattn import PositionError  # noqa: E402
from posattn.hf import add_mechanisms  # noqa: E402  (the documented import)
from posattn.mechanisms import REGISTRY, Dims, build  # noqa: E402

from .test_retrofit import IDS, MASK, logits, tiny  # noqa: E402

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "huggingface.md"
# what a BERT self-attention cannot take, with the reason add_mechanisms gives
REFUSED = {name: "acts on the input" if cls.placement_for({}) == "input" else "reads the layer's input x"
           for name, cls in REGISTRY.items() if cls.placement_for({}) == "input" or cls.reads_layer_input}


def has_neutral_start(name: str) -> bool:
    return build([name], Dims(16, 4, 2, 40, 2, False)).layers[0][0].start_at_zero()


NEUTRAL = [name for name in REGISTRY if name not in REFUSED and has_neutral_start(name)]
OWN_START = [name for name in REGISTRY if name not in REFUSED and name not in NEUTRAL]


def guide_table() -> dict[str, set[str]]:
    """The Hugging Face guide's table of starts: {first column: mechanism names in the second}."""
    text = GUIDE.read_text()
    table = text[text.index("| neutral start | mechanisms |"):].split("\n\n")[0]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
    return {kind.strip(): {name for name in re.findall(r"`([a-z_0-9]+)`", names) if name in REGISTRY}
            for kind, names in rows}


def test_the_guide_states_how_every_mechanism_starts():
    """Every registered mechanism in exactly one row of the guide's table, and the row true."""
    rows = guide_table()
    named = [name for names in rows.values() for name in names]
    assert sorted(named) == sorted(REGISTRY), "each mechanism once"
    own = rows.pop("none: own initialisation")
    refused = rows.pop(next(kind for kind in rows if kind.startswith("refused")))
    assert set().union(*rows.values()) == set(NEUTRAL)
    assert own == set(OWN_START)
    assert refused == set(REFUSED)


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
