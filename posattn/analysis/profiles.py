"""Positional score profiles F̂_P (TISA §3.2 and App. C, Eq 9-12).

TISA replaces every row of the word-embedding matrix E_W by the vocabulary-mean embedding w̄ and
reads the resulting pre-softmax scores as the average effect of position on attention. For a
Hugging Face BERT-family checkpoint we compute, per layer l and head h (``method="embedding"``)::

    e_i   = w̄ + t₀ + p_i                    (t₀: token-type-0 embedding, BERT adds it; p_i: row i of E_P)
    x_i   = LN(e_i)                          (the embedding layer norm, γ, β, ε from the checkpoint)
    q_i   = x_i W_Q^{l,h} + b_Q^{l,h},   k_j = x_j W_K^{l,h} + b_K^{l,h}
    F̂_P[l, h, i, j] = q_i·k_j / √d_h  (+ MPNet's relative attention bias B_h[j − i])

This is exact for layer 0 (it is what the first attention layer computes for a sequence whose every
token is the mean word); for deeper layers it applies layer l's projections to the embedding-level
input, as TISA App. C does. ``method="forward"`` instead propagates the mean-word sequence through
the whole network (``posattn[hf]`` needed) and reads each layer's real scores.

With ``layer_norm=False`` the literal Eq 11-12 is returned (x_i = w̄ + t₀ + p_i, no norm) minus the
position-independent word-word term q̄·k̄/√d_h (q̄ = (w̄ + t₀) W_Q + b_Q). With the norm the word and
position terms no longer separate, so the whole score is returned; every variant differs from Eq 12
only in ways that do not depend on position, or by the norm itself. Softmax ignores a constant offset.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from .hf import HFCheckpoint
from .toeplitz import diagonal_means, toeplitz_r2

Method = str  # "embedding" | "forward"


@dataclass
class Profiles:
    """F̂_P ``[L, H, n, n]`` of one model, with how it was computed."""

    scores: NDArray[np.float64]
    source: str
    method: str
    layer_norm: bool
    relative_bias: bool

    @property
    def n(self) -> int:
        return int(self.scores.shape[-1])

    def offset_profiles(self) -> NDArray[np.float64]:
        """Diagonal means ``[L, H, 2n − 1]`` (entry r + n − 1 is the mean of F̂_P[i, i + r])."""
        return diagonal_means(self.scores)

    def r2(self) -> NDArray[np.float64]:
        """Toeplitz R² per layer and head ``[L, H]`` (TISA App. B)."""
        return np.asarray(toeplitz_r2(self.scores))


def _layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, eps: float) -> Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * gamma + beta


def _heads(x: Tensor, h: int) -> Tensor:
    """[n, d] -> [h, n, d/h]."""
    return x.view(x.shape[0], h, -1).transpose(0, 1)


def mean_word_inputs(ckpt: HFCheckpoint, n: int, layer_norm: bool = True) -> tuple[Tensor, Tensor]:
    """(x ``[n, d]``, m ``[d]``): the attention input of the mean-word sequence, and the input of the
    position-free mean word (only used without the norm, for the Eq 12 constant)."""
    w_bar, t0 = ckpt.embedding_inputs()
    m = w_bar + t0
    x = m + ckpt.position_embeddings(n)
    if layer_norm:
        x = _layer_norm(x, *ckpt.embedding_norm())
    proj = ckpt.embedding_projection()
    if proj is not None:
        x, m = x @ proj[0].T + proj[1], m @ proj[0].T + proj[1]
    return x, m


def hf_profiles(
    ckpt: HFCheckpoint,
    n: int | None = None,
    layers: list[int] | None = None,
    layer_norm: bool = True,
    relative_bias: bool = True,
    method: Method = "embedding",
) -> Profiles:
    """F̂_P of a Hugging Face checkpoint (see the module docstring for exactly what is computed)."""
    n = n or ckpt.position_embeddings().shape[0]
    layers = list(range(ckpt.n_layers)) if layers is None else layers
    h, dh = ckpt.n_heads, ckpt.head_dim
    bias = ckpt.relative_bias(n) if relative_bias else None
    if method == "forward":
        if not layer_norm:
            raise ValueError("method 'forward' runs the real network, which always applies its layer norm")
        from .hf_forward import hf_scores

        w_bar, _ = ckpt.embedding_inputs()
        every = hf_scores(ckpt, inputs_embeds=w_bar.expand(1, n, -1))
        scores = torch.stack([every[layer][0] for layer in layers])
        built_in = ckpt.relative_bias(n)
        if built_in is not None and not relative_bias:
            scores = scores - built_in
    elif method == "embedding":
        x, m = mean_word_inputs(ckpt, n, layer_norm)
        out = []
        for layer in layers:
            wq, bq, wk, bk = ckpt.query_key(layer)
            q, k = _heads(x @ wq + bq, h), _heads(x @ wk + bk, h)
            s = q @ k.transpose(-1, -2) / math.sqrt(dh)
            if not layer_norm:
                q_bar, k_bar = (m @ wq + bq).view(h, dh), (m @ wk + bk).view(h, dh)
                s = s - ((q_bar * k_bar).sum(-1) / math.sqrt(dh))[:, None, None]
            out.append(s if bias is None else s + bias)
        scores = torch.stack(out)
    else:
        raise ValueError(f"unknown method {method!r}; use 'embedding' or 'forward'")
    return Profiles(scores.numpy(), str(ckpt.folder), method, layer_norm, bias is not None)
