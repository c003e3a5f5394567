"""Numerical rank of attention score matrices (DIET Theorem 1, Fig 2 and Fig 8).

Theorem 1: with position embeddings added at the input, A_a = (X + P) W_Q W_Kᵀ (X + P)ᵀ has
rank ≤ d_h for every X, P, W_Q, W_K (Q = (X + P) W_Q has d_h columns; a bias on q or k does not
change that). With a per-head term, A_r = X W_Q W_Kᵀ Xᵀ + P̂ P̂ᵀ can reach rank d_h + d_p.
"""
from __future__ import annotations

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray


def singular_values(a: ArrayLike) -> NDArray[np.float64]:
    """Singular values ``[..., min(m, n)]`` in descending order, computed in float64."""
    return torch.linalg.svdvals(torch.as_tensor(np.asarray(a, dtype=np.float64))).numpy()


def numerical_rank(a: ArrayLike, rtol: float | None = None) -> NDArray[np.int64] | int:
    """Number of singular values above rtol·σ_max per matrix of ``[..., m, n]``.

    Default rtol = max(m, n)·ε(float64), NumPy's ``matrix_rank`` rule: the exact rank of matrices
    computed in float64 (every analysis computes scores in float64).
    """
    arr = np.asarray(a, dtype=np.float64)
    sv = singular_values(arr)
    rtol = max(arr.shape[-2:]) * np.finfo(np.float64).eps if rtol is None else rtol
    ranks = (sv > rtol * sv[..., :1]).sum(-1)
    return int(ranks) if ranks.ndim == 0 else ranks


def theorem1_construction(n: int, d: int, d_h: int, d_p: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(A_a, A_r) from the proof of DIET Theorem 1 (App. B): W_Q = W_K = [I_{d_h}; 0], X = [I_d; 0],
    P̂ with identity in its last d_p rows; A_a uses a random input embedding P.

    rank(A_a) ≤ d_h and rank(A_r) = min(d_h + d_p, n) when d_h + d_p ≤ n and d_h < d.
    """
    if not (d_h < d <= n and d_h + d_p <= n):
        raise ValueError("the construction needs d_h < d <= n and d_h + d_p <= n, "
                         f"got n={n}, d={d}, d_h={d_h}, d_p={d_p}")
    w = np.zeros((d, d_h))
    w[:d_h] = np.eye(d_h)
    x = np.zeros((n, d))
    x[:d] = np.eye(d)
    p_hat = np.zeros((n, d_p))
    p_hat[n - d_p:] = np.eye(d_p)
    p = np.random.default_rng(0).standard_normal((n, d))
    a_a = (x + p) @ w @ w.T @ (x + p).T
    a_r = x @ w @ w.T @ x.T + p_hat @ p_hat.T
    return a_a, a_r
