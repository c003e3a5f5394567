"""Incremental (cached) decoding: the new query rows of a causal model attend to cached keys.

A decoder that has processed positions 0 … p − 1 keeps, per layer, what the next rows need, in
a cache with transformers' two-method protocol (``update(k, v, layer) -> all k, v`` and
``get_seq_length()``; :class:`KVCache` here, or a transformers ``DynamicCache``). For new
tokens at positions p … n − 1:

- a mechanism whose hooks act on each row given its position (``"rows"``: rope, absolute,
  sinusoidal and every mechanism that only adds score terms) caches the transformed k and v;
  its score terms are built for the whole length n (the context ``ctx_all``) and only their
  rows p … n − 1 are formed (:meth:`Term.rows`), O(n) per new token, never O(n²);
- a mechanism whose q/k/v transform reads earlier rows (``"prefix"``: CAT's causal filters)
  has the raw projections cached and the transform re-applied to the whole history each step
  (O(n·K) for a K-tap filter, still linear);
- anything else (an output transform such as depthwise_conv, a hook that reads the layer input
  x, which the cache does not keep for earlier rows, such as conv_qkv's convolution or a forget
  gate, a mixer) cannot decode incrementally: :func:`blockers` names it, and callers recompute
  the prefix instead.

A mechanism states its mode as ``incremental = "rows" | "prefix"``; one that adds only score
terms needs no statement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from torch import Tensor

from ..mechanisms.base import Context, Mechanism
from .reference import attend_rows

if TYPE_CHECKING:
    from .layer import Attention

Mode = Literal["rows", "prefix"]


class Cache(Protocol):
    def update(self, key: Tensor, value: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]: ...

    def get_seq_length(self) -> int: ...


class KVCache:
    """Per-layer keys and values, appended along the sequence (transformers' cache protocol)."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def update(self, key: Tensor, value: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]:
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], -2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value], -2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0


def mode(m: Mechanism) -> Mode | None:
    """How ``m`` decodes incrementally, or None if it cannot (a mixer never can, nor a mechanism
    whose hooks read the layer input x: the cache holds no x of earlier rows)."""
    if getattr(m, "mixes", False) or getattr(m, "reads_layer_input", False):
        return None
    declared = getattr(m, "incremental", None)
    if declared is not None:
        return declared
    plain = all(getattr(type(m), hook) is getattr(Mechanism, hook) for hook in ("transform_qkv", "transform_output"))
    return "rows" if plain else None


def blockers(mechanisms: list[Mechanism]) -> list[str]:
    """Names of the mechanisms that cannot decode incrementally."""
    return sorted({m.name for m in mechanisms if mode(m) is None})


@dataclass
class Step:
    """What one layer needs to decode new rows: the whole-length context, the cache, its index."""

    ctx_all: Context
    cache: Cache
    layer: int

    def attend(self, attn: Attention, x: Tensor, ctx_new: Context) -> Tensor:
        return step(attn, x, ctx_new, self.ctx_all, self.cache, self.layer)


def step(attn: Attention, x: Tensor, ctx_new: Context, ctx_all: Context, cache: Cache,
         layer_idx: int) -> Tensor:
    """One attention layer on the new rows ``x`` [b, m, d_model]; ``ctx_new`` holds their
    positions, ``ctx_all`` the whole length. Updates ``cache``; returns [b, m, d_model]."""
    b, m, _ = x.shape
    start = ctx_all.n - m
    raw = attn.linear_qkv(x)
    ctx_new.x = x
    if any(mode(mech) == "prefix" for mech in attn.mechanisms):
        qk, v = cache.update(torch.cat([raw[1], raw[0]], -1), raw[2], layer_idx)
        k, q = qk.chunk(2, -1)
        for mech in attn.mechanisms:
            q, k, v = mech.transform_qkv(q, k, v, ctx_all)
        q = q[..., start:, :]
    else:
        q, k, v = raw[0], raw[1], raw[2]
        for mech in attn.mechanisms:
            q, k, v = mech.transform_qkv(q, k, v, ctx_new)
        k, v = cache.update(k, v, layer_idx)
    index = torch.arange(start, ctx_all.n, device=x.device)[None]
    o = attend_rows(q, k, v, attn.terms(q, k, ctx_all), index, None, True)
    return attn.out(o.transpose(1, 2).reshape(b, m, -1))
