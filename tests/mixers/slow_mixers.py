"""Loop-by-loop formulas for the mixers, written from the papers (ConvBERT/HF, Linformer Eq 7,
DIET Eq 4, linear attention, Landmark CAT); nothing here calls posattn's mixer code.

:func:`slow_mixer_layer` reads a built :class:`posattn.attention.layer.Attention` whose one
mechanism is a mixer and recomputes its output; tests/core's slow-formula test uses it for the
mixers (``COVERED``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from core.slow import cat_filters, conv_along, merge, project_qkv  # tests/ is on sys.path (pytest's rootdir layout)
from torch import Tensor

COVERED = {"convbert", "linformer", "diet_abs_lin", "lincat", "landmark_cat"}


def _allowed(keep: Tensor | None, bi: int, j: int) -> bool:
    return keep is None or bool(keep[bi, j])


def convbert(mech, q, k, v, x, keep, causal) -> Tensor:
    b, H, n, dh = q.shape
    d, half, heads, K = H * dh, mech.half, mech.heads, mech.kernel_size
    flat = [merge(t) for t in (q, k, v)]
    hs = half // heads
    qa, ka, va, u = flat[0][..., :half], flat[1][..., :half], flat[2][..., :half], flat[2][..., half:]
    key_conv = conv_along(x, mech.depthwise, causal, keep) @ mech.pointwise.weight.T + mech.pointwise.bias
    left = K - 1 if causal else (K - 1) // 2
    out = torch.zeros(b, n, d, dtype=q.dtype)
    for bi in range(b):
        for i in range(n):
            for h in range(heads):
                sl = slice(h * hs, (h + 1) * hs)
                row = [(qa[bi, i, sl] @ ka[bi, j, sl]) / math.sqrt(hs)
                       if (i == j or ((not causal or j <= i) and _allowed(keep, bi, j))) else torch.tensor(-math.inf)
                       for j in range(n)]
                p = torch.softmax(torch.stack(row), 0)
                out[bi, i, sl] = sum(p[j] * va[bi, j, sl] for j in range(n))
            logits = (key_conv[bi, i] * qa[bi, i]) @ mech.span_kernel.weight.T + mech.span_kernel.bias
            for h in range(heads):
                kappa = torch.softmax(logits[h * K:(h + 1) * K], 0)
                for m in range(K):
                    s = i + m - left
                    if 0 <= s < n and _allowed(keep, bi, s):
                        sl = slice(h * hs, (h + 1) * hs)
                        out[bi, i, half + h * hs: half + (h + 1) * hs] += kappa[m] * u[bi, s, sl]
    return out


def linformer(mech, q, k, v, keep, positions) -> Tensor:
    b, H, n, dh = q.shape
    out = torch.zeros_like(q)
    f = mech.e if mech.f is None else mech.f
    for bi in range(b):
        for h in range(H):
            hp = 0 if mech.e.shape[0] == 1 else h
            kp = [sum(mech.e[hp, c, positions[bi, j]] * k[bi, h, j] for j in range(n) if _allowed(keep, bi, j))
                  for c in range(mech.k)]
            vp = [sum(f[hp, c, positions[bi, j]] * v[bi, h, j] for j in range(n) if _allowed(keep, bi, j))
                  for c in range(mech.k)]
            for i in range(n):
                row = []
                for c in range(mech.k):
                    s = q[bi, h, i] @ kp[c] / math.sqrt(dh)
                    if mech.name == "diet_abs_lin":
                        s = s + mech.p_q[h, positions[bi, i]] @ mech.p_k[h, c]
                    row.append(s)
                p = torch.softmax(torch.stack(row), 0)
                out[bi, h, i] = sum(p[c] * vp[c] for c in range(mech.k))
    return out


def lincat(q, k, v, keep, causal) -> Tensor:
    b, H, n, _ = q.shape
    out = torch.zeros_like(v)
    for bi in range(b):
        for h in range(H):
            for i in range(n):
                num, den = 0.0, 0.0
                for j in range(n):
                    if _allowed(keep, bi, j) and (not causal or j <= i):
                        a = (F.elu(q[bi, h, i]) + 1) @ (F.elu(k[bi, h, j]) + 1)
                        num, den = num + a * v[bi, h, j], den + a
                out[bi, h, i] = num / den if isinstance(den, Tensor) else 0.0
    return out


def landmark_cat(mech, q, k, v, keep, causal, positions) -> Tensor:
    b, H, n, dh = q.shape
    B, w = mech.block, mech.landmark
    out = torch.zeros_like(v)
    for bi in range(b):
        block = [int(positions[bi, j]) // B for j in range(n)]
        real = [_allowed(keep, bi, j) for j in range(n)]
        blocks = sorted(set(block))
        for h in range(H):
            land = {c: sum(w[int(positions[bi, j]) % B] * k[bi, h, j] for j in range(n) if block[j] == c and real[j])
                    for c in blocks}
            for i in range(n):
                cands = [c for c in blocks if (c < block[i] if causal else c != block[i])
                         and any(real[j] for j in range(n) if block[j] == c)]
                score = {c: q[bi, h, i] @ land[c] / math.sqrt(dh) for c in cands}
                chosen = sorted(cands, key=lambda c: -float(score[c].detach()))[: mech.top_k]
                keys, logits = [], []
                for j in range(n):
                    own = block[j] == block[i] and (not causal or j <= i) and real[j]
                    picked = block[j] in chosen and real[j]
                    if own or picked or j == i:
                        s = q[bi, h, i] @ k[bi, h, j] / math.sqrt(dh)
                        if picked and mech.selection == "soft":
                            s = s + score[block[j]]
                        keys.append(j)
                        logits.append(s)
                p = torch.softmax(torch.stack(logits), 0)
                out[bi, h, i] = sum(p[t] * v[bi, h, j] for t, j in enumerate(keys))
    return out


def slow_mixer_layer(attn, x: Tensor, keep: Tensor | None, causal: bool, positions: Tensor) -> Tensor:
    """The layer's output [b, n, d_model] for a layer whose one mechanism is a mixer."""
    (mech,) = attn.mechanisms
    q, k, v = project_qkv(attn, x)
    if mech.name in ("lincat", "landmark_cat"):  # CAT's filters first
        q, k, v = cat_filters(mech, q, k, v, causal, keep)
    if mech.name == "convbert":
        merged = convbert(mech, q, k, v, x, keep, causal)
    else:
        if mech.name in ("linformer", "diet_abs_lin"):
            o = linformer(mech, q, k, v, keep, positions)
        elif mech.name == "lincat":
            o = lincat(q, k, v, keep, causal)
        else:
            o = landmark_cat(mech, q, k, v, keep, causal, positions)
        merged = merge(o)
    return merged @ attn.out.weight.T + attn.out.bias
