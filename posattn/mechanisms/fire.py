"""FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context
Transformers", §3, Eq. 4-6): a learned function of the progressively normalised distance.

    s_ij += f_θ(ψ(i − j) / ψ(max(L, i))),   ψ(x) = log(c·x + 1),   j ≤ i

f_θ: an MLP 1 → ``hidden`` → n_heads with ReLU (the paper: 2 layers, hidden 32), one per
layer, one output per head. c and the threshold L are learned and kept non-negative as in the
paper's listing (Appendix): ψ(x) = log(|c·x| + 1), L = |ℓ·L₀| with ℓ learned (initially 1) and
L₀ = ``threshold_init``, and ε = 1e-6 added to the normaliser ψ(max(L, i)) so that row 0 with
L = 0 is defined. The listing's defaults are ``mlp_width=32, init_c=0.1, init_L=512, eps=1e-6``
for the paper's training length of 2048: c₀ = 0.1, hidden 32 and ε here are those; L₀ defaults
to max_len / 4, which is the listing's 512 when max_len is that training length (as in
``posattn pretrain``, where max_len is the training length) and keeps the same fraction of the
training length for shorter models. ``posattn compare`` builds its models for the longest test
length, so a length-generalisation comparison that wants the paper's start at the training
length passes ``threshold_init`` (e.g. training length / 4; 512 for the listing's constant).
Dividing by ψ(max(L, i)) maps every query row's distances into [0, 1], so a
longer input interpolates within the range seen in training instead of extrapolating; rows
i ≤ L share the normaliser ψ(L) (better short-sequence modelling, §3.3). i is the query's
position id (``ctx.positions``), i − j the offset within the sequence.

Encoders: the paper defines and evaluates FIRE for causal attention (i ≥ j). Its listing reads
|c·(i − j)|, and so does this module in an encoder: f_θ(ψ(|i − j|)/ψ(max(L, i))), the same
function for keys on either side, which the paper does not evaluate.

The bias depends on i as well as i − j: a :class:`~posattn.attention.terms.RowNormalised` term,
which the fast path builds block by block (flash-bias chunks) from the distance table
ψ(0 … n−1), the row normalisers and the MLP's weights, never as an n×n table beyond short inputs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.terms import RowNormalised, Term
from ..errors import PositionError
from .base import Context, Dims, Mechanism, Structure
from .registry import register

EPS = 1e-6  # added to the normaliser ψ(max(L, i)), as in the paper's listing


def fire_mlp(x: Tensor, params: Sequence[Tensor]) -> Tensor:
    """f_θ(x) = W₂·ReLU(W₁x + b₁) + b₂ for every entry of x [...]: [..., h]."""
    w1, b1, w2, b2 = params
    return F.relu(x[..., None] * w1 + b1) @ w2.T + b2


def _number(options: dict, key: str, default: float, low: float, strict: bool, meaning: str) -> None:
    v = options.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < low or (strict and v == low):
        raise PositionError(f"fire: {key} must be a number {'>' if strict else '>='} {low:g} ({meaning}), got {v!r}")


@register("fire")
class FIRE(Mechanism):
    """FIRE: a learned function of the distance, normalised by the query's position, as the bias:
    f_θ(ψ(i−j)/ψ(max(L, i))), ψ(x) = log(cx + 1) (Li et al. 2023); causal in the paper, and
    here with abs(i−j) in an encoder (not evaluated by the paper).

    Options:
        hidden: width of f_θ's hidden layer (the paper: 32).
        c_init: initial c of ψ (the paper: 0.1).
        threshold_init: L₀, the initial threshold L in positions (default max_len / 4: the
            listing's 512 at the paper's 2048-token training length).
        learn_threshold: learn L (else it stays L₀).
    """

    paper = "Li et al. 2023 (FIRE)"
    equation = "s_ij += f_θ(ψ(i−j)/ψ(max(L,i))), ψ(x) = log(cx+1)"
    acts_on = ("score",)
    translation_invariant = False  # the normaliser reads the query's position i
    cost_class = "learned_function"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], hidden: int = 32, c_init: float = 0.1,
                 threshold_init: float | None = None, learn_threshold: bool = True) -> None:
        super().__init__(dims, shared)
        h = dims.n_heads
        self.mlp_in = nn.Linear(1, hidden)
        self.mlp_out = nn.Linear(hidden, h)
        self.c = nn.Parameter(torch.tensor(float(c_init)))
        l0 = dims.max_len / 4 if threshold_init is None else float(threshold_init)
        self.register_buffer("threshold_init", torch.tensor(l0), persistent=False)
        self.threshold_scale = nn.Parameter(torch.tensor(1.0), requires_grad=learn_threshold)

    @classmethod
    def validate(cls, options: dict, others: list[str], dims: Dims) -> None:
        hidden = options.get("hidden", 32)
        if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
            raise PositionError(f"fire: hidden must be a positive integer, got {hidden!r}")
        _number(options, "c_init", 0.1, 0.0, True, "c of ψ(x) = log(cx + 1)")
        if options.get("threshold_init") is not None:
            _number(options, "threshold_init", 0.0, 0.0, False, "the threshold L in positions")
        if not isinstance(options.get("learn_threshold", True), bool):
            raise PositionError(f"fire: learn_threshold must be true or false, got {options['learn_threshold']!r}")

    @property
    def threshold(self) -> Tensor:
        """L = |ℓ·L₀| ≥ 0."""
        return (self.threshold_scale * self.threshold_init).abs()

    def psi(self, x: Tensor) -> Tensor:
        """ψ(x) = log(|c·x| + 1)."""
        return torch.log1p((self.c * x).abs())

    def term(self, positions: Tensor, dtype: torch.dtype) -> RowNormalised:
        """The term for rows at ``positions`` [b|1, n]."""
        n = positions.shape[-1]
        r = torch.arange(n, device=positions.device, dtype=dtype)
        norm = self.psi(torch.maximum(positions.to(dtype), self.threshold.to(dtype))) + EPS
        params = (self.mlp_in.weight[:, 0], self.mlp_in.bias, self.mlp_out.weight, self.mlp_out.bias)
        return RowNormalised(self.psi(r).to(dtype), norm, tuple(p.to(dtype) for p in params), fire_mlp)

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        return [self.term(ctx.row_positions, q.dtype)]

    def position_structures(self, n: int, ctx: Context) -> list[Structure]:
        """The [h, n, n] bias at positions 0 … n−1 (a decoder reads its lower triangle j ≤ i)."""
        bias = self.term(torch.arange(n, device=self.c.device)[None], torch.float32).dense(n)[0]
        return [Structure(self.name, "matrix", bias.detach().double().contiguous())]
