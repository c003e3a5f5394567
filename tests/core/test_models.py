"""Encoder and Decoder: shapes, heads, construction from dict/YAML, save/load round trips."""
from __future__ import annotations

import json

import pytest
import torch

from posattn import Decoder, Encoder, ModelConfig, build_model, load, save
from posattn.models import from_yaml, is_checkpoint

from .helpers import NAMES, VARIANTS, VOCAB, config, model, run, segments_for, skip_encoder_only, spec_id, tokens


def test_encoder_shapes_and_heads():
    m = Encoder(config(["cat", "tisa"], n_classes=3)).eval()
    ids = tokens(2, 10)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[1, 7:] = False
    h = m(ids, segments_for(ids), keep)
    assert h.shape == (2, 10, 16)
    mlm = m.mlm_logits(h)
    assert mlm.shape == (2, 10, VOCAB)
    logits = m.classify(ids, segments_for(ids), keep)
    assert logits.shape == (2, 3)
    with torch.no_grad():    # the [CLS]-row shortcut equals pooling the whole computation's first row
        torch.testing.assert_close(logits, m.classifier(m.pooler(h[:, 0])))
    # the MLM decoder is tied to the token embeddings
    assert not hasattr(m, "head")
    with torch.no_grad():
        want = torch.nn.functional.linear(m.mlm_transform(h), m.tokens.weight) + m.mlm_bias
    torch.testing.assert_close(mlm, want)
    untied = Encoder(config(["none"], tie_embeddings=False))
    assert untied.mlm_logits(untied(ids)).shape == (2, 10, VOCAB)
    assert untied.head.weight.data_ptr() != untied.tokens.weight.data_ptr()


def test_decoder_shapes():
    m = Decoder(config(["rope", "cat"])).eval()
    ids = tokens(3, 7)
    assert m(ids).shape == (3, 7, VOCAB)
    keep = torch.ones(3, 7, dtype=torch.bool)
    keep[0, :2] = False
    assert m(ids, keep).shape == (3, 7, VOCAB)
    assert Decoder(config(["none"], tie_embeddings=False))(ids).shape == (3, 7, VOCAB)


@pytest.mark.parametrize("tie", [True, False])
def test_decoder_logits_of_scored_positions_only(tie):
    m = Decoder(config(["rope", "cat"], tie_embeddings=tie)).eval()
    ids, scored = tokens(3, 7), torch.rand(3, 7, generator=torch.Generator().manual_seed(0)) < 0.3
    assert 0 < scored.sum() < scored.numel()
    torch.testing.assert_close(m(ids, scored=scored), m(ids)[scored], rtol=1e-6, atol=1e-6)


def test_no_mlp_blocks():
    m = Decoder(config(["cat"], d_ff=0))
    assert all(b.mlp is None for b in m.blocks)
    assert m(tokens(1, 5)).shape == (1, 5, VOCAB)


def test_segment_ids():
    ids = tokens(2, 10)
    seg = segments_for(ids)
    for spec in (["segment"], [{"name": "segment", "mode": "input"}]):
        m = model(spec)
        assert (run(m, ids, segments=seg) - run(m, ids)).abs().max() > 1e-3
    # without a segment mechanism the ids are accepted and have no effect
    m = model(["absolute"])
    torch.testing.assert_close(run(m, ids, segments=seg), run(m, ids))


def test_build_from_dict_and_yaml(tmp_path):
    data = {"kind": "encoder", "vocab_size": 50, "d_model": 16, "n_heads": 2, "n_layers": 1,
            "max_len": 32, "mechanisms": ["cat", {"name": "tisa", "n_kernels": 3}]}
    m = build_model(data)
    assert isinstance(m, Encoder) and m.cfg.mechanisms[1] == {"name": "tisa", "n_kernels": 3}
    assert m.blocks[0].attn.mechanisms[1].a.shape == (2, 3)
    path = tmp_path / "model.yaml"
    path.write_text("kind: decoder\nvocab_size: 50\nd_model: 16\nn_heads: 2\nn_layers: 3\n"
                    "mechanisms:\n  - rope\n  - name: cat\n    kernel_size: 4\n")
    y = from_yaml(path)
    assert isinstance(y, Decoder) and len(y.blocks) == 3
    assert y.blocks[0].attn.mechanisms[1].filters["q"].shape == (16, 4)  # one filter per channel
    assert ModelConfig.from_dict(m.cfg.to_dict()) == m.cfg


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("specs", [[n] for n in NAMES] + VARIANTS[-4:], ids=spec_id)
def test_save_load_round_trip(specs, causal, tmp_path):
    skip_encoder_only(specs[0], causal)
    m = model(specs, causal=causal, seed=3, dtype=torch.float32, path="fast", n_classes=0 if causal else 2)
    folder = save(m, tmp_path / "ckpt")
    assert is_checkpoint(folder)
    assert (folder / "model.safetensors").is_file()
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["kind"] == ("decoder" if causal else "encoder") and cfg["attn_path"] == "fast"
    back = load(folder)
    assert type(back) is type(m)
    a, b = m.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ids = tokens(2, 9, seed=1)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, 6:] = False
    seg = None if causal else segments_for(ids)
    assert torch.equal(run(m, ids, keep, seg), run(back.eval(), ids, keep, seg))
    # shared parameters stay shared after loading (tied embeddings; layer-shared mechanisms)
    if not causal:
        assert back.classify(ids).shape == (2, 2)
    n_shared = len({id(p) for p in m.parameters()})
    assert len({id(p) for p in back.parameters()}) == n_shared


def test_not_a_checkpoint(tmp_path):
    from posattn.errors import PositionError

    assert not is_checkpoint(tmp_path)
    with pytest.raises(PositionError, match="not a posattn checkpoint"):
        load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert not is_checkpoint(tmp_path)
    with pytest.raises(PositionError, match="not valid JSON"):
        load(tmp_path)


def test_mechanisms_compose_in_order_and_without_name_special_cases():
    m = model(["cat", "tisa", "segment"])
    names = [x.name for x in m.blocks[0].attn.mechanisms]
    assert names == ["cat", "tisa", "segment"]
    m = model(["absolute", {"name": "segment", "mode": "input"}, "rope"])
    assert [x.name for x in m.input_mechanisms] == ["absolute", "segment"]
    assert [x.name for x in m.blocks[0].attn.mechanisms] == ["rope"]


def test_encoder_attention_paths_agree_after_training_step():
    """A training step (dropout off) moves both paths identically."""
    ref = model(["composite", "diet_abs"], seed=0)
    fast = model(["composite", "diet_abs"], seed=0, path="fast")
    ids = tokens(2, 8)
    for m in (ref, fast):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m.mlm_logits(run(m, ids)).logsumexp(-1).sum().backward()
        opt.step()
    torch.testing.assert_close(run(ref, ids), run(fast, ids), rtol=1e-10, atol=1e-10)


def test_init_std_sets_every_linear_map_and_none_keeps_pytorch_default():
    def linears(init_std):
        torch.manual_seed(0)
        m = Decoder(ModelConfig(vocab_size=50, d_model=64, n_heads=4, n_layers=2, init_std=init_std))
        return [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]

    for lin in linears(0.02):
        assert abs(lin.weight.std().item() - 0.02) < 0.004
        assert lin.bias is None or not lin.bias.any()
    default = linears(None)
    assert default[0].weight.abs().max() > 0.1  # kaiming-uniform bound 1/sqrt(64) = 0.125
    assert any(lin.bias is not None and lin.bias.any() for lin in default)
