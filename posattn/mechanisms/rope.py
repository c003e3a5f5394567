"""Rotary position embedding (Su et al. 2021), partial rotary, xPos and the rescalings for longer contexts.

    q_i ← R(i·θ) q_i,  k_j ← R(j·θ) k_j   ⇒   q_i·k_j depends on j − i only;
    θ_m = base^{−2m/r}, rotating the channel pairs (m, m + r/2) of the first r channels of a head
    (GPT-NeoX layout); r = ``fraction``·d_h, the other d_h − r channels pass through unrotated
    (partial rotary: GPT-NeoX ``rotary_pct``, Black et al. 2022; x-transformers ``rotary_emb_dim``).

xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer"): the same rotation with q_i's pair m
scaled by ζ_m^{(i−c)/B} and k_j's by ζ_m^{−(j−c)/B}, ζ_m = (2m/r + γ)/(1 + γ) with the paper's
γ = 0.4 and B = ``scale_base``; so s_ij gains the factor ζ_m^{(i−j)/B}, an exponential decay with the distance
that depends on i − j only. It decays only for j ≤ i and grows for j > i, so it is defined for
causal attention (the paper; x-transformers refuses it too): an encoder is refused. The centre
c = ``max_len`` // 2 cancels in every score (x-transformers centres at n // 2 for the same reason:
smaller magnitudes); a fixed c keeps rotated keys valid in a decoding cache. The k factor reaches
ζ_0^{−(j−c)/B} = e^{1.25 (j−c)/B}: past j − c ≈ 8.8·B it overflows float16 (bfloat16 and float32 hold it).

Rescalings for contexts longer than the trained ``original_max_len`` L, with factor s (each matches
transformers' ``ROPE_INIT_FUNCTIONS`` — inverse frequencies and attention factor — where it has it):

- ``"linear"`` (position interpolation, Chen et al. 2023): θ ↦ θ / s, i.e. positions i ↦ i / s;
- ``"ntk"`` (NTK-aware, bloc97 2023; x-transformers ``base_rescale_factor``):
  base ↦ base · s^{r/(r−2)}, so the lowest frequency is interpolated by s and the highest kept;
- ``"dynamic"`` (dynamic NTK, emozilla 2023; transformers ``dynamic``): at current length
  n = max position + 1 > L, base ↦ base · (s·n/L − (s − 1))^{r/(r−2)}; plain RoPE up to L.
  Recomputed at every forward pass from that forward's positions (transformers also keeps the
  largest length seen so far; this is the same for a fresh model or growing lengths);
- ``"yarn"`` (Peng et al. 2023, Eq. 17-20): per-frequency ramp between interpolation and
  extrapolation, θ'_m = (1 − γ_m) θ_m / s + γ_m θ_m, and q, k both scaled by √(1/t) = 0.1 ln s + 1.
  ``yarn_ramp="ratio"`` is the paper's γ = clamp((L/λ_m − α)/(β − α), 0, 1) with λ_m = 2π/θ_m,
  α = ``beta_slow``, β = ``beta_fast``; ``"dimension"`` is the authors' released code (and
  transformers): γ linear in the index m between the indices where L/λ_m = β and = α, rounded
  outwards (floor/ceil). They agree at the highest and lowest frequencies and differ in the ramp;
- ``"llama3"`` (Llama 3.1, Meta 2024; transformers ``llama3``): wavelengths λ_m above L /
  ``low_freq_factor`` are interpolated (θ/s), below L / ``high_freq_factor`` kept, and in between
  θ'_m = (1 − g) θ_m / s + g θ_m with g = (L/λ_m − low)/(high − low);
- ``"longrope"`` (Ding et al. 2024, "LongRoPE"; transformers ``longrope``): θ'_m = θ_m / f_m with
  the given per-frequency factors f = ``short_factor`` while the current length is ≤ L and
  ``long_factor`` beyond it, and q, k scaled by √(1 + ln s / ln L) (s > 1; Phi-3's and transformers'
  default).

``dynamic`` and ``longrope`` depend on the current length, so a global shift of the positions can
change them, and a decoding cache cannot keep keys rotated at a shorter length: such a layer
recomputes its prefix instead of decoding incrementally. In packed rows (``document_ids``) the
current length is each document's own, as if it ran alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..errors import PositionError
from .base import Context, Dims, Mechanism, document_lengths
from .registry import register

Scaling = Literal["none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope"]
SCALINGS: tuple[str, ...] = ("none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope")
LENGTH_DEPENDENT = ("dynamic", "longrope")  # frequencies follow the current length
YarnRamp = Literal["ratio", "dimension"]


@dataclass(frozen=True)
class RopeScaling:
    """A rescaling of the inverse frequencies for contexts longer than ``original_max_len`` (the
    module docstring's equations; the fields are :class:`RoPE`'s options of the same names)."""

    kind: str = "none"
    factor: float = 1.0
    original_max_len: int = 2048
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_ramp: str = "ratio"
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float | None = None

    def check(self, rotated: int) -> None:
        """Refuse options this rescaling cannot honour for ``rotated`` rotated channels."""
        if self.kind not in SCALINGS:
            raise PositionError(f"rope: unknown scaling {self.kind!r}; valid: {', '.join(SCALINGS)}")
        if self.factor < 1.0:
            raise PositionError(f"rope: scaling factor must be >= 1, got {self.factor}")
        if self.original_max_len < 1:
            raise PositionError(f"rope: original_max_len must be >= 1, got {self.original_max_len}")
        if self.yarn_ramp not in ("ratio", "dimension"):
            raise PositionError(f"rope: yarn_ramp must be 'ratio' or 'dimension', got {self.yarn_ramp!r}")
        if self.kind == "ntk" and rotated <= 2:
            raise PositionError("rope: ntk scaling needs more than 2 rotated channels (exponent r/(r−2))")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise PositionError(f"rope: llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                                f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                given = getattr(self, name)
                if given is None:
                    raise PositionError(f"rope: longrope needs short_factor and long_factor ({rotated // 2} "
                                        f"per-frequency factors each, from the LongRoPE search); {name} is missing")
                if len(given) != rotated // 2 or any(not f > 0 for f in given):
                    raise PositionError(f"rope: {name} must hold {rotated // 2} positive numbers (one per "
                                        f"rotated channel pair), got {len(given)}")
        if self.attention_factor is not None and self.kind not in ("yarn", "longrope"):
            raise PositionError(f"rope: attention_factor applies to the yarn and longrope scalings, not {self.kind!r}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise PositionError(f"rope: attention_factor must be > 0, got {self.attention_factor}")

    def frequencies(self, rotated: int, base: float, length: int) -> tuple[Tensor, float]:
        """Inverse frequencies θ [rotated/2] (float32, computed in float64) at the current
        ``length`` (read by ``dynamic`` and ``longrope`` only), and the q/k magnitude factor."""
        exponent = torch.arange(0, rotated, 2, dtype=torch.float64) / rotated
        theta = base ** -exponent
        s, L, kind = self.factor, self.original_max_len, self.kind
        if kind == "none" or (s == 1.0 and kind in ("linear", "ntk", "yarn", "llama3")):
            return theta.float(), self.attention_factor or 1.0
        if kind == "linear":
            return (theta / s).float(), 1.0
        if kind in ("ntk", "dynamic"):
            if kind == "dynamic" and length <= L:
                return theta.float(), 1.0
            ratio = s if kind == "ntk" else s * length / L - (s - 1)
            return ((base * ratio ** (rotated / (rotated - 2))) ** -exponent).float(), 1.0
        if kind == "llama3":
            wavelength = 2 * math.pi / theta
            g = ((L / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)).clamp(0, 1)
            return ((1 - g) * theta / s + g * theta).float(), 1.0
        if kind == "longrope":
            chosen = self.long_factor if length > L else self.short_factor
            theta = theta / torch.tensor(chosen, dtype=torch.float64)
            default = 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(L))
            return theta.float(), self.attention_factor or default
        if self.yarn_ramp == "ratio":  # yarn, the paper's Eq. 18: linear in r = L/λ_m
            gamma = ((L * theta / (2 * math.pi) - self.beta_slow) / (self.beta_fast - self.beta_slow)).clamp(0, 1)
        else:  # the released code: linear in the index between the boundary indices, rounded outwards
            def index(rotations: float) -> float:  # the m where L/λ_m = rotations
                return rotated * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(base))
            low = max(math.floor(index(self.beta_fast)), 0)
            high = min(math.ceil(index(self.beta_slow)), rotated - 1)
            high = high if high != low else high + 0.001
            ramp = ((torch.arange(rotated // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
            gamma = 1 - ramp
        theta = (1 - gamma) * theta / s + gamma * theta
        return theta.float(), self.attention_factor or 0.1 * math.log(s) + 1.0


def rotate(x: Tensor, cos: Tensor, sin: Tensor, rotated: int) -> Tensor:
    """Apply the rotation to x [b, h, n, d]: x·cos + swap(x)·sin, where swap exchanges the two
    halves of the first ``rotated`` channels (the rest stay in place), cos = [cos iθ, cos iθ, 1…]
    and sin = [−sin iθ, sin iθ, 0…] ([b|1, 1, n, d]; :func:`tables`): the unrotated channels pass
    through exactly. Two passes over x (a copy and a fused multiply-add)."""
    half = rotated // 2
    if rotated == x.shape[-1]:
        swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    else:
        swapped = torch.cat([x[..., half:rotated], x[..., :half], x[..., rotated:]], dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


def tables(positions: Tensor, theta: Tensor, mscale: float, width: int,
           magnitude: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The [b|1, 1, n, ``width``] tables of :func:`rotate` for ``positions`` [b|1, n] and the
    frequencies ``theta`` [r/2] (or per token, [b|1, 1, n, r/2]), with the rotated pairs scaled
    by ``mscale`` and by ``magnitude`` [b|1, n, r/2] (xPos) when given."""
    ang = positions[:, None, :, None].to(theta.dtype) * theta
    cos, sin = ang.cos() * mscale, ang.sin() * mscale
    if magnitude is not None:
        cos, sin = cos * magnitude[:, None], sin * magnitude[:, None]
    rest = width - 2 * theta.shape[-1]
    if not rest:
        return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    ones, zeros = cos.new_ones(*cos.shape[:-1], rest), cos.new_zeros(*cos.shape[:-1], rest)
    return torch.cat([cos, cos, ones], -1), torch.cat([-sin, sin, zeros], -1)


@register("rope")
class RoPE(Mechanism):
    """Rotary embedding; see the module docstring for every option's equation and source.

    Options:
        base: the frequency base (10⁴ in RoFormer; 5·10⁵ in Llama 3).
        fraction: the share of each head's channels that is rotated, in (0, 1]; the first
            fraction·d_h channels (an even number) rotate, the rest pass through (GPT-NeoX
            rotary_pct; x-transformers rotary_emb_dim = fraction·d_h).
        scaling: none, linear, ntk, dynamic, yarn, llama3 or longrope.
        factor: the context extension s ≥ 1 (target / trained length).
        original_max_len: the trained context L the rescalings start from (default: max_len).
        beta_fast: YaRN's β (rotations per L above which a frequency is not interpolated; Peng et al. Eq. 18).
        beta_slow: YaRN's α (rotations per L below which a frequency is fully interpolated).
        yarn_ramp: ratio (the paper) or dimension (the released code, transformers).
        low_freq_factor: llama3's lower wavelength bound L/low_freq_factor.
        high_freq_factor: llama3's upper wavelength bound L/high_freq_factor.
        short_factor: LongRoPE's r/2 per-frequency factors used up to L.
        long_factor: LongRoPE's r/2 per-frequency factors used beyond L.
        attention_factor: overrides YaRN's or LongRoPE's q/k magnitude factor.
        xpos: add xPos's decay ζ^{(i−j)/B} (Sun et al. 2022; decoders only).
        scale_base: xPos's B, the distance over which the decay acts (512 in the paper's code).
    """

    paper = ("Su et al. 2021 (RoFormer); Sun et al. 2022 (xPos); Chen et al. 2023 (PI); Peng et al. 2023 "
             "(YaRN); Ding et al. 2024 (LongRoPE); CAT §LM")
    equation = "q_i ← R(iθ)q_i, k_j ← R(jθ)k_j"
    acts_on = ("q", "k")
    cost_class = "rotation"
    length_scalings = tuple(k for k in SCALINGS if k != "none")
    incremental = "rows"  # each row rotated by its own position: cached keys stay valid

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], base: float = 10000.0, fraction: float = 1.0,
                 scaling: Scaling = "none", factor: float = 1.0, original_max_len: int | None = None,
                 beta_fast: float = 32.0, beta_slow: float = 1.0, yarn_ramp: YarnRamp = "ratio",
                 low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                 short_factor: list[float] | None = None, long_factor: list[float] | None = None,
                 attention_factor: float | None = None, xpos: bool = False, scale_base: float = 512.0) -> None:
        super().__init__(dims, shared)
        if not 0 < fraction <= 1:
            raise PositionError(f"rope: fraction must be in (0, 1], got {fraction}")
        self.rotated = int(dims.head_dim * fraction)
        if fraction == 1 and dims.head_dim % 2:
            raise PositionError(f"rope: head dimension must be even, got {dims.head_dim}")
        if self.rotated < 2 or self.rotated % 2:
            raise PositionError(f"rope: the rotated channels (fraction {fraction} of head dimension "
                                f"{dims.head_dim} = {self.rotated}) must be a positive even number")
        if scale_base <= 0:
            raise PositionError(f"rope: scale_base must be > 0, got {scale_base}")
        self.base = base
        self.scaling = RopeScaling(scaling, factor, original_max_len or dims.max_len, beta_fast, beta_slow, yarn_ramp,
                                   low_freq_factor, high_freq_factor,
                                   None if short_factor is None else tuple(short_factor),
                                   None if long_factor is None else tuple(long_factor), attention_factor)
        self.scaling.check(self.rotated)
        theta, self.mscale = self.scaling.frequencies(self.rotated, base, self.scaling.original_max_len)
        self.register_buffer("theta", theta, persistent=False)
        if scaling in LENGTH_DEPENDENT:
            self.incremental = None  # frequencies change with the length: recompute the prefix
        self.xpos = xpos
        if xpos:
            zeta = (torch.arange(0, self.rotated, 2, dtype=torch.float64) + 0.4 * self.rotated) / (1.4 * self.rotated)
            self.register_buffer("zeta", zeta.float(), persistent=False)
            self.scale_base, self.centre = scale_base, dims.max_len // 2

    @classmethod
    def validate(cls, options: dict[str, Any], others: list[str], dims: Dims) -> None:
        if options.get("xpos") and not dims.causal:
            raise PositionError("rope: xpos is defined for causal attention (its decay ζ^{(i−j)/B} grows for keys "
                                "after the query; Sun et al. 2022); use it in a decoder")

    @classmethod
    def length_scaled(cls, options: dict, kind: str, factor: float, trained_len: int) -> dict:
        """The rescaling ``kind`` by ``factor`` from the trained context ``trained_len`` (the
        module docstring's equations); ``longrope`` keeps the factors the options give."""
        if kind not in cls.length_scalings:
            raise PositionError(f"rope: unknown length scaling {kind!r}; valid: {', '.join(cls.length_scalings)}")
        if kind == "longrope" and (options.get("short_factor") is None or options.get("long_factor") is None):
            raise PositionError("rope: longrope needs the model's rope options short_factor and long_factor "
                                "(LongRoPE's searched per-frequency factors); this model has none")
        return {**options, "scaling": kind, "factor": factor, "original_max_len": trained_len}

    def frequencies(self, ctx: Context) -> tuple[Tensor, float]:
        """θ and the magnitude factor for this forward pass: fixed, or from its length. In packed
        rows (``ctx.documents``) a length-dependent θ follows each token's document's own length,
        as [b, 1, n, r/2] (the magnitude factor does not depend on the length)."""
        if self.scaling.kind not in LENGTH_DEPENDENT:
            return self.theta, self.mscale
        if ctx.documents is None:
            theta, mscale = self.scaling.frequencies(self.rotated, self.base, int(ctx.positions.max()) + 1)
            return theta.to(self.theta.device), mscale
        lengths = document_lengths(ctx.documents, ctx.positions)
        distinct = lengths.unique()  # sorted
        per_length = [self.scaling.frequencies(self.rotated, self.base, int(n)) for n in distinct]
        table = torch.stack([theta for theta, _ in per_length]).to(self.theta.device)  # [lengths, r/2]
        return table[torch.searchsorted(distinct, lengths)][:, None], per_length[0][1]

    def rotation(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """cos and sin tables for q, then for k (the same ones unless xPos scales them apart)."""
        theta, mscale = self.frequencies(ctx)
        width = self.dims.head_dim
        if not self.xpos:
            cos, sin = tables(ctx.positions, theta, mscale, width)
            return cos, sin, cos, sin
        power = (ctx.positions - self.centre).to(self.zeta.dtype)[..., None] / self.scale_base
        up = self.zeta ** power  # [b, n, r/2]: ζ^{(i−c)/B} for q, its inverse for k
        return (*tables(ctx.positions, theta, mscale, width, up), *tables(ctx.positions, theta, mscale, width, 1 / up))

    def transform_qkv(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        cq, sq, ck, sk = ctx.cached(("rope", id(self)), lambda: self.rotation(ctx))
        r = self.rotated
        return rotate(q, cq.to(q.dtype), sq.to(q.dtype), r), rotate(k, ck.to(k.dtype), sk.to(k.dtype), r), v
