"""Transformer-XL's relative positional attention (Dai et al. 2019, §3.3, the equation for A^rel_ij):

    A^rel_ij = q_i·k_j  (a)  +  q_i·W_R R_{i−j}  (b)  +  u·k_j  (c)  +  v·W_R R_{i−j}  (d)

with q_i = W_q E_{x_i}, k_j = W_{k,E} E_{x_j} the layer's own query and key (term (a) is the
layer's content score), R_{i−j} the sinusoid encoding of the distance i − j (Vaswani et al. §3.5,
d_model wide, nothing learned), W_R = W_{k,R} ∈ R^{d_model×d_model} learned per layer and split
by head, and u, v ∈ R^{d_h} learned per head and layer (transformers' ``untie_r``).

Scaling: every term is divided by √d_h, as the layer divides (a). The paper's equation has no
scale; Dai et al.'s released code (and transformers' port) multiply the whole score, (a) + (b) +
(c) + (d), by 1/√d_h. Doing the same keeps (a) exactly the layer's q·k/√d_h and gives the four
dot products of d_h-wide vectors one temperature.

Each term has an exact structure of :mod:`posattn.attention.terms`, so every fast path computes
it without a dense n×n fallback:

- (b) q_i·W_R R_{i−j}: a query-relative term over every offset of the input (window n − 1,
  nothing clipped), its [h, 2n − 1, d_h] table W_R R built once per forward;
- (c) u·k_j: a rank-1 term, u_i = 1 and v_j = u_h·k_j/√d_h (a per-key score, folded into q/k);
- (d) v·W_R R_{i−j}: position-only, a Toeplitz table [h, 2n − 1].

The terms are built from the offsets j − i of the input alone (never from its position ids), so
they are translation invariant and hold for any length. In a decoder only i − j ≥ 0 reaches the
softmax (the paper's setting); an encoder reads R at negative distances too (sin is odd, cos
even), as XLNet's bidirectional relative attention does. Transformer-XL's segment-level
recurrence (the memory of the previous segment) is a training scheme, not a position mechanism,
and is not part of this.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..attention.terms import LowRank, QueryRelative, Term, Toeplitz
from .absolute import sinusoids
from .base import Context, Dims, Mechanism, offsets
from .registry import register


@register("transformer_xl")
class TransformerXL(Mechanism):
    """Transformer-XL's relative attention (Dai et al. 2019, §3.3): s_ij = (q_i·k_j + q_i·W_R R_{i−j}
    + u·k_j + v·W_R R_{i−j})/√d_h, R sinusoidal, W_R, u and v learned per layer.

    Options:
        base: the wavelength base of the sinusoid encodings R (10⁴, as in the paper)."""

    paper = "Dai et al. 2019 (Transformer-XL), §3.3"
    equation = "s_ij = (q_i·k_j + q_i·W_R R_{i−j} + u·k_j + v·W_R R_{i−j})/√d_h"
    acts_on = ("score",)
    cost_class = "relative_embedding"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], base: float = 10000.0) -> None:
        super().__init__(dims, shared)
        self.base = base
        self.w_r = nn.Linear(dims.d_model, dims.d_model, bias=False)  # W_{k,R}
        self.u = nn.Parameter(torch.randn(dims.n_heads, dims.head_dim) * 0.02)
        self.v = nn.Parameter(torch.randn(dims.n_heads, dims.head_dim) * 0.02)
        nn.init.normal_(self.w_r.weight, std=0.02)

    def start_at_zero(self) -> bool:
        """W_R = 0, u = 0, v = 0: no term adds anything, while u's gradient (k_j) and W_R's
        ((q_i + v)·R) are not zero; v trains once W_R has moved."""
        with torch.no_grad():
            self.w_r.weight.zero_()
            self.u.zero_()
            self.v.zero_()
        return True

    def encodings(self, n: int, ctx: Context, dtype: torch.dtype, device: torch.device) -> Tensor:
        """R_{i−j} [2n − 1, d_model] at each offset r = j − i = −(n−1) … n−1 (distance i − j = −r),
        shared by every layer of this forward pass."""
        def build() -> Tensor:
            distance = -offsets(n, device)
            return sinusoids(distance, self.dims.d_model, self.base, torch.float64).to(dtype)
        return ctx.cached(("transformer_xl", self.base, n, dtype, device), build)

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        n, h, dh = ctx.n, self.dims.n_heads, self.dims.head_dim
        scale = 1.0 / math.sqrt(dh)
        rel = self.w_r(self.encodings(n, ctx, q.dtype, q.device)).view(2 * n - 1, h, dh).transpose(0, 1)
        u, v = self.u.to(q.dtype), self.v.to(q.dtype)
        ones = torch.ones(1, 1, k.shape[-2], 1, dtype=q.dtype, device=q.device)
        return [
            QueryRelative(q, rel, n - 1, scale),  # (b) q_i·W_R R_{i−j}
            LowRank(u=ones, v=torch.einsum("bhjd,hd->bhj", k, u)[..., None] * scale),  # (c) u·k_j
            Toeplitz(torch.einsum("hrd,hd->hr", rel, v) * scale),  # (d) v·W_R R_{i−j}
        ]
