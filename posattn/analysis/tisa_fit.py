"""Fitting TISA scoring functions to positional score profiles by regression (TISA App. C).

TISA's scoring function for one head (Eq 5) is f_θ(r) = Σ_s a_s exp(−|b_s| (r − c_s)²), r = j − i.
Given a score matrix F̂ ``[n, n]`` per head, we fit θ and a free constant o (softmax ignores it,
TISA Fig 6 caption; it is reported and dropped when building a model) by minimising

    L(θ, o) = Σ_r w_r (f_θ(r) + o − t_r)²,   t_r = mean_i F̂[i, i + r],  w_r = (n − |r|) / n²,

over the offsets |r| ≤ window. With the full window this is exactly the mean squared error over
all n² entries of F̂ minus the part no Toeplitz function can explain (Eq 7's RSS / n²).

Optimizer: all heads and ``restarts`` random initialisations are fitted at once as one batch;
targets are standardised per head; b_s = exp(β_s) is optimised in log space; Adam (``adam_steps``,
cosine-decayed learning rate) then L-BFGS (``lbfgs_steps``, strong-Wolfe line search) on the sum
of the per-head losses (the heads are independent, so the sum's minimiser is every head's). The
restart with the lowest loss is kept per head.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from .toeplitz import diagonal_counts, diagonal_means, offset_index


def tisa_function(r: Tensor, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """f(r) = Σ_s a_s exp(−|b_s| (r − c_s)²) (TISA Eq 5); θ ``[..., S]``, r ``[m]`` -> ``[..., m]``."""
    return (a[..., None] * torch.exp(-b.abs()[..., None] * (r - c[..., None]) ** 2)).sum(-2)


@dataclass
class TisaFit:
    """Fitted kernels per head: a, b, c ``[..., S]`` (b ≥ 0), offset ``[...]``, and the fit errors."""

    a: NDArray[np.float64]
    b: NDArray[np.float64]
    c: NDArray[np.float64]
    offset: NDArray[np.float64]
    n: int
    window: int
    rmse: NDArray[np.float64]  # root weighted mean squared error of the profile fit (score units)
    r2: NDArray[np.float64]  # 1 − weighted RSS / weighted TSS of the profile (diagonal means)
    matrix_r2: NDArray[np.float64]  # variance of all n² entries of F̂ explained by f(j − i) + o (all offsets)

    def function(self, r: NDArray[np.float64] | NDArray[np.int64]) -> NDArray[np.float64]:
        """f_θ(r) without the offset, ``[..., len(r)]``."""
        t = torch.as_tensor(np.asarray(r, dtype=np.float64))
        return tisa_function(t, *(torch.as_tensor(x) for x in (self.a, self.b, self.c))).numpy()


def _fit_batch(
    r: Tensor, t: Tensor, w: Tensor, n_kernels: int, restarts: int, adam_steps: int, lbfgs_steps: int, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Fit standardised targets t ``[m, R]`` (weights w ``[R]``); returns a, b, c ``[m, S]``, o, loss ``[m]``."""
    g = torch.Generator().manual_seed(seed)
    m, S, K = t.shape[0], n_kernels, restarts
    span = float(min(r.abs().max(), 16.0))
    shape = (m, K, S)
    c0 = torch.rand(shape, generator=g, dtype=torch.float64) * 2 * span - span
    c0[:, 0] = torch.linspace(-min(S - 1, span), min(S - 1, span), S, dtype=torch.float64) if S > 1 else 0.0
    params = {
        "a": (torch.randn(shape, generator=g, dtype=torch.float64) * 0.5).requires_grad_(),
        "logb": (torch.rand(shape, generator=g, dtype=torch.float64) * np.log(1e3) - np.log(1e3)).requires_grad_(),
        "c": c0.requires_grad_(),
        "o": torch.zeros(m, K, dtype=torch.float64, requires_grad=True),
    }
    tt, ww = t[:, None, :], w[None, None, :]

    def per_fit() -> Tensor:
        f = tisa_function(r, params["a"], params["logb"].exp(), params["c"]) + params["o"][..., None]
        return (ww * (f - tt) ** 2).sum(-1)

    opt = torch.optim.Adam(params.values(), lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(adam_steps, 1))
    for _ in range(adam_steps):
        opt.zero_grad()
        per_fit().sum().backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            params["logb"].clamp_(-12.0, 6.0)
    if lbfgs_steps:
        lbfgs = torch.optim.LBFGS(params.values(), lr=1.0, max_iter=lbfgs_steps, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-12, tolerance_change=1e-15)

        def closure() -> Tensor:
            lbfgs.zero_grad()
            loss = per_fit().sum()
            loss.backward()
            return loss

        lbfgs.step(closure)
    with torch.no_grad():
        loss = per_fit()
        loss = torch.where(torch.isfinite(loss), loss, torch.full_like(loss, float("inf")))
        best = loss.argmin(1)
        pick = lambda x: x[torch.arange(m), best]  # noqa: E731
        return (pick(params["a"]), pick(params["logb"]).exp(), pick(params["c"]), pick(params["o"]),
                pick(loss))


def fit_tisa(
    scores: NDArray[np.float64],
    n_kernels: int = 5,
    window: int | None = None,
    restarts: int = 6,
    adam_steps: int = 400,
    lbfgs_steps: int = 150,
    seed: int = 0,
) -> TisaFit:
    """Fit S = ``n_kernels`` TISA kernels to each ``[n, n]`` matrix of ``scores [..., n, n]`` (App. C)."""
    scores = np.asarray(scores, dtype=np.float64)
    if n_kernels < 1:
        raise ValueError(f"n_kernels must be >= 1, got {n_kernels}")
    n = scores.shape[-1]
    window = n - 1 if window is None else window
    if not 0 <= window <= n - 1:
        raise ValueError(f"window must be in 0 … {n - 1} for {n} positions, got {window}")
    lead = scores.shape[:-2]
    prof = diagonal_means(scores).reshape(-1, 2 * n - 1)[:, n - 1 - window: n + window]
    r = torch.arange(-window, window + 1, dtype=torch.float64)
    w = torch.as_tensor(diagonal_counts(n)[n - 1 - window: n + window] / n**2)
    t = torch.as_tensor(prof)
    wn = w / w.sum()
    mean = (t * wn).sum(-1, keepdim=True)
    std = torch.sqrt((((t - mean) ** 2) * wn).sum(-1, keepdim=True)).clamp(min=1e-12)
    a, b, c, o, _ = _fit_batch(r, (t - mean) / std, w, n_kernels, restarts, adam_steps, lbfgs_steps, seed)
    a, o = a * std, o * std[:, 0] + mean[:, 0]
    fitted = tisa_function(r, a, b, c) + o[:, None]
    rss_prof = ((fitted - t) ** 2 * w).sum(-1)
    tss_prof = ((t - mean) ** 2 * w).sum(-1)
    rmse = torch.sqrt(rss_prof / w.sum())
    r2 = torch.where(tss_prof > 0, 1 - rss_prof / tss_prof.clamp(min=1e-300), torch.ones_like(tss_prof))
    flat = scores.reshape(-1, n, n)
    every = torch.arange(-(n - 1), n, dtype=torch.float64)
    approx = (tisa_function(every, a, b, c) + o[:, None]).numpy()[:, offset_index(n)]
    rss = ((flat - approx) ** 2).sum((-1, -2))
    tss = ((flat - flat.mean((-1, -2), keepdims=True)) ** 2).sum((-1, -2))
    matrix_r2 = np.where(tss > 0, 1 - rss / np.where(tss > 0, tss, 1.0), 1.0)
    shape = lambda x: np.asarray(x).reshape(*lead, *np.asarray(x).shape[1:])  # noqa: E731
    return TisaFit(shape(a.numpy()), shape(b.numpy()), shape(c.numpy()), shape(o.numpy()), n, window,
                   shape(rmse.numpy()), shape(r2.numpy()), shape(matrix_r2))

