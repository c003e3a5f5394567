"""xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer", §3.2): rotary embedding with an
exponential decay of the scores with the distance,

    q_i ← ζ^{(i−c)/B} ⊙ R(iθ) q_i,   k_j ← ζ^{−(j−c)/B} ⊙ R(jθ) k_j
    ⇒  s_ij = Σ_m ζ_m^{(i−j)/B} · (RoPE's product of channel pair m),   ζ_m = (2m/r + γ)/(1 + γ), γ = 0.4,

B = ``scale_base``. The registered name of ``{"name": "rope", "xpos": true}``: one implementation
(:class:`~.rope.RoPE`, whose module docstring gives the equations, the centre c, the encoder form
and the rescalings for longer contexts, which apply to xPos's rotation as to RoPE's).
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .base import Dims
from .registry import register
from .rope import RoPE, Scaling, YarnRamp  # noqa: F401  (annotations of the signature below)


@register("xpos")
class XPos(RoPE):
    """xPos: RoPE whose channel pair m of q_i is scaled by ζ_m^{(i−c)/B} and of k_j by ζ_m^{−(j−c)/B},
    so every score gains the decay ζ_m^{(i−j)/B} (Sun et al. 2022); ``rope`` with ``xpos=True``.

    Options:
        scale_base: B, the distance over which the decay acts (512 in the paper's code).
        base: the frequency base of the rotation (10⁴).
        fraction: the share of each head's channels that is rotated (and scaled), in (0, 1]; the
            rest pass through (x-transformers rotary_emb_dim = fraction·d_h).
        scaling: the rotation's rescaling for longer contexts: none, linear, ntk, dynamic, yarn,
            llama3 or longrope (rope's equations; the decay is unchanged).
        factor: the context extension s ≥ 1 (target / trained length).
        original_max_len: the trained context L the rescalings start from (default: max_len).
        beta_fast: YaRN's β (rotations per L above which a frequency is not interpolated).
        beta_slow: YaRN's α (rotations per L below which a frequency is fully interpolated).
        yarn_ramp: ratio (the YaRN paper) or dimension (the released code, transformers).
        low_freq_factor: llama3's lower wavelength bound L/low_freq_factor.
        high_freq_factor: llama3's upper wavelength bound L/high_freq_factor.
        short_factor: LongRoPE's r/2 per-frequency factors used up to L.
        long_factor: LongRoPE's r/2 per-frequency factors used beyond L.
        attention_factor: overrides YaRN's or LongRoPE's q/k magnitude factor.
    """

    paper = "Sun et al. 2022 (xPos, A Length-Extrapolatable Transformer)"
    equation = "q_i ← ζ^{i/B}R(iθ)q_i, k_j ← ζ^{−j/B}R(jθ)k_j"

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], **options: Any) -> None:
        super().__init__(dims, shared, **options, xpos=True)


# The options are rope's without ``xpos`` (always on), scale_base first: the signature that
# ``option_names``, the validation and the generated reference read.
_rope = inspect.signature(RoPE.__init__).parameters
_first = [_rope[p] for p in ("self", "dims", "shared", "scale_base")]
XPos.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    _first + [p for p in _rope.values() if p not in _first and p.name != "xpos"])
