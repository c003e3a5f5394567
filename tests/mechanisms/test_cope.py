"""CoPE (Golovneva et al. 2024) through the score-transform hook: equal to x-transformers' CoPE
with the same weights, the contextual positions against loops over i, j and t, the dense fast
path equal to the reference path in outputs and gradients, causality, and clear errors."""
from __future__ import annotations

import math

import pytest
import torch
from x_transformers.x_transformers import CoPE as XCoPE

from posattn.attention import fast, reference
from posattn.attention.layer import Attention
from posattn.attention.masking import allowed_mask
from posattn.errors import PositionError
from posattn.mechanisms import Dims, build
from posattn.mechanisms.base import Context
from posattn.mechanisms.cope import contextual_positions

from .paths import assert_fast_equals_reference

H, N, DH = 2, 12, 8


def dims(causal: bool = True) -> Dims:
    return Dims(d_model=H * DH, n_heads=H, n_layers=1, max_len=32, n_segments=1, causal=causal)


def ctx(n: int, keep: torch.Tensor | None = None, causal: bool = True) -> Context:
    return Context(torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long), keep, causal)


def cope(npos_max: int = 6, causal: bool = True):
    """A CoPE layer with random position vectors (they start at zero: see the test below)."""
    torch.manual_seed(0)
    m = build([{"name": "cope", "npos_max": npos_max}], dims(causal)).layers[0][0]
    with torch.no_grad():
        m.pos_emb.normal_(0.0, DH ** -0.5)
    return m


def test_position_vectors_start_at_zero_as_in_the_paper_and_still_learn() -> None:
    """Golovneva et al. 2024, Appendix B (and x-transformers' CoPE): e = 0 at the start, so the
    layer starts as plain attention; the first gradient reaches e."""
    torch.manual_seed(0)
    m = build([{"name": "cope", "npos_max": 6}], dims()).layers[0][0]
    assert m.pos_emb.shape == (6, DH) and not m.pos_emb.any()
    theirs = XCoPE(dim=DH, heads=H, max_pos=6)
    assert theirs.pos_emb.shape == m.pos_emb.shape and not theirs.pos_emb.any()
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, H, N, DH, generator=g) for _ in range(3))
    got = reference.attend(q, k, v, m.score_terms(q, k, ctx(N)), None, True)
    torch.testing.assert_close(got, reference.attend(q, k, v, [], None, True))
    (grad,) = torch.autograd.grad((got * torch.linspace(-1, 1, DH)).sum(), [m.pos_emb])
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("padded", [False, True])
def test_equals_x_transformers_cope_with_the_same_weights(padded: bool) -> None:
    m = cope()
    theirs = XCoPE(dim=DH, heads=H, max_pos=6)
    theirs.pos_emb.data.copy_(m.pos_emb.data)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, H, N, DH, generator=g) for _ in range(3))
    keep = torch.ones(2, N, dtype=torch.bool)
    keep[1, 3] = keep[1, 7] = False
    keep = keep if padded else None
    ok = allowed_mask(N, keep, True, q.device)
    got = reference.attend(q, k, v, m.score_terms(q, k, ctx(N, keep)), keep, True)
    # x-transformers' Attend: scaled logits, masked with −max, then sim + CoPE(q, sim), softmax
    sim = (q @ k.transpose(-1, -2)) / math.sqrt(DH)
    hidden = ~(torch.ones_like(ok) & (torch.arange(N)[None, None, None] <= torch.arange(N)[:, None]))
    if keep is not None:
        hidden = hidden | ~keep[:, None, None, :]
    sim = sim.masked_fill(hidden, -torch.finfo(sim.dtype).max)
    want = torch.softmax(sim + theirs(q, sim), -1) @ v
    real = torch.ones(2, 1, N, 1) if keep is None else keep[:, None, :, None].float()  # padding queries differ
    torch.testing.assert_close(got * real, want * real, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_contextual_positions_are_the_sum_of_gates_between_key_and_query(causal: bool) -> None:
    g = torch.rand(2, H, N, N, generator=torch.Generator().manual_seed(3))
    rows = torch.arange(N)[None]
    got = contextual_positions(g, rows)
    for b in range(2):
        for h in range(H):
            for i in range(N):
                for j in range(N):
                    if causal and j > i:
                        continue
                    want = sum(float(g[b, h, i, t]) for t in range(min(i, j), max(i, j) + 1))
                    assert abs(float(got[b, h, i, j]) - want) < 1e-5


def test_dense_fast_path_equals_the_reference_in_outputs_and_gradients() -> None:
    m = cope()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, H, N, DH, generator=g, requires_grad=True) for _ in range(3))
    keep = torch.ones(2, N, dtype=torch.bool)
    keep[0, -3:] = False

    assert fast.plan(q, m.score_terms(q, k, ctx(N, keep)), True) == "dense"
    assert_fast_equals_reference(m, lambda: ctx(N, keep), q, k, v, keep, [m.pos_emb],
                                 lambda t: fast.attend(q, k, v, t, keep, True))


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_future_tokens_do_not_change_the_past(path: str) -> None:
    torch.manual_seed(0)
    layer = Attention(dims(), [cope()], path=path)
    x = torch.randn(1, N, H * DH)
    y = x.clone()
    y[:, 8:] = torch.randn(1, N - 8, H * DH)
    torch.testing.assert_close(layer(x, ctx(N))[:, :8], layer(y, ctx(N))[:, :8])


def test_paths_without_written_scores_refuse_it_by_type() -> None:
    m = cope()
    q = torch.randn(1, H, N, DH)
    for path in ("sdpa", "banded", "flash_bias", "fused", "flex"):
        with pytest.raises(PositionError, match=f"the {path} attention path cannot compute a ScoreTransform"):
            fast.run(path, q, q, q, m.score_terms(q, q, ctx(N)), None, True)


def test_bad_options_and_combinations_are_refused() -> None:
    with pytest.raises(PositionError, match="cope: npos_max must be an integer >= 2"):
        build([{"name": "cope", "npos_max": 1}], dims())
    with pytest.raises(PositionError, match="cope and dape both rewrite the attention scores"):
        build(["cope", "alibi", "dape"], dims())
    with pytest.raises(PositionError, match="cope rewrites the attention scores, but convbert replaces"):
        build(["cope", "convbert"], dims(causal=False))
