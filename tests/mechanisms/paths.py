"""The reference-vs-fast check of one layer mechanism's score terms: outputs and the gradients of
q, k, v and the mechanism's parameters through ``reference.attend`` and through a fast path."""
from __future__ import annotations

from collections.abc import Callable

import torch

from posattn.attention import reference


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
