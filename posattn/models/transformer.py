"""Pre-LN transformer models built from a :class:`ModelConfig`.

- :class:`Encoder`: bidirectional; token + optional segment ids, padding mask, an MLM head
  with tied embeddings (BERT's transform + decoder) and a sequence-classification head.
- :class:`Decoder`: causal; an LM head with tied embeddings; :meth:`Decoder.decode` continues a
  prefix from a key/value cache.
Position enters only through the configured mechanisms (:mod:`posattn.mechanisms`).

Packed sequences: every entry point takes ``document_ids`` ([b, n] long, non-decreasing along a
row), the document of each token when several documents share a row. Positions then restart at 0
at each document (:func:`~posattn.mechanisms.base.document_positions`, unless ``positions`` are
given) and no token attends to another document: a packed batch gives the outputs and gradients
of its documents run one by one.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.decode import Cache, Step, blockers
from ..attention.dropout import Dropout
from ..attention.layer import Attention
from ..attention.terms import take_rows
from ..errors import PositionError
from ..mechanisms import Context, Dims, Mechanism, build
from ..mechanisms.base import check_inputs, document_positions
from .config import ModelConfig


def init_linear(model: nn.Module, std: float | None) -> None:
    """With ``std`` (GPT-2 / Zoology: 0.02), every linear map N(0, std²) with zero bias;
    with None, PyTorch's default initialisation stays."""
    if std is None:
        return
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class Block(nn.Module):
    """x + Attn(LN(x)), then x + MLP(LN(x)) when d_ff > 0."""

    def __init__(self, cfg: ModelConfig, dims: Dims, mechanisms: list[Mechanism]) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(dims, mechanisms, cfg.attn_path, cfg.dropout, cfg.bias)
        self.mlp: nn.Module | None = None
        if cfg.d_ff:
            self.ln2 = nn.LayerNorm(cfg.d_model)
            self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias), nn.GELU(),
                                     nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias), Dropout(cfg.dropout))
        self.drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, ctx: Context, cached: Step | None = None, rows: Tensor | None = None) -> Tensor:
        """``cached``: x holds only new rows, which attend to the cache (:meth:`Decoder.decode`);
        ``rows`` ([b|1, m] positions): only those rows come out, [b, m, d_model]."""
        if cached is not None:
            a = cached.attend(self.attn, self.ln1(x), ctx)
        else:
            a = self.attn(self.ln1(x), ctx, rows)
            x = x if rows is None else take_rows(x, rows)
        x = x + self.drop(a)
        if self.mlp is not None:
            x = x + self.mlp(self.ln2(x))
        return x


def validated_documents(document_ids: Tensor, shape: torch.Size) -> Tensor | None:
    """The validated document ids (:attr:`Context.documents`), or None when every row is one
    document (then nothing is packed and the model runs exactly as without them)."""
    if not isinstance(document_ids, Tensor) or document_ids.dtype != torch.long or document_ids.shape != shape:
        got = (f"{document_ids.dtype} of shape {tuple(document_ids.shape)}" if isinstance(document_ids, Tensor)
               else type(document_ids).__name__)
        raise PositionError(f"document_ids must be a LongTensor of the inputs' shape {tuple(shape)} (the document "
                            f"of each token of a packed row), got {got}")
    if torch.compiler.is_compiling():  # host syncs: they would split a compiled step in two
        return document_ids
    if bool((document_ids[:, 1:] < document_ids[:, :-1]).any()):
        raise PositionError("document_ids must be non-decreasing along each row (each document one contiguous "
                            "run of tokens)")
    return None if bool((document_ids == document_ids[:, :1]).all()) else document_ids


def scored_rows(scored: Tensor, shape: torch.Size, most: int | None = None) -> tuple[Tensor, Tensor]:
    """The positions of the True entries of ``scored`` (bool [b, n]) as rows [b, m] in ascending
    order, m the most in one batch row (shorter rows padded with unscored positions), and which
    entries are real, ``valid`` [b, m]: ``x_rows[valid]`` is ``x[scored]``. ``most``: m itself,
    a bound known before the data (no host sync: a compiled step's shapes stay static)."""
    if scored.shape != shape or scored.dtype != torch.bool:
        raise PositionError(f"scored must be a bool tensor of the inputs' shape {tuple(shape)}, got "
                            f"{scored.dtype} of shape {tuple(scored.shape)}")
    counts = scored.sum(1)
    if most is None:
        m = int(counts.max()) if scored.numel() else 0
    elif not 0 <= most <= shape[1]:
        raise PositionError(f"scored_max must be between 0 and the length {shape[1]}, got {most}")
    else:
        m = most
        if not torch.compiler.is_compiling() and scored.numel() and int(counts.max()) > m:
            raise PositionError(f"scored_max={m}, but a row scores {int(counts.max())} positions")
    rows = torch.sort((~scored).to(torch.uint8), dim=1, stable=True).indices[:, :m]
    return rows, torch.arange(m, device=scored.device) < counts[:, None]


class Transformer(nn.Module):
    """Shared backbone: embeddings, input mechanisms, blocks, final norm."""

    causal: bool = False
    kind: str = ""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dims = Dims(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.max_len, cfg.n_segments, self.causal)
        built = build(cfg.mechanisms, self.dims)
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.tokens.weight, std=0.02)
        self.input_mechanisms = nn.ModuleList(built.input)
        self.blocks = nn.ModuleList(Block(cfg, self.dims, mechs) for mechs in built.layers)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.drop = Dropout(cfg.dropout)

    def mechanisms(self) -> list[Mechanism]:
        """Every distinct mechanism instance (input-level and per layer)."""
        seen: dict[int, Mechanism] = {}
        for m in self.modules():
            if isinstance(m, Mechanism) and id(m) not in seen and m.name:
                seen[id(m)] = m
        return list(seen.values())

    def context(self, input_ids: Tensor, segment_ids: Tensor | None, attention_mask: Tensor | None,
                positions: Tensor | None, document_ids: Tensor | None = None) -> Context:
        """Validate the inputs and build the shared per-forward context."""
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise PositionError("input_ids must be a LongTensor of shape [batch, length]")
        b, n = input_ids.shape
        if n == 0:
            raise PositionError("input_ids has length 0")
        # the checks that read values are host syncs, which would split a compiled step in two:
        # inside torch.compile they are left out
        syncs = not torch.compiler.is_compiling()
        if syncs:
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise PositionError(f"token id {hi if hi >= self.cfg.vocab_size else lo} outside the "
                                    f"vocabulary [0, {self.cfg.vocab_size})")
        keep = None
        if attention_mask is not None:
            if attention_mask.shape != (b, n):
                raise PositionError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                                    f"expected {(b, n)}")
            keep = attention_mask.bool()
            keep = None if syncs and bool(keep.all()) else keep  # nothing hidden: the faster paths
        if segment_ids is None:
            segment_ids = torch.zeros_like(input_ids)
        elif (segment_ids.shape != (b, n) or segment_ids.dtype != torch.long
              or (syncs and int(segment_ids.min()) < 0)):
            raise PositionError(f"segment_ids must be a non-negative LongTensor of shape {(b, n)}")
        documents = None if document_ids is None else validated_documents(document_ids, input_ids.shape)
        if positions is None and documents is not None:
            positions = document_positions(documents)
        elif positions is None:
            positions = torch.arange(n, device=input_ids.device).expand(b, n)
        elif positions.shape != (b, n):
            raise PositionError(f"positions has shape {tuple(positions.shape)}, expected {(b, n)}")
        elif positions.dtype != torch.long or (syncs and int(positions.min()) < 0):
            raise PositionError("positions must be a non-negative LongTensor of position ids")
        ctx = Context(positions=positions, segments=segment_ids, keep=keep, causal=self.causal, documents=documents)
        check_inputs(self.mechanisms(), ctx)
        return ctx

    def embed(self, input_ids: Tensor, ctx: Context) -> Tensor:
        x = self.tokens(input_ids)
        for m in self.input_mechanisms:
            x = m.embed(x, ctx)
        return self.drop(x)

    def hidden(self, input_ids: Tensor, segment_ids: Tensor | None = None,
               attention_mask: Tensor | None = None, positions: Tensor | None = None,
               scored: Tensor | None = None, document_ids: Tensor | None = None,
               scored_max: int | None = None) -> Tensor:
        """Final hidden states [b, n, d_model]; with ``scored`` (bool [b, n]) only those rows,
        [k, d_model], as ``hidden(...)[scored]``: the last block computes only the rows it
        returns (a loss that reads 1 of 128 positions pays for one query row there). With
        ``scored_max`` too, a bound on any row's scored positions known before the data, they
        come as [b, scored_max, d_model]: each row's scored positions in order, then unscored ones
        as padding (:func:`scored_rows`; static shapes for a compiled step, no host sync).
        ``document_ids`` ([b, n] long): packed rows (the module docstring)."""
        ctx = self.context(input_ids, segment_ids, attention_mask, positions, document_ids)
        x = self.embed(input_ids, ctx)
        rows, valid = (None, None) if scored is None else scored_rows(scored, input_ids.shape, scored_max)
        for i, block in enumerate(self.blocks):
            x = block(x, ctx, rows=rows if i == len(self.blocks) - 1 else None)
        x = self.norm(x)
        return x if rows is None or scored_max is not None else x[valid]

    @torch.no_grad()
    def score_matrices(self, input_ids: Tensor, segment_ids: Tensor | None = None,
                       attention_mask: Tensor | None = None, document_ids: Tensor | None = None) -> list[Tensor]:
        """Pre-softmax attention scores [b, h, n, n] of every layer, position terms included."""
        ctx = self.context(input_ids, segment_ids, attention_mask, None, document_ids)
        x = self.embed(input_ids, ctx)
        out = []
        for block in self.blocks:
            out.append(block.attn.scores(block.ln1(x), ctx))
            x = block(x, ctx)
        return out

    def logits(self, h: Tensor) -> Tensor:
        return F.linear(h, self.tokens.weight) if self.cfg.tie_embeddings else self.head(h)

    def config_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.cfg.to_dict()}


class Decoder(Transformer):
    """Causal language model: ``Decoder(cfg)(input_ids) -> logits [b, n, vocab]``."""

    causal = True
    kind = "decoder"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if not cfg.tie_embeddings:
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_linear(self, cfg.init_std)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                positions: Tensor | None = None, scored: Tensor | None = None,
                document_ids: Tensor | None = None, scored_max: int | None = None) -> Tensor:
        """Logits [b, n, vocab]; with ``scored`` (bool [b, n]) only those rows, [k, vocab], as
        ``logits[scored]`` but without the vocabulary product, or the last layer's work, at the
        other positions (:meth:`hidden`; ``scored_max``: [b, scored_max, vocab], padded rows
        included); ``document_ids``: packed rows (the module docstring)."""
        return self.logits(self.hidden(input_ids, None, attention_mask, positions, scored, document_ids,
                                       scored_max))

    def decode(self, input_ids: Tensor, cache: Cache) -> Tensor:
        """Logits [b, m, vocab] of ``input_ids`` [b, m] continuing the prefix held in ``cache``
        (updated in place; start with an empty :class:`~posattn.attention.decode.KVCache`): the
        last m rows of ``self(prefix + input_ids)``, at O(prefix) cost per new token. Each row
        continues one document: a cache takes no packed rows (``document_ids``).
        PositionError naming the mechanisms that cannot decode incrementally."""
        blocked = blockers(self.mechanisms())
        if blocked:
            raise PositionError(f"{', '.join(blocked)}: cannot decode incrementally (see "
                                f"posattn.attention.decode); recompute the prefix with model(input_ids)")
        b, m = input_ids.shape
        start = cache.get_seq_length()
        ctx = self.context(input_ids, None, None, torch.arange(start, start + m, device=input_ids.device).expand(b, m))
        every = torch.arange(start + m, device=input_ids.device).expand(b, start + m)
        ctx_all = Context(positions=every, segments=torch.zeros_like(every), keep=None, causal=True)
        check_inputs(self.mechanisms(), ctx_all)
        x = self.embed(input_ids, ctx)
        for layer, block in enumerate(self.blocks):
            x = block(x, ctx, Step(ctx_all, cache, layer))
        return self.logits(self.norm(x))


class Encoder(Transformer):
    """Bidirectional encoder: ``Encoder(cfg)(input_ids, segment_ids, attention_mask) -> hidden``."""

    causal = False
    kind = "encoder"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d = cfg.d_model
        self.mlm_transform = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
        self.mlm_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        if not cfg.tie_embeddings:
            self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.n_classes:
            self.pooler = nn.Sequential(nn.Linear(d, d), nn.Tanh())
            self.classifier = nn.Linear(d, cfg.n_classes)
        init_linear(self, cfg.init_std)

    def forward(self, input_ids: Tensor, segment_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, positions: Tensor | None = None,
                scored: Tensor | None = None, document_ids: Tensor | None = None) -> Tensor:
        """Hidden states [b, n, d_model], or [k, d_model] at the ``scored`` rows (:meth:`hidden`);
        ``document_ids``: packed rows (the module docstring)."""
        return self.hidden(input_ids, segment_ids, attention_mask, positions, scored, document_ids)

    def mlm_logits(self, h: Tensor) -> Tensor:
        """Masked-LM logits [b, n, vocab] (BERT head, decoder tied to the token embeddings)."""
        return self.logits(self.mlm_transform(h)) + self.mlm_bias

    def classify(self, input_ids: Tensor, segment_ids: Tensor | None = None,
                 attention_mask: Tensor | None = None, positions: Tensor | None = None,
                 document_ids: Tensor | None = None) -> Tensor:
        """Sequence logits [b, n_classes] from the first token (BERT's [CLS] pooling):
        ``classifier(pooler(hidden(...)[:, 0]))``, with the last block computing only that row.
        With ``document_ids`` (packed rows) one row of logits per document, [D, n_classes], from
        each document's first token, in row-major order (a document that starts on padding is
        none)."""
        if not self.cfg.n_classes:
            raise PositionError("classify: this encoder was built with n_classes = 0")
        first = torch.zeros_like(input_ids, dtype=torch.bool)
        first[:, 0] = True
        if document_ids is not None:
            validated_documents(document_ids, input_ids.shape)
            first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
            if attention_mask is not None and attention_mask.shape == input_ids.shape:  # else hidden refuses it
                first &= attention_mask.bool()
        return self.classifier(self.pooler(self.hidden(input_ids, segment_ids, attention_mask, positions, first,
                                                       document_ids)))


MODEL_KINDS: dict[str, type[Transformer]] = {"encoder": Encoder, "decoder": Decoder}


def build_model(data: dict[str, Any]) -> Transformer:
    """Build from a dict (e.g. loaded YAML): ``{"kind": "encoder"|"decoder", **ModelConfig}``."""
    data = dict(data)
    kind = data.pop("kind", None)
    if kind not in MODEL_KINDS:
        raise PositionError(f"model kind must be one of {', '.join(MODEL_KINDS)}, got {kind!r}")
    return MODEL_KINDS[kind](ModelConfig.from_dict(data))
