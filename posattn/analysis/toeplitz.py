"""Toeplitzness of square matrices (TISA §3.1 and App. B).

A matrix is Toeplitz when every diagonal is constant: A_ij depends on j − i only. The least-squares
Toeplitz fit A_T of TISA Eq 7 replaces every diagonal by its mean, so
RSS = Σ (A − A_T)² is the within-diagonal sum of squares and R² = 1 − RSS/TSS (Eq 6, TSS Eq 8).
Every function accepts a batch ``[..., n, n]`` (e.g. one matrix per layer and head).
"""
from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray


def _square(a: ArrayLike) -> NDArray[np.float64]:
    arr = np.asarray(a, dtype=np.float64)
    if arr.ndim < 2 or arr.shape[-1] != arr.shape[-2]:
        raise ValueError(f"expected square matrices [..., n, n], got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError("matrix has non-finite entries (inf or nan)")
    return arr


def offset_index(n: int) -> NDArray[np.int64]:
    """[n, n] index r + n − 1 of the offset r = j − i of each entry (0 … 2n − 2)."""
    pos = np.arange(n)
    return pos[None, :] - pos[:, None] + (n - 1)


def diagonal_counts(n: int) -> NDArray[np.float64]:
    """Number of entries on each diagonal r = −(n−1) … n−1: n − |r|."""
    return (n - np.abs(np.arange(-(n - 1), n))).astype(np.float64)


def diagonal_means(a: ArrayLike) -> NDArray[np.float64]:
    """Mean of every diagonal r = j − i = −(n−1) … n−1: the least-squares Toeplitz profile (Eq 7).

    Shape ``[..., n, n]`` -> ``[..., 2n − 1]``; entry ``r + n − 1`` holds offset ``r``.
    """
    arr = _square(a)
    n = arr.shape[-1]
    flat = arr.reshape(-1, n * n)
    idx = offset_index(n).ravel()
    sums = np.stack([np.bincount(idx, weights=row, minlength=2 * n - 1) for row in flat])
    return (sums / diagonal_counts(n)).reshape(*arr.shape[:-2], 2 * n - 1)


def toeplitz_from_profile(profile: ArrayLike) -> NDArray[np.float64]:
    """The Toeplitz matrix with (A_T)_ij = profile[j − i + n − 1]; ``[..., 2n − 1] -> [..., n, n]``."""
    prof = np.asarray(profile, dtype=np.float64)
    n = (prof.shape[-1] + 1) // 2
    if prof.shape[-1] != 2 * n - 1:
        raise ValueError(f"a profile over offsets has odd length 2n − 1, got {prof.shape[-1]}")
    return prof[..., offset_index(n)]


def toeplitz_fit(a: ArrayLike) -> NDArray[np.float64]:
    """The best-fitting Toeplitz matrix A_T of TISA Eq 7 (each diagonal replaced by its mean)."""
    return toeplitz_from_profile(diagonal_means(a))


def toeplitz_r2(a: ArrayLike) -> NDArray[np.float64] | float:
    """Degree of Toeplitzness R² = 1 − RSS/TSS (TISA App. B, Eq 6-8), per matrix of the batch.

    1 for an exactly Toeplitz matrix (a constant matrix counts as Toeplitz: R² = 1);
    near 0 when the diagonals explain none of the variance.
    """
    arr = _square(a)
    rss = ((arr - toeplitz_fit(arr)) ** 2).sum(axis=(-1, -2))
    tss = ((arr - arr.mean(axis=(-1, -2), keepdims=True)) ** 2).sum(axis=(-1, -2))
    scale = np.maximum(np.abs(arr).max(axis=(-1, -2)), 1e-300) ** 2 * arr.shape[-1] ** 2
    flat = tss <= 1e-24 * scale
    r2 = np.where(flat, 1.0, 1.0 - rss / np.where(flat, 1.0, tss))
    return float(r2) if r2.ndim == 0 else r2


def gram(e: ArrayLike) -> NDArray[np.float64]:
    """P = E_P E_Pᵀ of a position-embedding table ``[n, d]`` (TISA §3.1)."""
    arr = np.asarray(e, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"expected a position-embedding table [n, d], got shape {arr.shape}")
    return arr @ arr.T


def adjacent_cosine(e: ArrayLike) -> NDArray[np.float64]:
    """cos(e_i, e_{i+1}) for i = 0 … n − 2: how smoothly the learned positions vary."""
    arr = np.asarray(e, dtype=np.float64)
    norms = np.linalg.norm(arr, axis=-1)
    dots = (arr[:-1] * arr[1:]).sum(-1)
    return dots / np.maximum(norms[:-1] * norms[1:], 1e-300)


def cosine_by_offset(e: ArrayLike) -> NDArray[np.float64]:
    """Mean cosine similarity of e_i and e_{i+r} for r = 0 … n − 1 (the diagonals of the cosine matrix)."""
    arr = np.asarray(e, dtype=np.float64)
    unit = arr / np.maximum(np.linalg.norm(arr, axis=-1, keepdims=True), 1e-300)
    n = arr.shape[0]
    return diagonal_means(unit @ unit.T)[n - 1:]
