"""Data-dependent ALiBi: the Forgetting Transformer's forget gate (Lin et al. 2025, "Forgetting
Transformer: Softmax Attention with a Forget Gate"; x-transformers' ``data_dependent_alibi``).

Each head has a scalar forget gate per token, computed from the layer's input x:

    f_t = σ(w_h · x_t + b_h),   c_i = Σ_{t ≤ i} log f_t,
    s_ij += c_i − c_j = Σ_{t = j+1}^{i} log f_t   (j ≤ i)

a decay that ALiBi would give with log f_t = −m_h, but learned and content-dependent. In a
decoder the term is exactly rank 2, u_i = (c_i, 1) and v_j = (1, −c_j), so it folds into q/k
like any low-rank term. In an encoder (x-transformers' bidirectional form) a second set of gates
f'_t decays towards the future, s_ij += c'_j − c'_i for j > i: the two triangles make it dense,
but each is separable (a row value plus a key value), a :class:`~posattn.attention.terms.TwoSided`
term, which the fused kernels add from c and c' block by block and whose gradient they reduce
from dS as row and column sums per triangle, with no n×n tensor. ``post_log_scale``
multiplies log f (x-transformers' option); the gate bias starts at ``bias_init`` (x-transformers'
5: σ(5) ≈ 0.993, a slow decay at first).

The gates read the layer input x, which cached decoding does not keep for earlier tokens, so a
model with this mechanism recomputes the prefix when generating.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..attention.terms import LowRank, Term, TwoSided
from .base import Context, Dims, Mechanism, Structure, document_positions
from .registry import register


@register("forgetting")
class ForgettingGate(Mechanism):
    """Data-dependent ALiBi: the Forgetting Transformer's forget gates f_t = σ(w_h·x_t + b_h) give
    the bias Σ_{t=j+1..i} log f_t = c_i − c_j (Lin et al. 2025), a rank-2 term in a decoder;
    an encoder adds its own gates towards the future (x-transformers data_dependent_alibi).

    Options:
        bias_init: the gates' initial bias b (σ(b) is the initial forget gate; 5 keeps almost everything).
        post_log_scale: a constant multiplying log f.
    """

    paper = "Lin et al. 2025 (Forgetting Transformer); x-transformers data_dependent_alibi"
    equation = "s_ij += Σ_{t=j+1..i} log σ(w·x_t + b)"
    acts_on = ("score",)
    cost_class = "data_dependent_bias"
    reads_layer_input = True

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], bias_init: float = 5.0,
                 post_log_scale: float = 1.0) -> None:
        super().__init__(dims, shared)
        sides = 1 if dims.causal else 2  # an encoder's second set decays towards the future
        self.gates = nn.Linear(dims.d_model, sides * dims.n_heads)
        nn.init.constant_(self.gates.bias, bias_init)
        self.post_log_scale = post_log_scale

    def cumulative_log_gates(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        """c [b, sides·H, n]: the cumulative sums of the scaled log forget gates (summed in at
        least float32: under bf16 autocast a long sum would lose the small per-token decays).
        In packed rows (``documents``) the sums restart at each document, as if it ran alone
        (summed in float64 before the earlier documents' total is taken off, so no precision is
        lost to them)."""
        z = self.gates(x)
        z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
        logs = F.logsigmoid(z) * self.post_log_scale
        if documents is None:
            return logs.cumsum(1).transpose(1, 2)
        c = logs.double().cumsum(1)
        start = torch.arange(x.shape[1], device=x.device) - document_positions(documents)  # [b, n]
        before = c.gather(1, (start - 1).clamp(min=0)[..., None].expand_as(c)) * (start > 0)[..., None]
        return (c - before).to(logs.dtype).transpose(1, 2)

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        assert ctx.x is not None, "the attention layer sets the layer input ctx.x"
        c = self.cumulative_log_gates(ctx.x, ctx.documents).to(q.dtype)
        h = self.dims.n_heads
        past, future = c[:, :h], c[:, h:]
        if ctx.causal:
            ones = torch.ones_like(past)
            return [LowRank(u=torch.stack([past, ones], -1), v=torch.stack([ones, -past], -1))]
        return [TwoSided(past, -past, -future, future)]  # c_i − c_j for j ≤ i, c'_j − c'_i for j > i

    def position_structures(self, n: int, ctx: Context) -> list[Structure]:
        """None: the bias is computed from the input, not a position structure of its own."""
        return []
