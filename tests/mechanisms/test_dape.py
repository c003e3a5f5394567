"""DAPE (Zheng et al. 2024) through the score-transform hook: the scores against loops over
i, j written from the paper's equation, the dense fast path equal to the reference path in
outputs and gradients, causality, and clear errors."""
from __future__ import annotations

import math

import pytest
import torch

from posattn.attention import fast, reference
from posattn.attention.layer import Attention
from posattn.errors import PositionError
from posattn.mechanisms import Dims, build
from posattn.mechanisms.base import Context

from .paths import assert_fast_equals_reference

H, N, DH = 4, 10, 8


def dims(causal: bool = True) -> Dims:
    return Dims(d_model=H * DH, n_heads=H, n_layers=1, max_len=32, n_segments=1, causal=causal)


def ctx(n: int, keep: torch.Tensor | None = None, causal: bool = True) -> Context:
    return Context(torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long), keep, causal)


def dape(bias: object = "alibi", causal: bool = True):
    torch.manual_seed(0)
    return build([{"name": "dape", "bias": bias, "hidden": 5}], dims(causal)).layers[0][0]


@pytest.mark.parametrize("causal", [True, False])
def test_scores_match_the_papers_equation_entry_by_entry(causal: bool) -> None:
    m = dape(causal=causal)
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, H, N, DH, generator=g) for _ in range(2))
    got = reference.scores(q, k, m.score_terms(q, k, ctx(N, causal=causal)))
    slopes = m.inner.slopes
    w1, b1, w2, b2 = m.mlp_in.weight, m.mlp_in.bias, m.mlp_out.weight, m.mlp_out.bias
    for b in range(2):
        for i in range(N):
            for j in range(N):
                logits = torch.stack([q[b, h, i] @ k[b, h, j] / math.sqrt(DH) for h in range(H)])
                bias = -slopes * abs(j - i)  # ALiBi (Press et al. 2022)
                hidden = torch.nn.functional.leaky_relu(w1 @ torch.cat([logits, bias]) + b1)
                want = logits + bias + w2 @ hidden + b2  # Zheng et al. 2024, Eq. 5
                torch.testing.assert_close(got[b, :, i, j], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", ["alibi", {"name": "t5", "num_buckets": 8}])
def test_dense_fast_path_equals_the_reference_in_outputs_and_gradients(bias: object) -> None:
    m = dape(bias)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, H, N, DH, generator=g, requires_grad=True) for _ in range(3))
    keep = torch.ones(2, N, dtype=torch.bool)
    keep[1, :2] = False
    params = list(m.parameters())

    assert_fast_equals_reference(m, lambda: ctx(N, keep), q, k, v, keep, params,
                                 lambda t: fast.attend(q, k, v, t, keep, True))


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_future_tokens_do_not_change_the_past(path: str) -> None:
    torch.manual_seed(0)
    layer = Attention(dims(), [dape()], path=path)
    x = torch.randn(1, N, H * DH)
    y = x.clone()
    y[:, 6:] = torch.randn(1, N - 6, H * DH)
    torch.testing.assert_close(layer(x, ctx(N))[:, :6], layer(y, ctx(N))[:, :6])


def test_bad_options_and_combinations_are_refused() -> None:
    with pytest.raises(PositionError, match="dape: adapts the score bias of another mechanism, and rope adds none"):
        build([{"name": "dape", "bias": "rope"}], dims())
    with pytest.raises(PositionError, match="dape: adapts the score bias of another mechanism, and cope adds none"):
        build([{"name": "dape", "bias": "cope"}], dims())
    with pytest.raises(PositionError, match="dape: bias is a mechanism name or a dict"):
        build([{"name": "dape", "bias": 3}], dims())
    with pytest.raises(PositionError, match="dape: hidden must be a positive integer"):
        build([{"name": "dape", "hidden": 0}], dims())
    with pytest.raises(PositionError, match="dape: bias t5 has unknown option"):
        build([{"name": "dape", "bias": {"name": "t5", "buckets": 3}}], dims())
