"""An independent, loop-by-loop attention layer written from the spec's formulas (SPEC.md table,
Chang Eq 4-7, TISA Eq 5, DIET Eq 1-3, Raffel's buckets, Press's ALiBi, Su's RoPE, Ke's TUPE, CAT,
Chi's KERPLE and Sandwich, SwinV2's dynamic position bias, the Forgetting Transformer's gates, Sun's
xPos, Dai's Transformer-XL, He's DeBERTa).

It reads the parameters of a built :class:`posattn.attention.layer.Attention` and recomputes the
layer's output with plain Python loops over heads, queries and keys; nothing here calls posattn's
term or path code.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

# Mechanisms this module has a formula for; a newly registered mechanism fails the coverage test
# until its formula is written here.
COVERED = {"none", "rope", "alibi", "t5", "fixed_conv", "dynamic_conv", "key_dynamic_conv", "composite",
           "depthwise_conv", "conv_qkv", "cat", "tisa", "diet_abs", "diet_rel", "segment", "tupe",
           "kerple", "sandwich", "dynamic_pos_bias", "forgetting", "fire", "cope", "dape", "xpos",
           "transformer_xl", "deberta"}


def t5_bucket_ref(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """Raffel et al. 2020 (mesh_tensorflow ``_relative_position_bucket``), rel = j − i."""
    ret = 0
    n = -rel
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0) * num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                          * (num_buckets - max_exact))
    return ret + min(val, num_buckets - 1)


def clip(r: int, k: int) -> int:
    return max(-k, min(k, r))


def conv_along(x: Tensor, w: Tensor, causal: bool, keep: Tensor | None) -> Tensor:
    """y[b, t, c] = Σ_m w[c, m] x[b, t + m − left, c]; zero outside and at padding.
    ``w`` is [C, K] or [K] (one filter for every channel)."""
    b, n, c = x.shape
    K = w.shape[-1]
    left = K - 1 if causal else (K - 1) // 2
    if keep is not None:
        x = x * keep[..., None].to(x.dtype)
    y = torch.zeros_like(x)
    for t in range(n):
        for m in range(K):
            s = t + m - left
            if 0 <= s < n:
                wm = w[m] if w.dim() == 1 else w[:, m]
                y[:, t, :] = y[:, t, :] + wm * x[:, s, :]
    return y


def mlp_ref(layers, v: list[float]) -> list[float]:
    """An MLP of Linear / LayerNorm / SiLU modules applied to the vector v, written out."""
    for layer in layers:
        kind = type(layer).__name__
        if kind == "Linear":
            W, b = layer.weight.tolist(), layer.bias.tolist()
            v = [sum(W[o][c] * v[c] for c in range(len(v))) + b[o] for o in range(len(W))]
        elif kind == "LayerNorm":
            mean = sum(v) / len(v)
            var = sum((a - mean) ** 2 for a in v) / len(v)
            w, b = layer.weight.tolist(), layer.bias.tolist()
            v = [(a - mean) / math.sqrt(var + layer.eps) * w[c] + b[c] for c, a in enumerate(v)]
        else:
            assert kind == "SiLU", kind
            v = [a / (1 + math.exp(-a)) for a in v]
    return v


def forget_bias(mech, x: Tensor, bidx: int, h: int, i: int, j: int) -> Tensor | float:
    """Lin et al. 2025: Σ_{t=j+1..i} log σ(w_h·x_t + b_h) for j ≤ i; in an encoder the second
    gates' Σ_{t=i+1..j} log σ(w'_h·x_t + b'_h) for j > i."""
    H = mech.dims.n_heads
    lo, hi, gate = (j + 1, i, h) if j <= i else (i + 1, j, h + H)
    total = 0.0
    for t in range(lo, hi + 1):
        z = x[bidx, t] @ mech.gates.weight[gate] + mech.gates.bias[gate]
        total = total + torch.log(torch.sigmoid(z)) * mech.post_log_scale
    return total


def position_bias(mech, name: str, h: int, i: int, j: int, q: Tensor, k: Tensor, bidx: int,
                  segments: Tensor, dh: int, causal: bool, n: int, positions: Tensor,
                  x: Tensor | None = None) -> Tensor | float:
    """The additive score term of one mechanism for head h, query i, key j (``x``: the layer input)."""
    r = j - i
    if name == "alibi":  # the past slope for j ≤ i, the future one (asymmetric) for j > i
        slope = mech.slopes[h] if r <= 0 else mech.future_slopes()[h]
        return -slope * abs(r)
    if name == "kerple":  # Chi et al. 2022, with the parameters clamped to their ranges
        r1 = max(float(mech.r1[h].detach()), 1e-2)
        r2 = max(float(mech.r2[h].detach()), 1e-2)
        if mech.kernel == "log":
            return -r1 * math.log(1 + r2 * abs(r))
        return -r1 * abs(r) ** min(r2, 2.0)
    if name == "sandwich":  # Chi et al. 2023: (p_i·p_j − d'/2) / (8h/H), h = 1 … H
        pi, pj = sinusoid_ref(int(positions[bidx, i]), mech.dim), sinusoid_ref(int(positions[bidx, j]), mech.dim)
        H = mech.dims.n_heads
        return (sum(a * b for a, b in zip(pi, pj)) - mech.dim / 2) / (8 * (h + 1) / H)
    if name == "dynamic_pos_bias":  # MLP(i − j), or of sign·log(1 + |i − j|)
        delta = float(i - j)
        if mech.log_distance:
            delta = math.copysign(math.log(1 + abs(delta)), delta) if delta else 0.0
        return mlp_ref(mech.mlp, [delta])[h]
    if name == "forgetting":
        return 0.0 if causal and j > i else forget_bias(mech, x, bidx, h, i, j)  # masked in a decoder
    if name == "t5":
        bucket = t5_bucket_ref(r, mech.bidirectional, mech.num_buckets, mech.max_distance)
        return mech.bias.weight[bucket, h]
    if name == "fixed_conv":
        w = (mech.beta.shape[1] - 1) // 2
        return mech.beta[h, clip(r, w) + w]
    if name == "dynamic_conv":
        w = (mech.weight.shape[0] - 1) // 2
        return q[bidx, h, i] @ mech.weight[clip(r, w) + w] / math.sqrt(dh)
    if name == "key_dynamic_conv":
        w = (mech.weight.shape[0] - 1) // 2
        return k[bidx, h, j] @ mech.weight[clip(-r, w) + w] / math.sqrt(dh)
    if name == "composite":
        return (position_bias(mech.fixed, "fixed_conv", h, i, j, q, k, bidx, segments, dh, causal, n, positions)
                + position_bias(mech.dynamic, "dynamic_conv", h, i, j, q, k, bidx, segments, dh, causal, n, positions))
    if name == "tisa":
        total = 0.0
        for s in range(mech.a.shape[1]):
            total = total + mech.a[h, s] * torch.exp(-mech.b[h, s].abs() * (r - mech.c[h, s]) ** 2)
        return total
    if name == "diet_abs":
        hp = 0 if mech.p_q.shape[0] == 1 else h
        return mech.p_q[hp, positions[bidx, i]] @ mech.p_k[hp, positions[bidx, j]]
    if name == "diet_rel":
        m = mech.max_distance
        return mech.rel[h, clip(r, m) + m]
    if name == "segment":
        return mech.table[h, segments[bidx, i], segments[bidx, j]]
    if name == "fire":  # Li et al. 2023: f_θ(ψ(|i − j|)/(ψ(max(L, i)) + ε)), ψ(x) = log(|cx| + 1)
        c, big_l = abs(float(mech.c.detach())), float(mech.threshold.detach())
        x = math.log(c * abs(r) + 1) / (math.log(c * max(big_l, int(positions[bidx, i])) + 1) + 1e-6)
        hidden = torch.relu(mech.mlp_in.weight[:, 0] * x + mech.mlp_in.bias)
        return mech.mlp_out.weight[h] @ hidden + mech.mlp_out.bias[h]
    if name == "tupe":
        if mech.untie_cls and i == 0:
            return mech.theta[0, h]
        if mech.untie_cls and j == 0:
            return mech.theta[1, h]
        p = mech.positions.weight
        pq = (p[positions[bidx, i]] @ mech.u_q.weight.T)[h * dh:(h + 1) * dh]
        pk = (p[positions[bidx, j]] @ mech.u_k.weight.T)[h * dh:(h + 1) * dh]
        total = pq @ pk / math.sqrt(2 * dh)
        if mech.relative is not None:
            total = total + position_bias(mech.relative, "t5", h, i, j, q, k, bidx, segments, dh, causal, n, positions)
        return total
    if name == "transformer_xl":  # Dai et al. 2019 §3.3, (b) + (c) + (d), all over √d_h as (a)
        wr = (mech.w_r.weight @ torch.tensor(sinusoid_ref(i - j, mech.dims.d_model, mech.base),
                                             dtype=q.dtype))[h * dh:(h + 1) * dh]  # W_R R_{i−j}, head h
        return (q[bidx, h, i] @ wr + mech.u[h] @ k[bidx, h, j] + mech.v[h] @ wr) / math.sqrt(dh)
    if name == "deberta":  # He et al. 2021 Eq 2-4: c2p q_i·K^r[δ] + p2c k_j·Q^r[δ], δ = clamp(i − j + k, 0, 2k − 1)
        span = mech.span
        p = mech.relative.weight[max(0, min(2 * span - 1, i - j + span))]
        total = 0.0
        if "c2p" in mech.kinds:
            total = total + q[bidx, h, i] @ (mech.pos_key.weight @ p + mech.pos_key.bias)[h * dh:(h + 1) * dh]
        if "p2c" in mech.kinds:
            total = total + k[bidx, h, j] @ (mech.pos_query.weight @ p + mech.pos_query.bias)[h * dh:(h + 1) * dh]
        return total / math.sqrt((1 + len(mech.kinds)) * dh)
    if name == "dape":  # the bias it adapts (its transform: score_transform)
        return position_bias(mech.inner, mech.inner.name, h, i, j, q, k, bidx, segments, dh, causal, n, positions)
    return 0.0


def rope_rotate(x: Tensor, positions: Tensor, theta: Tensor, mscale: float) -> Tensor:
    """Rotate channel pairs (m, m + d/2) of x [b, h, n, d] by angle position·θ_m."""
    out = x.clone()
    half = x.shape[-1] // 2
    for bi in range(x.shape[0]):
        for t in range(x.shape[2]):
            for m in range(half):
                a = float(positions[bi, t]) * float(theta[m])
                c, s = math.cos(a) * mscale, math.sin(a) * mscale
                x1, x2 = x[bi, :, t, m], x[bi, :, t, m + half]
                out[bi, :, t, m] = x1 * c - x2 * s
                out[bi, :, t, m + half] = x2 * c + x1 * s
    return out


def xpos_rotate(x: Tensor, positions: Tensor, mech, sign: int) -> Tensor:
    """Sun et al. 2022: RoPE's rotation with channel pair m scaled by ζ_m^{sign·(p − c)/B},
    c = max_len // 2 (+1 for queries, −1 for keys; every channel rotated). ζ_m = (2m/d + 0.4)/1.4
    is read from the mechanism, as θ is (stored in float32; tests/mechanisms/test_xpos.py checks it)."""
    out = rope_rotate(x, positions, mech.theta, mech.mscale)
    half = x.shape[-1] // 2
    for bi in range(x.shape[0]):
        for t in range(x.shape[2]):
            for m in range(half):
                zeta = float(mech.zeta[m])
                f = zeta ** (sign * (float(positions[bi, t]) - mech.dims.max_len // 2) / mech.scale_base)
                out[bi, :, t, m] = out[bi, :, t, m] * f
                out[bi, :, t, m + half] = out[bi, :, t, m + half] * f
    return out


def heads(t: Tensor, H: int) -> Tensor:
    """[b, n, H·dh] -> [b, H, n, dh]."""
    b, n, d = t.shape
    return t.reshape(b, n, H, d // H).permute(0, 2, 1, 3)


def merge(t: Tensor) -> Tensor:
    """[b, H, n, dh] -> [b, n, H·dh]."""
    b, H, n, dh = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, n, H * dh)


def project_qkv(attn, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v [b, H, n, dh] from the layer's joint projection, one slice of it each."""
    d, H = x.shape[-1], attn.dims.n_heads
    W, bias = attn.qkv.weight, attn.qkv.bias
    q, k, v = (heads(x @ W[i * d:(i + 1) * d].T + bias[i * d:(i + 1) * d], H) for i in range(3))
    return q, k, v


def cat_filters(mech, q: Tensor, k: Tensor, v: Tensor, causal: bool,
                keep: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """CAT's convolutions along the sequence on whichever of q, k, v the mechanism filters."""
    new = {"q": q, "k": k, "v": v}
    for t, w in mech.filters.items():
        new[t] = heads(conv_along(merge(new[t]), w, causal, keep), q.shape[1])
    return new["q"], new["k"], new["v"]


def slow_layer(attn, x: Tensor, keep: Tensor | None, causal: bool, segments: Tensor,
               positions: Tensor) -> Tensor:
    """The attention layer's output [b, n, d_model], from its parameters and the formulas."""
    b, n, d = x.shape
    H = attn.dims.n_heads
    dh = d // H
    q, k, v = project_qkv(attn, x)
    scale = 1.0 / math.sqrt(dh)
    names = [m.name for m in attn.mechanisms]
    assert set(names) <= COVERED, f"no slow formula for {set(names) - COVERED}"
    for mech in attn.mechanisms:
        if mech.name == "rope":
            theta = mech.theta
            q, k = rope_rotate(q, positions, theta, mech.mscale), rope_rotate(k, positions, theta, mech.mscale)
        elif mech.name == "xpos":
            q, k = xpos_rotate(q, positions, mech, 1), xpos_rotate(k, positions, mech, -1)
        elif mech.name == "tupe":
            scale = 1.0 / math.sqrt(2 * dh)
        elif mech.name == "deberta" and mech.rescale:  # c2c over √((1 + terms) d_h) as well
            scale = 1.0 / math.sqrt((1 + len(mech.kinds)) * dh)
        elif mech.name == "cat":
            q, k, v = cat_filters(mech, q, k, v, causal, keep)
            if mech.qk_norm:
                q = q / q.norm(dim=-1, keepdim=True) * mech.log_temperature.exp()
                k = k / k.norm(dim=-1, keepdim=True)
        elif mech.name == "conv_qkv":
            c = mech.n_conv
            new = {"q": q, "k": k, "v": v}
            for t in mech.targets:
                lin = mech.pointwise[t]
                conv = conv_along(x, mech.depthwise[t], causal, keep) @ lin.weight.T + lin.bias
                new[t] = torch.cat([new[t][:, : H - c], conv.reshape(b, n, c, dh).permute(0, 2, 1, 3)], 1)
            q, k, v = new["q"], new["k"], new["v"]
    def allowed(bi: int, i: int, j: int) -> bool:
        return (i == j) or ((not causal or j <= i) and (keep is None or bool(keep[bi, j])))

    logits = torch.zeros(b, H, n, n, dtype=x.dtype)
    scores = torch.zeros(b, H, n, n, dtype=x.dtype)
    for bi in range(b):
        for h in range(H):
            for i in range(n):
                for j in range(n):
                    logits[bi, h, i, j] = s = (q[bi, h, i] @ k[bi, h, j]) * scale
                    for mech in attn.mechanisms:
                        s = s + position_bias(mech, mech.name, h, i, j, q, k, bi, segments, dh, causal, n, positions,
                                              x)
                    scores[bi, h, i, j] = s
    for mech in attn.mechanisms:
        if mech.name in ("cope", "dape"):
            scores = score_transform(mech, logits, scores, q, allowed)
    o = torch.zeros(b, H, n, dh, dtype=x.dtype)
    for bi in range(b):
        for h in range(H):
            for i in range(n):
                row = [scores[bi, h, i, j] if allowed(bi, i, j) else torch.tensor(float("-inf"), dtype=x.dtype)
                       for j in range(n)]
                p = torch.softmax(torch.stack(row), 0)
                o[bi, h, i] = sum(p[j] * v[bi, h, j] for j in range(n))
    if "depthwise_conv" in names:
        mech = attn.mechanisms[names.index("depthwise_conv")]
        o = o + heads(conv_along(merge(v), mech.weight, causal, keep), H)
    return merge(o) @ attn.out.weight.T + attn.out.bias


def score_transform(mech, logits: Tensor, scores: Tensor, q: Tensor, allowed) -> Tensor:
    """The scores [b, H, n, n] after a score transform, entry by entry.

    CoPE (Golovneva et al. 2024): p_ij = Σ_{t=j..i} σ(s_it) over allowed keys t (between i and j
    on either side in an encoder), clipped to npos_max − 1; s_ij + q_i·e[p_ij] interpolated
    between ⌊p⌋ and ⌈p⌉. DAPE (Zheng et al. 2024): l_ij + B_ij + MLP([l_ij; B_ij]) across heads."""
    b, H, n, _ = scores.shape
    out = scores.clone()
    for bi in range(b):
        for i in range(n):
            for j in range(n):
                if mech.name == "dape":
                    lij, bij = logits[bi, :, i, j], scores[bi, :, i, j] - logits[bi, :, i, j]
                    pre = mech.mlp_in.weight @ torch.cat([lij, bij]) + mech.mlp_in.bias
                    hidden = torch.nn.functional.leaky_relu(pre)
                    out[bi, :, i, j] = lij + bij + mech.mlp_out.weight @ hidden + mech.mlp_out.bias
                    continue
                for h in range(H):
                    p = sum(torch.sigmoid(scores[bi, h, i, t]) for t in range(min(i, j), max(i, j) + 1)
                            if allowed(bi, i, t))
                    p = min(float(p.detach()), mech.npos_max - 1)
                    lo, hi = math.floor(p), math.ceil(p)
                    e = mech.pos_emb
                    out[bi, h, i, j] += (p - lo) * (q[bi, h, i] @ e[hi]) + (1 - p + lo) * (q[bi, h, i] @ e[lo])
    return out


def sinusoid_ref(pos: int, d: int, base: float = 10000.0) -> list[float]:
    """Vaswani et al. §3.5: PE[p, 2i] = sin(p / base^{2i/d}), PE[p, 2i+1] = cos(p / base^{2i/d})."""
    out = []
    for c in range(d):
        i = c // 2
        ang = pos / base ** (2 * i / d)
        out.append(math.sin(ang) if c % 2 == 0 else math.cos(ang))
    return out
