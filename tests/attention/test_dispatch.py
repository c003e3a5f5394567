"""Every score-term type of :mod:`posattn.attention.terms` is computed or refused by name on every
fast path: computed ones equal the reference path, refused ones raise one PositionError that
names the term type and the path (never a silently dropped term)."""
from __future__ import annotations

import inspect
import math
from typing import get_args

import pytest
import torch

from posattn.attention import fast, native, reference, terms
from posattn.attention.dispatch import HANDLES, TAKES_DOCUMENTS, Path
from posattn.errors import PositionError

B, H, N, D, W = 2, 2, 24, 8, 3
TERM_TYPES = [c for _, c in inspect.getmembers(terms, inspect.isclass)
              if issubclass(c, terms.Term) and c is not terms.Term and c.__module__ == terms.__name__]


def example(kind: type[terms.Term], seed: int = 0) -> tuple[torch.Tensor, ...] | tuple:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    table = torch.randn(H, 2 * W + 1, generator=g)
    r = torch.arange(-(N - 1), N).clamp(-W, W) + W
    made = {
        terms.Toeplitz: lambda: terms.Toeplitz(table[:, r], window=W),
        terms.LowRank: lambda: terms.LowRank(torch.randn(1, H, N, 3, generator=g),
                                             torch.randn(1, H, N, 3, generator=g)),
        terms.QueryRelative: lambda: terms.QueryRelative(q, torch.randn(2 * W + 1, D, generator=g), W, 0.5),
        terms.Dense: lambda: terms.Dense(torch.randn(B, H, N, N, generator=g)),
        terms.RowNormalised: lambda: terms.RowNormalised(
            torch.log1p(torch.arange(N, dtype=torch.float32)), torch.log1p(torch.arange(N).clamp(min=5).float())[None],
            (torch.randn(H, generator=g),), lambda x, p: torch.sin(x[..., None] * p[0])),
        terms.ScoreTransform: lambda: terms.ScoreTransform(lambda lg, b, ok, rows: 3 * torch.tanh(lg + b)),
        terms.TwoSided: lambda: terms.TwoSided(*(torch.randn(B, H, N, generator=g) for _ in range(4))),
    }
    return q, k, v, made[kind]()


def test_every_term_type_is_listed_and_every_path_declared() -> None:
    assert set(TERM_TYPES) == {terms.Toeplitz, terms.LowRank, terms.QueryRelative, terms.Dense,
                               terms.RowNormalised, terms.ScoreTransform, terms.TwoSided}
    assert set(HANDLES) == set(get_args(Path))


@pytest.mark.parametrize("path", get_args(Path))
@pytest.mark.parametrize("kind", TERM_TYPES, ids=lambda c: c.__name__)
def test_each_term_type_is_computed_or_refused_by_name(path: str, kind: type[terms.Term]) -> None:
    q, k, v, term = example(kind)
    if kind not in HANDLES[path]:
        with pytest.raises(PositionError, match=f"the {path} attention path cannot compute a {kind.__name__}"):
            fast.run(path, q, k, v, [term], None, False)
        return
    if path == "flex":
        pytest.skip("FlexAttention's numbers: tests/attention/test_flex.py (every term type)")
    if path == "fused" and native.kernels() is None:
        pytest.skip("the fused C++ kernels do not build here")
    with torch.no_grad():
        got = fast.run(path, q, k, v, [term], None, False)
        want = reference.attend(q, k, v, [term], None, False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_term_type_no_path_knows_is_refused_on_every_path() -> None:
    class Shifted(terms.Toeplitz):
        """A subclass may mean something else: no path computes it as a Toeplitz term."""

    q, k, v, base = example(terms.Toeplitz)
    term = Shifted(base.table, window=W)
    for path in get_args(Path):
        with pytest.raises(PositionError, match=f"the {path} attention path cannot compute a Shifted"):
            fast.run(path, q, k, v, [term], None, False)


def test_terms_a_path_cannot_take_beyond_their_type_are_refused_by_name() -> None:
    q, k, v, clipped = example(terms.Toeplitz)
    full = terms.Toeplitz(clipped.table)  # no window: nothing for the banded path to exploit
    with pytest.raises(PositionError, match="banded attention path cannot compute a Toeplitz.*window"):
        fast.run("banded", q, k, v, [full], None, False)
    batched = terms.Toeplitz(clipped.table.expand(B, -1, -1), window=W)  # the kernels take [h, 2n − 1]
    with pytest.raises(PositionError, match="fused attention path cannot compute a Toeplitz"):
        fast.run("fused", q, k, v, [batched], None, False)


def test_attend_runs_the_planned_path_with_scale() -> None:
    q, k, v, term = example(terms.QueryRelative)
    with torch.no_grad():
        got = fast.attend(q, k, v, [term], None, True)
        want = reference.attend(q, k, v, [term], None, True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert math.isclose(float(got.abs().sum()), float(want.abs().sum()), rel_tol=1e-5)


def packed(b: int = B, n: int = N) -> torch.Tensor:
    """Document ids [b, n]: row 0 three documents of unequal lengths, row 1 two."""
    docs = torch.zeros(b, n, dtype=torch.long)
    docs[0, 5:] = 1
    docs[0, 14:] = 2
    docs[1, 9:] = 4
    return docs


@pytest.mark.parametrize("path", get_args(Path))
def test_each_path_honours_documents_or_refuses_them(path: str) -> None:
    """Packed rows: a path whose mask hides other documents' keys equals the reference path;
    the others refuse them by name instead of attending across documents."""
    kind = terms.LowRank if path == "sdpa" else terms.Toeplitz
    q, k, v, term = example(kind)
    docs = packed()
    if path not in TAKES_DOCUMENTS:
        with pytest.raises(PositionError, match=f"the {path} attention path cannot hide the keys of another document"):
            fast.run(path, q, k, v, [term], None, False, documents=docs)
        return
    if path == "flex":
        pytest.skip("FlexAttention's numbers: tests/attention/test_flex.py (documents)")
    for causal in (False, True):
        with torch.no_grad():
            got = fast.run(path, q, k, v, [term], None, causal, documents=docs)
            want = reference.attend(q, k, v, [term], None, causal, documents=docs)
            alone = reference.attend(q[:1, :, 5:14], k[:1, :, 5:14], v[:1, :, 5:14],
                                     [kind(*[t[..., 5:14, :] if kind is terms.LowRank else t[:, N - 9:N + 8]
                                             for t in term.tensors()])], None, causal)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(want[:1, :, 5:14], alone, atol=1e-5, rtol=1e-5)  # row 0's second document


@pytest.mark.parametrize("force", [None, *get_args(Path)])
@pytest.mark.parametrize("kind", [terms.Toeplitz, terms.QueryRelative, terms.LowRank, terms.RowNormalised,
                                  terms.ScoreTransform], ids=lambda c: c.__name__)
def test_attend_with_documents_equals_reference_whatever_the_policy(kind: type[terms.Term], force: str | None) -> None:
    """fast.attend plans only paths that take the document mask, whatever the policy forces:
    outputs and gradients equal the reference path, with padding, encoder and decoder."""
    q, k, v, term = example(kind, seed=2)
    q.requires_grad_(True)
    docs = packed()
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, -3:] = False
    policy = fast.Policy(force=force, dense_max_n=4, dense_grad_max_n=4, fused_grad_max_n=4, band_min_n=8)
    for causal in (False, True):
        got = fast.attend(q, k, v, [term], keep, causal, documents=docs, policy=policy)
        assert fast.plan(q, [term], causal, policy=policy, keep=keep, documents=docs) in TAKES_DOCUMENTS
        want = reference.attend(q, k, v, [term], keep, causal, documents=docs)
        w = torch.randn(got.shape, generator=torch.Generator().manual_seed(3)) * keep[:, None, :, None]
        (g_got,) = torch.autograd.grad((got * w).sum(), q)
        (g_want,) = torch.autograd.grad((want * w).sum(), q)
        torch.testing.assert_close(got * keep[:, None, :, None], want * keep[:, None, :, None], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g_got, g_want, atol=1e-5, rtol=1e-5)
