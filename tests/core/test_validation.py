"""Bad configurations and inputs raise one clear PositionError naming what was wrong."""
from __future__ import annotations

import pytest
import torch

import posattn
from posattn import Decoder, Encoder, ModelConfig, build_model
from posattn.errors import PositionError
from posattn.models import from_yaml

from .helpers import config, model, tokens


def build(mechanisms, causal=False, **kw):
    return (Decoder if causal else Encoder)(config(mechanisms, **kw))


def test_unknown_mechanism_lists_valid_names():
    with pytest.raises(PositionError) as e:
        build(["rotary"])
    msg = str(e.value)
    assert "'rotary'" in msg
    for name in posattn.names():
        assert name in msg


def test_unknown_option_names_mechanism_and_valid_options():
    with pytest.raises(PositionError, match=r"^tisa: unknown option\(s\) kernels; valid options: n_kernels, mode"):
        build([{"name": "tisa", "kernels": 3}])


def test_absolute_beyond_its_positions_names_the_mechanism():
    m = build(["absolute"], max_len=512)
    with pytest.raises(PositionError, match=r"^absolute: needs 600 positions .* 512 positions"):
        m(torch.zeros(1, 600, dtype=torch.long))
    for name in ("diet_abs", "tupe"):
        with pytest.raises(PositionError, match=rf"^{name}: needs 30 positions .* 20 positions"):
            build([name], max_len=20)(torch.zeros(1, 30, dtype=torch.long))
    # explicit position ids beyond the table are refused the same way
    with pytest.raises(PositionError, match=r"^absolute: needs 25 positions"):
        build(["absolute"], max_len=24)(tokens(1, 5), positions=torch.arange(20, 25)[None])


def test_two_mechanisms_providing_the_same_thing():
    with pytest.raises(PositionError, match=r"absolute and sinusoidal both provide input positions"):
        build(["absolute", "sinusoidal"])


def test_tisa_modes_against_input_positions():
    with pytest.raises(PositionError, match=r"^tisa: mode='replace' .*'absolute'"):
        build(["absolute", {"name": "tisa", "mode": "replace"}])
    with pytest.raises(PositionError, match=r"^tisa: mode='replace'"):
        build(["sinusoidal", "tisa"])  # replace is the default
    with pytest.raises(PositionError, match=r"^tisa: mode='supplement' .*add 'absolute'"):
        build([{"name": "tisa", "mode": "supplement"}])
    with pytest.raises(PositionError, match=r"^tisa: unknown mode"):
        build([{"name": "tisa", "mode": "both"}])
    build(["absolute", {"name": "tisa", "mode": "supplement"}])


def test_mechanism_listed_twice_and_bad_spec():
    with pytest.raises(PositionError, match=r"^cat: listed twice"):
        build(["cat", {"name": "cat", "kernel_size": 5}])
    with pytest.raises(PositionError, match="a mechanism spec is a name or a dict"):
        build([{"kernel_size": 5}])


def test_bad_token_ids():
    m = build(["none"])
    with pytest.raises(PositionError, match=r"token id 37 outside the vocabulary \[0, 37\)"):
        m(torch.tensor([[1, 2, 37]]))
    with pytest.raises(PositionError, match=r"token id -1 outside"):
        m(torch.tensor([[1, -1, 3]]))
    with pytest.raises(PositionError, match="input_ids must be a LongTensor"):
        m(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(PositionError, match="input_ids must be a LongTensor"):
        m(torch.tensor([1, 2]))
    with pytest.raises(PositionError, match="length 0"):
        m(torch.zeros(1, 0, dtype=torch.long))


def test_bad_mask_segments_and_positions():
    m = build(["segment"])
    ids = tokens(2, 6)
    with pytest.raises(PositionError, match=r"attention_mask has shape \(2, 5\), expected \(2, 6\)"):
        m(ids, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(PositionError, match="segment_ids must be a non-negative LongTensor"):
        m(ids, segment_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(PositionError, match="segment_ids must be a non-negative LongTensor"):
        m(ids, segment_ids=-torch.ones(2, 6, dtype=torch.long))
    with pytest.raises(PositionError, match=r"^segment: segment id 3 but the model has n_segments = 3"):
        m(ids, segment_ids=torch.full((2, 6), 3))
    with pytest.raises(PositionError, match="positions has shape"):
        m(ids, positions=torch.arange(5)[None])
    with pytest.raises(PositionError, match="positions must be a non-negative LongTensor"):
        build(["sinusoidal"])(ids, positions=torch.arange(-1, 5).expand(2, 6))
    with pytest.raises(PositionError, match="positions must be a non-negative LongTensor"):
        build(["rope"])(ids, positions=torch.arange(6.0).expand(2, 6))


def test_model_config_errors():
    with pytest.raises(PositionError, match="d_model 30 is not divisible by n_heads 4"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(PositionError, match=r"ModelConfig.n_layers must be >= 1"):
        ModelConfig(n_layers=0)
    with pytest.raises(PositionError, match=r"unknown field\(s\) heads"):
        build_model({"kind": "encoder", "heads": 4})
    with pytest.raises(PositionError, match="model kind must be one of encoder, decoder"):
        build_model({"d_model": 16})


def test_bad_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: encoder\nmechanisms: [cat, tisa\n")
    with pytest.raises(PositionError, match="bad.yaml"):
        from_yaml(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- cat\n- tisa\n")
    with pytest.raises(PositionError, match="must be a mapping"):
        from_yaml(lst)
    typo = tmp_path / "typo.yaml"
    typo.write_text("kind: encoder\nd_model: 16\nn_heads: 2\nmechanisms: [cat, tisaa]\n")
    with pytest.raises(PositionError, match="unknown mechanism 'tisaa'"):
        from_yaml(typo)


@pytest.mark.parametrize("spec,match", [
    ({"name": "rope", "scaling": "ntkk"}, r"^rope: unknown scaling"),
    ({"name": "rope", "factor": 0.5}, r"^rope: scaling factor must be >= 1"),
    ({"name": "fixed_conv", "kernel_size": 4}, r"^fixed_conv: kernel_size must be a positive odd"),
    ({"name": "dynamic_conv", "kernel_size": 0}, r"^dynamic_conv: kernel_size"),
    ({"name": "depthwise_conv", "kernel_size": 4}, r"^depthwise_conv: a centered filter needs an odd"),
    ({"name": "cat", "kernel_size": 4}, r"^cat: a centered filter needs an odd"),
    ({"name": "cat", "targets": "qx"}, r"^cat: targets must be letters from 'qkv'"),
    ({"name": "conv_qkv", "targets": ""}, r"^conv_qkv: targets"),
    ({"name": "conv_qkv", "fraction": 0.1}, r"^conv_qkv: fraction 0.1 of 4 heads"),
    ({"name": "tisa", "n_kernels": 0}, r"^tisa: n_kernels must be >= 1"),
    ({"name": "diet_abs", "sharing": "all"}, r"^diet_abs: unknown sharing"),
    ({"name": "segment", "mode": "both"}, r"^segment: unknown mode"),
    ({"name": "t5", "num_buckets": 2}, r"^t5: need num_buckets >= 4"),
])
def test_bad_options(spec, match):
    with pytest.raises(PositionError, match=match):
        build([spec])


def test_decoder_specific_refusals():
    with pytest.raises(PositionError, match=r"^t5: bidirectional buckets in a causal decoder"):
        build([{"name": "t5", "bidirectional": True}], causal=True)
    with pytest.raises(PositionError, match=r"^rope: head dimension must be even"):
        build(["rope"], d_model=12, n_heads=4)
    with pytest.raises(PositionError, match="n_segments = 0"):
        build(["segment"], n_segments=0)


def test_classify_without_classes():
    m = model(["none"])
    with pytest.raises(PositionError, match="n_classes = 0"):
        m.classify(tokens(1, 4))


def test_unknown_attention_path():
    with pytest.raises(PositionError, match="unknown attention path 'flash'"):
        build(["none"], attn_path="flash")
