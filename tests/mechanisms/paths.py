"""The reference-vs-fast check of one layer mechanism's score terms: outputs and the gradients of
q, k, v and the mechanism's parameters through ``reference.attend`` and through a fast path; and
the causality and cached-decoding check of a decoder built with one mechanism."""
from __future__ import annotations

from collections.abc import Callable

import torch
from core.helpers import run, tokens

from posattn.attention import reference
from posattn.attention.decode import KVCache
from posattn.attention.layer import Attention


def outputs_and_grads(m, make_ctx: Callable, q, k, v, params,
                      attend: Callable) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``attend(terms)`` on ``m``'s score terms in a fresh context (a context caches the tables it
    builds), and the gradients of a fixed weighting of its output."""
    o = attend(m.score_terms(q, k, make_ctx()))
    return o, torch.autograd.grad((o * torch.linspace(-1, 1, q.shape[-1])).sum(), [q, k, v, *params])


def assert_fast_equals_reference(m, make_ctx: Callable, q, k, v, keep, params, fast_attend: Callable,
                                 grad_tol: float = 1e-5, causal: bool = True) -> None:
    """``fast_attend(terms)`` gives the reference path's output (1e-5) and gradients (``grad_tol``)."""
    want_o, want_g = outputs_and_grads(m, make_ctx, q, k, v, params,
                                       lambda t: reference.attend(q, k, v, t, keep, causal))
    got_o, got_g = outputs_and_grads(m, make_ctx, q, k, v, params, fast_attend)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, atol=grad_tol, rtol=grad_tol)


def assert_causal_and_decodes_as_recompute(m, paths: tuple[str, ...] = ("reference", "fast")) -> None:
    """Decoder ``m`` on each attention path: changing token 6 leaves outputs 0-5 exactly as they
    were and changes a later one; decoding a 4-token prompt then one token at a time from a
    key/value cache gives the outputs of the whole sequence (1e-9)."""
    ids = tokens(2, 11, seed=1)
    other = ids.clone()
    other[:, 6] = (other[:, 6] + 1) % 30
    for path in paths:
        for mod in m.modules():
            if isinstance(mod, Attention):
                mod.path = path
        a, b = run(m, ids), run(m, other)
        torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
        assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-6
    with torch.no_grad():
        full = m(ids)
        cache = KVCache()
        parts = [m.decode(ids[:, :4], cache)] + [m.decode(ids[:, t:t + 1], cache) for t in range(4, 11)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)
