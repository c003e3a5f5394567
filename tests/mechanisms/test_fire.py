"""FIRE (Li et al. 2023): the bias against a slow reference written from the paper's formula,
the row-normalised term's fast path (flash-bias blocks) equal to the reference path in outputs
and gradients, causality, and clear errors."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from posattn.attention import fast
from posattn.attention.dispatch import HANDLES
from posattn.attention.terms import RowNormalised
from posattn.errors import PositionError
from posattn.mechanisms import Dims, build
from posattn.mechanisms.base import Context

from .paths import assert_fast_equals_reference

H, N, DH = 3, 40, 8


def dims(causal: bool = True) -> Dims:
    return Dims(d_model=H * DH, n_heads=H, n_layers=1, max_len=64, n_segments=1, causal=causal)


def fire(threshold: float = 6.0, **options: object):
    torch.manual_seed(0)
    m = build([{"name": "fire", "threshold_init": threshold, **options}], dims()).layers[0][0]
    with torch.no_grad():
        m.c.fill_(0.7)
        m.mlp_out.bias.normal_()
    return m


def ctx(n: int) -> Context:
    return Context(torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long), None, True)


def slow_bias(m, n: int, causal: bool = True) -> torch.Tensor:
    """b[h, i, j] = f_θ(ψ(i − j)/ψ(max(L, i))) for j ≤ i, loops over i and j (Li et al. 2023, with
    the listing's ε = 1e-6 in the normaliser); for an encoder (``causal`` False) every j, |i − j|."""
    c, big_l = float(m.c.detach()), abs(float(m.threshold_scale.detach()) * float(m.threshold_init))
    psi = lambda x: math.log(abs(c * x) + 1)  # noqa: E731
    out = torch.zeros(H, n, n, dtype=torch.float64)
    w1, b1 = m.mlp_in.weight[:, 0].detach().double(), m.mlp_in.bias.detach().double()
    w2, b2 = m.mlp_out.weight.detach().double(), m.mlp_out.bias.detach().double()
    for i in range(n):
        for j in range(i + 1 if causal else n):
            x = psi(abs(i - j)) / (psi(max(big_l, i)) + 1e-6)
            out[:, i, j] = w2 @ torch.relu(w1 * x + b1) + b2
    return out


def test_bias_matches_the_papers_formula_and_reads_the_row() -> None:
    m = fire()
    got = m.score_terms(torch.zeros(1, H, N, DH), torch.zeros(1, H, N, DH), ctx(N))[0].dense(N)[0].double()
    want = slow_bias(m, N)
    torch.testing.assert_close(got.tril(), want, atol=1e-5, rtol=1e-5)
    # beyond the threshold the same offset gives different biases in different rows (not Toeplitz)
    assert not torch.allclose(got[:, 20, 10], got[:, 30, 20])
    # below it, rows share one normaliser: the same offset, the same bias
    torch.testing.assert_close(got[:, 5, 2], got[:, 4, 1])


def test_position_ids_set_the_normaliser_and_a_fixed_threshold_stays() -> None:
    m = fire()
    q = torch.zeros(1, H, N, DH)
    base = m.score_terms(q, q, ctx(N))[0].dense(N)
    moved = Context(torch.arange(100, 100 + N)[None], torch.zeros(1, N, dtype=torch.long), None, True)
    assert not torch.allclose(m.score_terms(q, q, moved)[0].dense(N), base)
    fixed = build([{"name": "fire", "learn_threshold": False}], dims()).layers[0][0]
    assert not fixed.threshold_scale.requires_grad and float(fixed.threshold) == 64 / 4


def test_rows_are_the_rows_of_the_dense_term() -> None:
    m = fire()
    t = m.score_terms(torch.zeros(1, H, N, DH), None, ctx(N))[0]
    index = torch.tensor([[0, 7, 39]])
    torch.testing.assert_close(t.rows(index, N), t.dense(N)[:, :, [0, 7, 39]])


@pytest.mark.parametrize("path", ["dense", "flash_bias"])
@pytest.mark.parametrize("padded", [False, True])
def test_fast_paths_equal_the_reference_in_outputs_and_gradients(path: str, padded: bool) -> None:
    m = fire()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, H, N, DH, generator=g, requires_grad=True) for _ in range(3))
    keep = torch.ones(2, N, dtype=torch.bool)
    keep[1, -7:] = False
    keep = keep if padded else None
    params = [p for p in m.parameters() if p.requires_grad]

    policy = fast.Policy(flash_chunk=16, grad_chunk=8)
    assert_fast_equals_reference(m, lambda: ctx(N), q, k, v, keep, params,
                                 lambda t: fast.run(path, q, k, v, t, keep, True, policy=policy), grad_tol=1e-4)


def test_the_planner_builds_long_inputs_in_blocks_and_never_on_a_path_without_code() -> None:
    q = torch.randn(1, H, 1024, DH)
    m = fire()
    terms = m.score_terms(q, q, ctx(1024))
    assert fast.plan(q, terms, True) == "flash_bias"
    assert RowNormalised not in HANDLES["flex"] and RowNormalised not in HANDLES["banded"]


def test_causal_future_tokens_do_not_change_the_past() -> None:
    from posattn.attention.layer import Attention

    torch.manual_seed(0)
    layer = Attention(dims(), [fire()])
    x = torch.randn(1, N, H * DH)
    y = x.clone()
    y[:, 25:] = torch.randn(1, N - 25, H * DH)
    torch.testing.assert_close(layer(x, ctx(N))[:, :25], layer(y, ctx(N))[:, :25])


def test_an_encoder_reads_the_absolute_distance() -> None:
    torch.manual_seed(0)
    m = build([{"name": "fire", "threshold_init": 6.0}], dims(causal=False)).layers[0][0]
    got = m.score_terms(torch.zeros(1, H, N, DH), None, ctx(N))[0].dense(N)[0].double()
    torch.testing.assert_close(got, slow_bias(m, N, causal=False), atol=1e-5, rtol=1e-5)


def test_defaults_are_the_papers_listing() -> None:
    """Li et al. 2023, Appendix listing: mlp_width 32, init_c 0.1, init_L 512 at training length
    2048 (here max_len / 4), eps 1e-6, the threshold's multiplier starting at 1 and learned."""
    from posattn.mechanisms.fire import EPS

    m = build(["fire"], replace(dims(), max_len=2048)).layers[0][0]
    assert m.mlp_in.out_features == 32 and m.mlp_out.in_features == 32
    assert float(m.c) == pytest.approx(0.1) and m.c.requires_grad
    assert float(m.threshold) == 512 and float(m.threshold_scale) == 1.0 and m.threshold_scale.requires_grad
    assert EPS == 1e-6


def test_bad_options_are_refused() -> None:
    for opts, what in [({"hidden": 0}, "hidden"), ({"c_init": -1.0}, "c_init"),
                       ({"threshold_init": -2}, "threshold_init"),
                       ({"learn_threshold": "yes"}, "learn_threshold")]:
        with pytest.raises(PositionError, match=f"fire: {what}"):
            build([{"name": "fire", **opts}], dims())
