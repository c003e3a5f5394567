"""The mechanism interface: four places where position can enter attention.

Notation (SPEC): per head, q_i = x_i W_Q, k_j = x_j W_K, s_ij = q_i·k_j/√d_h + position terms, r = j − i.

A mechanism is an ``nn.Module`` that overrides any of these hooks:

- :meth:`Mechanism.embed` (placement ``"input"``, built once per model): x ↦ x + E;
- :meth:`Mechanism.transform_qkv`: (q, k, v) ↦ (q', k', v') before the scores;
- :meth:`Mechanism.score_terms`: additive score terms, each declared by *structure*
  (:mod:`posattn.attention.terms`), so the attention layer can pick an exact fast algorithm
  without knowing the mechanism's name;
- :meth:`Mechanism.transform_output`: o ↦ o + g(v) after attention;
- :meth:`Mechanism.mix` (a *mixer*, ``mixes = True``): replaces softmax(s)·V itself (ConvBERT,
  Linformer, LinCAT, Landmark CAT). Composition rules (:func:`check_layer`, one clear error
  each): at most one mixer per layer; no score term on a mixer that has no score matrix
  (``takes_score_terms = False``); no decoder for a mixer that cannot be causal (its
  :meth:`Mechanism.validate`); no length beyond what a length-projected mixer was built for
  (its :meth:`Mechanism.check`).

Class attributes describe the mechanism for ``posattn mechanisms`` (TISA Tables 1-2, generated);
every claimed property is checked by a test.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal

import torch
from torch import Tensor, nn

from ..attention.terms import batch_free
from ..errors import PositionError

if TYPE_CHECKING:
    from ..attention.terms import Term

Placement = Literal["input", "layer"]


@dataclass(frozen=True)
class Dims:
    """Model sizes a mechanism may need at construction time."""

    d_model: int
    n_heads: int
    n_layers: int
    max_len: int
    n_segments: int
    causal: bool

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class Context:
    """What a mechanism may read during one forward pass (shared by all layers)."""

    positions: Tensor  # [b, n] long, absolute position ids
    segments: Tensor  # [b, n] long, segment ids (zeros when the input has none)
    keep: Tensor | None  # [b, n] bool, True = real token; None = no padding
    causal: bool
    x: Tensor | None = None  # the current layer's (normed) input [b, n, d_model]
    cache: dict[Any, Any] = field(default_factory=dict)  # position-only terms, reused by layers

    @property
    def n(self) -> int:
        return self.positions.shape[-1]

    @property
    def row_positions(self) -> Tensor:
        """Position ids [1, n] when every batch row has the same ones (the usual case), else
        [b, n]: tables read at these rows once serve the batch, and their backward is one
        row's scatter instead of the batch's."""
        return self.positions[:1] if batch_free(self.positions) else self.positions

    def cached(self, key: Any, fn: Callable[[], Any]) -> Any:
        """Compute ``fn()`` once per forward pass for ``key`` (e.g. a table shared by layers)."""
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]


class Mechanism(nn.Module):
    """Base class: every hook is the identity; subclasses override what they use."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    equation: ClassVar[str] = ""
    placement: ClassVar[Placement] = "layer"
    acts_on: ClassVar[tuple[str, ...]] = ()
    inductive: ClassVar[bool] = True
    translation_invariant: ClassVar[bool] = True
    claims: ClassVar[frozenset[str]] = frozenset()
    share_layers_default: ClassVar[bool] = False
    mixes: ClassVar[bool] = False  # replaces softmax(s)·V with :meth:`mix`
    takes_score_terms: ClassVar[bool] = True  # a mixer: other mechanisms' score terms still apply

    def __init__(self, dims: Dims, shared: dict[str, nn.Module]) -> None:
        super().__init__()
        self.dims = dims

    # -- construction-time rules -------------------------------------------------------------
    @classmethod
    def option_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return [p for p in sig.parameters if p not in ("self", "dims", "shared")]

    @classmethod
    def placement_for(cls, options: dict[str, Any]) -> Placement:
        """``"input"``: built once per model and applied to the embeddings; ``"layer"``: per layer."""
        return cls.placement

    @classmethod
    def layer_shared(cls, options: dict[str, Any]) -> bool:
        """Whether one instance serves every layer (parameters shared across layers)."""
        return cls.share_layers_default

    @classmethod
    def validate(cls, options: dict[str, Any], others: list[str], dims: Dims) -> None:
        """Refuse combinations this mechanism cannot honour (``others``: the other names)."""

    def check(self, ctx: Context) -> None:
        """Refuse inputs this mechanism cannot honour (e.g. a length beyond its positions)."""

    def fail(self, reason: str) -> PositionError:
        return PositionError(f"{self.name}: {reason}")

    def own_heads(self) -> dict[str, int]:
        """{"q" | "k" | "v": c}: :meth:`transform_qkv` supplies the last c heads of these itself,
        so the layer does not compute those rows of its linear projection (and may hand this
        mechanism h − c heads instead of h)."""
        return {}

    # -- hooks ---------------------------------------------------------------------------------
    def embed(self, x: Tensor, ctx: Context) -> Tensor:
        return x

    def transform_qkv(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        return q, k, v

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list["Term"]:
        return []

    def transform_output(self, o: Tensor, v: Tensor, ctx: Context) -> Tensor:
        return o

    def mix(self, q: Tensor, k: Tensor, v: Tensor, terms: list["Term"], ctx: Context,
            softmax: "Softmax") -> Tensor:
        """A mixer's output [b, h, n, d_v] in place of softmax(s)·V (only when ``mixes``)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Softmax:
    """The layer's own softmax attention, handed to a mixer: ``softmax(q, k, v, terms)`` with the
    layer's mask, dropout and path. ``path`` ("reference" or "fast") also picks the mixer's own
    reference or fast form."""

    path: str
    attend: Callable[..., Tensor]
    keep: Tensor | None
    causal: bool
    dropout: float = 0.0
    training: bool = False

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, terms: list["Term"] | None = None) -> Tensor:
        return self.attend(q, k, v, terms or [], self.keep, self.causal, self.dropout, self.training)


def check_layer(mechanisms: list[Mechanism]) -> None:
    """The composition rules for mixers, on one layer's built mechanisms."""
    mixers = [m for m in mechanisms if m.mixes]
    if len(mixers) > 1:
        raise PositionError(f"{mixers[0].name} and {mixers[1].name} both replace softmax attention "
                            f"(mixers); a layer takes one")
    if mixers and not mixers[0].takes_score_terms:
        for m in mechanisms:
            if "score" in m.acts_on:
                raise PositionError(f"{m.name}: adds a score term, but {mixers[0].name} has no score "
                                    f"matrix to add it to; drop one of them")


def max_len_check(mech: Mechanism, top: int, limit: int) -> None:
    """Shared check for non-inductive mechanisms: ``top`` positions needed, ``limit`` learned."""
    if top > limit:
        raise mech.fail(
            f"needs {top} positions but it was built with "
            f"{limit} positions and is not inductive; rebuild with max_len >= {top} or use an "
            f"inductive mechanism"
        )


def offsets(n: int, device: torch.device | None = None) -> Tensor:
    """The relative offsets r = j − i covered by an n×n score matrix: −(n−1) … n−1."""
    return torch.arange(-(n - 1), n, device=device)
