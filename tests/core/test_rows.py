"""The last layer computes only the rows a loss reads (``hidden(..., scored=mask)``), and gives
the same rows, with the same gradients, as the whole computation, for every mechanism."""
from __future__ import annotations

import pytest
import torch

from posattn import PositionError
from posattn.attention import reference
from posattn.attention.decode import blockers
from posattn.attention.terms import Dense, LowRank, QueryRelative, Toeplitz

from .helpers import NAMES, VARIANTS, model, segments_for, skip_encoder_only, spec_id, tokens


def scattered(b: int, n: int) -> torch.Tensor:
    """A different number of scored rows per batch row (one row with none at all)."""
    scored = torch.rand(b, n, generator=torch.Generator().manual_seed(3)) < 0.3
    scored[0, -1] = scored[1, 0] = True
    scored[2] = False
    return scored


def test_term_rows_at_any_positions_are_rows_of_the_dense_term():
    g = torch.Generator().manual_seed(0)
    n = 9
    q = torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64)
    index = torch.tensor([[0, 4, 8], [2, 3, 7]])
    terms = [Toeplitz(torch.randn(3, 2 * n - 1, generator=g, dtype=torch.float64)),
             LowRank(torch.randn(1, 3, n, 2, generator=g, dtype=torch.float64),
                     torch.randn(1, 3, n, 2, generator=g, dtype=torch.float64)),
             QueryRelative(q, torch.randn(5, 5, generator=g, dtype=torch.float64), 2, 0.5),
             QueryRelative(q, torch.randn(3, 5, 5, generator=g, dtype=torch.float64), 2, 0.5, key_side=True),
             Dense(torch.randn(2, 3, n, n, generator=g, dtype=torch.float64))]
    for t in terms:
        want = torch.stack([t.dense(n).expand(2, 3, n, n)[i][:, index[i]] for i in range(2)])
        torch.testing.assert_close(t.rows(index, n), want)
    chosen = torch.stack([q[i][:, index[i]] for i in range(2)])  # q of the chosen rows only
    torch.testing.assert_close(QueryRelative(chosen, terms[2].weight, 2, 0.5).rows(index, n),
                               torch.stack([terms[2].dense(n)[i][:, index[i]] for i in range(2)]))


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("spec", [[n] for n in NAMES] + VARIANTS, ids=spec_id)
def test_scored_rows_equal_the_whole_computation(spec, causal, monkeypatch):
    for one in spec:
        skip_encoder_only(one, causal)
    m = model(spec, causal=causal).train()  # dropout is 0: train mode keeps autograd honest
    b, n = 3, 11
    ids, scored = tokens(b, n), scattered(b, n)
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[1, 8:] = False  # padding
    args = (ids, None if causal else segments_for(ids), keep)
    calls = []
    attend_rows = reference.attend_rows
    monkeypatch.setattr(reference, "attend_rows", lambda *a, **k: calls.append(1) or attend_rows(*a, **k))

    part = m.hidden(*args, scored=scored)
    full = m.hidden(*args)[scored]
    torch.testing.assert_close(part, full, rtol=1e-9, atol=1e-9)
    weights = torch.randn(part.shape, generator=torch.Generator().manual_seed(1), dtype=part.dtype)
    grads = [torch.autograd.grad((out * weights).sum(), list(m.parameters()), allow_unused=True)
             for out in (part, m.hidden(*args)[scored])]
    for a, b_ in zip(*grads):
        assert (a is None) == (b_ is None)
        if a is not None:
            torch.testing.assert_close(a, b_, rtol=1e-8, atol=1e-9)
    # the last layer took the m×n path unless a mechanism of it cannot build terms for chosen rows
    assert bool(calls) == (not blockers(list(m.blocks[-1].attn.mechanisms)))


def test_scored_must_match_the_inputs():
    m = model(["rope"], causal=True)
    with pytest.raises(PositionError, match="scored must be a bool tensor of the inputs' shape"):
        m.hidden(tokens(2, 5), scored=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(PositionError, match="scored must be a bool tensor"):
        m(tokens(2, 5), scored=torch.ones(2, 5, dtype=torch.long))
    assert m(tokens(2, 5), scored=torch.zeros(2, 5, dtype=torch.bool)).shape == (0, m.cfg.vocab_size)
