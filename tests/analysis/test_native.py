"""The analyses read position structures through the mechanisms' own methods: the same arrays as
the parameters they come from, for every kind, and one clear refusal where there are none."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from posattn.analysis.hf import CheckpointError
from posattn.analysis.native import learned_structures, position_scores, position_table
from posattn.errors import PositionError
from posattn.mechanisms.absolute import sinusoids
from posattn.models.transformer import build_model

N = 12


def tiny(mechanisms: list, kind: str = "encoder") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model({"kind": kind, "vocab_size": 30, "d_model": 16, "n_heads": 2, "n_layers": 2,
                        "max_len": 16, "mechanisms": mechanisms}).eval()


def test_structures_are_the_parameters_they_come_from() -> None:
    model = tiny(["depthwise_conv", "diet_abs", "segment", {"name": "cat", "targets": "qk"}, "t5"])
    items = learned_structures(model, N)
    first = model.blocks[0].attn.mechanisms
    got = {(it["layer"], it["mechanism"]): it for it in items}
    assert [k for k in got if k[0] == 0] == [(0, "depthwise_conv"), (0, "diet_abs"), (0, "segment"), (0, "cat:k"),
                                             (0, "cat:q"), (0, "t5")]
    assert (1, "t5") not in got  # t5 shares its table across layers: shown once
    kinds = {k[1]: it["kind"] for k, it in got.items()}
    assert kinds == {"depthwise_conv": "depthwise", "diet_abs": "matrix", "segment": "segment", "cat:q": "filter",
                     "cat:k": "filter", "t5": "offsets"}
    np.testing.assert_array_equal(got[0, "depthwise_conv"]["data"], first[0].weight.detach().double().numpy())
    pq, pk = first[1].p_q[:, :N].double(), first[1].p_k[:, :N].double()
    np.testing.assert_allclose(got[0, "diet_abs"]["data"], (pq @ pk.transpose(-1, -2)).detach().numpy())
    np.testing.assert_array_equal(got[0, "segment"]["data"], first[2].table.detach().double().numpy())
    np.testing.assert_array_equal(got[0, "cat:k"]["data"], first[3].filters["k"].detach().double().numpy())
    want = first[4].table(N).detach().double().numpy()  # [h, 2N − 1] at offsets −(N−1) … N−1
    np.testing.assert_array_equal(got[0, "t5"]["data"], want)
    assert all(it["data"].dtype == np.float64 and it["data"].flags.c_contiguous for it in items)


def test_a_model_without_learned_structures_gives_none() -> None:
    assert learned_structures(tiny(["rope"], "decoder"), N) == []


def test_position_tables_of_the_input_mechanisms() -> None:
    model = tiny(["absolute"])
    np.testing.assert_array_equal(position_table(model, N).numpy(),
                                  model.input_mechanisms[0].embedding.weight[:N].detach().double().numpy())
    with pytest.raises(PositionError, match="absolute: asked for 20 positions, the absolute table has 16"):
        position_table(model, 20)
    np.testing.assert_array_equal(position_table(tiny(["sinusoidal"]), N).numpy(),
                                  sinusoids(torch.arange(N), 16).double().numpy())
    with pytest.raises(CheckpointError, match="no input position embeddings"):
        position_table(tiny(["t5"]), N)


def test_position_scores_leave_segment_terms_out() -> None:
    with_segments, without = tiny(["t5", "segment"]), tiny(["t5"])
    without.load_state_dict(with_segments.state_dict(), strict=False)
    for a, b in zip(position_scores(with_segments, N), position_scores(without, N)):
        torch.testing.assert_close(a, b)
