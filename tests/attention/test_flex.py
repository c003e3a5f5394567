"""FlexAttention (the CUDA path) equals the reference path for every term kind, with padding and
causality, and variable lengths share one compiled kernel per padded length. Runs the forward on
the CPU (FlexAttention compiles there for inference; its backward needs CUDA, see test_cuda.py)."""
from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from posattn.attention import reference
from posattn.attention.fast import _flex_available
from posattn.attention.flex import BLOCK, flex_attend
from posattn.attention.terms import Dense, LowRank, QueryRelative, Term, Toeplitz, TwoSided

pytestmark = pytest.mark.skipif(not _flex_available(), reason="this torch has no FlexAttention")
B, H, D, W = 2, 2, 8, 3


def every_kind(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Term]]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    terms: list[Term] = [
        Toeplitz(torch.randn(H, 2 * n - 1, generator=g)),
        LowRank(torch.randn(1, H, n, 4, generator=g), torch.randn(1, H, n, 4, generator=g)),
        QueryRelative(q, torch.randn(2 * W + 1, D, generator=g), W, 0.5),
        QueryRelative(k, torch.randn(H, 2 * W + 1, D, generator=g), W, 0.5, key_side=True),
        Dense(torch.randn(B, H, n, n, generator=g)),
        TwoSided(*(torch.randn(b, H, n, generator=g) for b in (B, 1, B, 1))),
    ]
    return q, k, v, terms


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, terms: list[Term], keep: torch.Tensor | None,
         causal: bool, documents: torch.Tensor | None = None) -> torch.Tensor:
    low = [t for t in terms if isinstance(t, LowRank)]
    rest = [t for t in terms if not isinstance(t, LowRank)]
    with torch.no_grad():
        return flex_attend(q, k, v, low, rest, keep, causal, 1 / math.sqrt(D), documents)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_flex_equals_reference_below_one_block(causal: bool) -> None:
    n = BLOCK - 28                       # padded up to one block inside flex_attend
    q, k, v, terms = every_kind(n, seed=0)
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[0, n - 9:] = False
    keep[1, 40] = False
    for mask in (keep, None):
        want = reference.attend(q, k, v, terms, mask, causal)
        got = flex(q, k, v, terms, mask, causal)
        real = mask if mask is not None else torch.ones(B, n, dtype=torch.bool)
        err = (got - want).permute(0, 2, 1, 3)[real].abs().max().item()
        assert err < 2e-5, f"mask {'given' if mask is not None else 'none'}: max error {err:.1e}"


def test_lengths_in_one_block_share_one_compiled_kernel() -> None:
    q, k, v, terms = every_kind(BLOCK - 30, seed=1)
    flex(q, k, v, terms, None, False)                 # compiled here (or by an earlier test)
    before = counters["stats"]["unique_graphs"]
    for n in (BLOCK - 31, BLOCK - 64, 5):          # (n = BLOCK itself takes the unmasked kernel)
        q, k, v, terms = every_kind(n, seed=n)
        got = flex(q, k, v, terms, None, False)
        assert torch.allclose(got, reference.attend(q, k, v, terms, None, False), atol=2e-5)
    assert counters["stats"]["unique_graphs"] == before, "a new length recompiled FlexAttention"


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_flex_hides_other_documents_of_packed_rows(causal: bool) -> None:
    n = BLOCK - 28
    q, k, v, terms = every_kind(n, seed=2)
    docs = torch.zeros(B, n, dtype=torch.long)
    docs[0, 30:] = 1
    docs[0, 61:] = 2
    docs[1, 45:] = 1
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[1, n - 5:] = False
    for mask in (keep, None):
        want = reference.attend(q, k, v, terms, mask, causal, documents=docs)
        got = flex(q, k, v, terms, mask, causal, docs)
        real = mask if mask is not None else torch.ones(B, n, dtype=torch.bool)
        err = (got - want).permute(0, 2, 1, 3)[real].abs().max().item()
        assert err < 2e-5, f"mask {'given' if mask is not None else 'none'}: max error {err:.1e}"
    assert (want - reference.attend(q, k, v, terms, None, causal)).abs().max() > 1e-2  # the documents matter


@pytest.mark.parametrize(("shape", "dim", "before", "after", "value"), [
    ((2, 7), -1, 5, 5, 0.0), ((2, 3, 7, 4), -2, 0, 9, 0.0), ((2, 7), -1, 0, 3, False), ((3, 7), -1, 0, 2, -1)])
def test_padding_for_captured_tensors_equals_f_pad(shape, dim, before, after, value) -> None:
    """``score_mod``/``mask_mod`` inputs are padded by a gather (Inductor cannot lower ``F.pad``'s
    masked load inside the fused kernel): the same tensor as ``F.pad``, for floats, masks and ids."""
    import torch.nn.functional as F

    from posattn.attention.flex import _padded
    x = (torch.rand(shape) > 0.5 if isinstance(value, bool) else
         torch.randn(shape) if isinstance(value, float) else torch.randint(0, 5, shape))
    sizes = [0, 0] * (-dim - 1) + [before, after]
    want = F.pad(x, sizes, value=value)
    got = _padded(x, dim, before, after, value)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("learned", [False, True], ids=["fixed", "learned-asymmetric"])
def test_a_toeplitz_formula_is_computed_per_score_and_equals_the_table(learned: bool) -> None:
    """``formulas=True`` (``Policy.flex_formula``): ALiBi's bias computed in ``score_mod`` from its
    closed form equals the reference with its table, and the formula, not the table, is what runs
    (a formula that differs from its table changes the output)."""
    from posattn.mechanisms.alibi import ALiBi
    from posattn.mechanisms.base import Context, Dims

    n = BLOCK - 28
    opts = {"learned": True, "bidirectional": "asymmetric"} if learned else {}
    mech = ALiBi(Dims(d_model=H * D, n_heads=H, n_layers=1, max_len=256, n_segments=1, causal=False), {}, **opts)
    if learned:
        with torch.no_grad():
            mech.log_future.add_(torch.linspace(-1, 1, H))  # future slopes unlike the past ones
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    (term,) = mech.score_terms(q, k, Context(torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long), None, False))
    assert isinstance(term, Toeplitz) and term.formula is not None
    h, r = torch.meshgrid(torch.arange(H), torch.arange(-(n - 1), n), indexing="ij")
    assert torch.equal(term.formula(h, r), term.table)             # the same arithmetic, every entry
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[0, n - 9:] = False
    want = reference.attend(q, k, v, [term], keep, False)
    with torch.no_grad():
        got = flex_attend(q, k, v, [], [term], keep, False, 1 / math.sqrt(D), formulas=True)
        other = Toeplitz(term.table, formula=lambda hh, rr: term.formula(hh, rr) * 2)
        doubled = flex_attend(q, k, v, [], [other], keep, False, 1 / math.sqrt(D), formulas=True)
        table_only = flex_attend(q, k, v, [], [other], keep, False, 1 / math.sqrt(D))
    err = (got - want).permute(0, 2, 1, 3)[keep].abs().max().item()
    assert err < 2e-5, f"max error {err:.1e}"
    assert (doubled - got).abs().max() > 1e-2 and torch.allclose(table_only, got, atol=2e-5)


def test_tma_is_a_kernel_option_and_changes_no_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tma=True`` (``Policy.flex_tma``, the GPU command's A/B arm) hands FlexAttention the kernel
    option ``USE_TMA`` and nothing else; the CPU's kernel ignores it, so the output is the same
    (the CUDA test compares it with the reference in outputs and gradients)."""
    from posattn.attention import flex as flex_module

    real = flex_module._flex()
    options: list[object] = []

    def spy(*args: object, **kw: object) -> torch.Tensor:
        options.append(kw.get("kernel_options"))
        return real(*args, **kw)

    monkeypatch.setitem(flex_module._COMPILED, "flex", spy)
    n = BLOCK - 28
    q, k, v, terms = every_kind(n, 5)
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[1, n - 5:] = False
    low = [t for t in terms if isinstance(t, LowRank)]
    rest = [t for t in terms if not isinstance(t, LowRank)]
    with torch.no_grad():
        plain = flex_attend(q, k, v, low, rest, keep, False, 1 / math.sqrt(D))
        tma = flex_attend(q, k, v, low, rest, keep, False, 1 / math.sqrt(D), tma=True)
    assert options == [None, {"USE_TMA": True}]
    assert torch.equal(plain, tma)


def test_autotune_compiles_flex_attention_apart_with_the_same_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """``autotune=True`` (``Policy.flex_autotune``, the GPU command's A/B arm) runs FlexAttention
    compiled in its own ``torch.compile`` with mode max-autotune-no-cudagraphs, beside the default
    one (an A/B in one process), and gives the default's output."""
    from posattn.attention import flex as flex_module

    modes: list[object] = []
    real_compile = torch.compile

    def spy(fn: object, **kw: object) -> object:
        modes.append(kw.get("mode"))
        return real_compile(fn, **kw)

    monkeypatch.setattr(flex_module, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", spy)
    n = BLOCK - 28
    q, k, v, terms = every_kind(n, 6)
    low = [t for t in terms if isinstance(t, LowRank)]
    rest = [t for t in terms if not isinstance(t, LowRank)]
    with torch.no_grad():
        plain = flex_attend(q, k, v, low, rest, None, True, 1 / math.sqrt(D))
        tuned = flex_attend(q, k, v, low, rest, None, True, 1 / math.sqrt(D), autotune=True)
        again = flex_attend(q, k, v, low, rest, None, True, 1 / math.sqrt(D), autotune=True)
    assert modes == [None, flex_module.AUTOTUNE]   # one compiled function each, kept
    assert torch.allclose(plain, tuned, atol=1e-6) and torch.equal(tuned, again)
