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
  (its :meth:`Mechanism.check`). A mixer with ``mixes_rows = True`` also gives chosen query rows
  alone (``mix(..., rows=...)``), so a model's last layer computes only the rows its loss reads.

Class attributes describe the mechanism for ``posattn mechanisms`` (TISA Tables 1-2, generated);
every claimed property is checked by a test. What other packages need to know about a mechanism
is asked of it here, never decided from its name: its cost class (:data:`COST_CLASSES`, the bench
targets), the position structures it learned (:meth:`Mechanism.position_structures`, the
analyses), its input position table (:meth:`Mechanism.position_table`), how it rescales for
longer inputs (:meth:`Mechanism.length_scaled`) and how it starts inside a pretrained model
(:meth:`Mechanism.retrofit_options`, :meth:`Mechanism.start_at_zero`, :meth:`Mechanism.set_kernels`).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from ..attention.terms import Toeplitz, batch_free
from ..errors import PositionError

if TYPE_CHECKING:
    from ..attention.terms import Term

Placement = Literal["input", "layer"]

# How a mechanism's cost arises, for the bench targets (``posattn.bench.report``): what the
# attention layer has to compute for it on top of plain softmax attention.
COST_CLASSES: dict[str, str] = {
    "none": "nothing: plain attention",
    "input": "an addition to the input embeddings, once per model",
    "rotation": "a per-row rotation of q and k",
    "fixed_bias": "a position-only score table with nothing to learn (cached; a low-rank causal form)",
    "narrow_low_rank": "a low-rank score term of a few columns (folded into q/k)",
    "wide_low_rank": "a low-rank score term as wide as a head (doubles the q/k width, or a dense bias)",
    "learned_table": "a learned score table over offsets (a bias kernel with its own gradient)",
    "relative_embedding": "a content-dependent score term q_i·W[j − i] or k_j·W[i − j]",
    "data_dependent_bias": ("a score term computed from the layer input (low-rank in a decoder, separable on each side "
                            "of the diagonal in an encoder)"),
    "convolution": "convolutions of q, k, v or the output along the sequence",
    "mixer": "a replacement of softmax(s)·V itself",
    "learned_function": "a learned function at every score (an MLP per query row and offset, built in blocks)",
    "score_transform": "a transform of the written-out n×n scores (no fused kernel takes it)",
}
StructureKind = Literal["offsets", "depthwise", "matrix", "segment", "filter"]


@dataclass(frozen=True)
class Structure:
    """A learned position structure to plot (Chang Fig 2-3, TISA Fig 3, DIET Fig 4/7).

    ``kind``: ``offsets`` ([h, 2n−1] score added at each offset r = j − i), ``depthwise``
    ([d_model, k] value-convolution kernels), ``matrix`` ([h, n, n] position-to-position
    scores), ``segment`` ([h, S, S] segment-pair scores) or ``filter`` ([k] or [d, k] sequence
    filter). ``label`` names it (the mechanism's name, or ``name:part``); ``data`` is float64."""

    label: str
    kind: StructureKind
    data: Tensor


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
    # [b, n] long document index of each token of a packed row (non-decreasing along a row);
    # None: each row is one document. No attention or convolution crosses a document boundary
    # and positions restart at 0 at the start of each document (:func:`document_positions`).
    documents: Tensor | None = None
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
    mixes_rows: ClassVar[bool] = False  # a mixer whose :meth:`mix` gives chosen query rows alone
    cost_class: ClassVar[str] = "none"  # a key of COST_CLASSES
    positional: ClassVar[bool] = True  # False: what it adds is not position (segment ids)
    reads_layer_input: ClassVar[bool] = False  # its hooks read ctx.x, the layer's input
    length_scalings: ClassVar[tuple[str, ...]] = ()  # the kinds :meth:`length_scaled` accepts

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

    @classmethod
    def length_scaled(cls, options: dict[str, Any], kind: str, factor: float,
                      trained_len: int) -> dict[str, Any] | None:
        """The options that run this mechanism, trained on ``trained_len`` positions, on inputs
        ``factor`` times longer with the rescaling ``kind`` (one of :attr:`length_scalings`), or
        None where it has no such rescaling (then it runs as it is)."""
        return None

    @classmethod
    def retrofit_options(cls, options: dict[str, Any], keeps_input_positions: bool) -> dict[str, Any]:
        """The options for a pretrained model whose own input position embeddings are kept
        (``True``) or removed; refuses options that disagree (:mod:`posattn.hf.retrofit`)."""
        return options

    def start_at_zero(self) -> bool:
        """Make this mechanism add exactly nothing while staying trainable, so that a retrofitted
        pretrained model starts as the function it was; False where it has no such start."""
        return False

    def set_kernels(self, kernels: dict[str, Any]) -> bool:
        """Set fitted kernel parameters (name -> array for this layer, e.g. TISA's a, b, c from
        :func:`posattn.analysis.tisa_fit.fit_tisa`); False where it has no fitted kernels."""
        return False

    def own_heads(self) -> dict[str, int]:
        """{"q" | "k" | "v": c}: :meth:`transform_qkv` supplies the last c heads of these itself,
        so the layer does not compute those rows of its linear projection (and may hand this
        mechanism h − c heads instead of h)."""
        return {}

    # -- what the analyses read -----------------------------------------------------------------
    def position_table(self, n: int) -> Tensor | None:
        """E_P [n, d_model] that this input mechanism adds at positions 0 … n−1, or None."""
        return None

    def position_structures(self, n: int, ctx: Context) -> list[Structure]:
        """The learned position structures at length n (``ctx``: positions 0 … n−1, no padding).
        By default the offset tables of its Toeplitz score terms (T5, TISA, DIET-REL, ALiBi,
        the fixed convolutions), computed with zero queries and keys; a mechanism whose
        structure is something else returns it itself."""
        h, dh = self.dims.n_heads, self.dims.head_dim
        q = torch.zeros(1, h, n, dh)
        return [Structure(self.name, "offsets", t.table.expand(h, -1).detach().double().contiguous())
                for t in self.score_terms(q, q, ctx) if isinstance(t, Toeplitz)]

    # -- hooks ---------------------------------------------------------------------------------
    def embed(self, x: Tensor, ctx: Context) -> Tensor:
        return x

    def transform_qkv(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        return q, k, v

    def score_terms(self, q: Tensor, k: Tensor, ctx: Context) -> list[Term]:
        return []

    def transform_output(self, o: Tensor, v: Tensor, ctx: Context) -> Tensor:
        return o

    def mix(self, q: Tensor, k: Tensor, v: Tensor, terms: list[Term], ctx: Context,
            softmax: Softmax, rows: Tensor | None = None) -> Tensor:
        """A mixer's output [b, h, n, d_v] in place of softmax(s)·V (only when ``mixes``); with
        ``rows`` ([b|1, m] query positions, only when ``mixes_rows``) those rows alone, [b, h, m, d_v],
        equal to the same rows of the whole output."""
        raise NotImplementedError


@dataclass(frozen=True)
class Softmax:
    """The layer's own softmax attention, handed to a mixer: ``softmax(q, k, v, terms)`` with the
    layer's mask (padding ``keep``, ``causal``, packed ``documents``), dropout and path. ``path``
    ("reference" or "fast") also picks the mixer's own reference or fast form."""

    path: str
    attend: Callable[..., Tensor]
    keep: Tensor | None
    causal: bool
    dropout: float = 0.0
    training: bool = False
    documents: Tensor | None = None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, terms: list[Term] | None = None) -> Tensor:
        return self.attend(q, k, v, terms or [], self.keep, self.causal, self.dropout, self.training, self.documents)


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


def check_inputs(mechanisms: Iterable[Mechanism], ctx: Context) -> None:
    """Every mechanism's :meth:`Mechanism.check` of ``ctx``. Left out inside ``torch.compile``, as
    the model's token-id range check: the checks read values, host syncs that would split a
    compiled step in two."""
    if torch.compiler.is_compiling():
        return
    for m in mechanisms:
        m.check(ctx)


def max_len_check(mech: Mechanism, positions: Tensor, limit: int) -> None:
    """Shared check for non-inductive mechanisms: ``positions.max() + 1`` positions needed,
    ``limit`` learned."""
    top = int(positions.max()) + 1
    if top > limit:
        raise mech.fail(
            f"needs {top} positions but it was built with "
            f"{limit} positions and is not inductive; rebuild with max_len >= {top} or use an "
            f"inductive mechanism"
        )


def document_starts(documents: Tensor) -> Tensor:
    """[b, n] bool: True at the first token of each document of a packed row."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts


def document_rank(documents: Tensor) -> Tensor:
    """[b, n] long: 0 for a row's first document, 1 for its second, … (whatever the ids are)."""
    return document_starts(documents).long().cumsum(-1) - 1


def document_positions(documents: Tensor) -> Tensor:
    """Position ids [b, n] that restart at 0 where each document of a packed row begins:
    for document ids [[0, 0, 0, 1, 1, 2]] the positions [[0, 1, 2, 0, 1, 0]]."""
    n = documents.shape[-1]
    index = torch.arange(n, device=documents.device).expand_as(documents)
    first = torch.where(document_starts(documents), index, torch.zeros_like(index)).cummax(-1).values
    return index - first


def document_lengths(documents: Tensor, positions: Tensor) -> Tensor:
    """[b, n]: for each token, one more than the largest position id of its document, the length
    the document has when it runs alone (for document ids [[0, 0, 0, 1, 1]] and positions
    restarting per document, [[3, 3, 3, 2, 2]])."""
    number = document_rank(documents)
    top = torch.zeros_like(positions).scatter_reduce(-1, number, positions, "amax")
    return top.gather(-1, number) + 1


def offsets(n: int, device: torch.device | None = None) -> Tensor:
    """The relative offsets r = j − i covered by an n×n score matrix: −(n−1) … n−1."""
    return torch.arange(-(n - 1), n, device=device)
