"""posattn models as first-class ``transformers`` models.

:class:`PosattnConfig` (model_type ``"posattn"``) holds the checkpoint's ``kind`` and every
:class:`~posattn.models.config.ModelConfig` field; the model classes wrap the posattn
:class:`~posattn.models.transformer.Encoder` / :class:`~posattn.models.transformer.Decoder`
under the attribute ``posattn``, and are registered with the Auto classes on import:

    AutoModel                           -> PosattnModel (hidden states; encoder or decoder)
    AutoModelForMaskedLM                -> PosattnForMaskedLM (encoder)
    AutoModelForSequenceClassification  -> PosattnForSequenceClassification (encoder)
    AutoModelForCausalLM                -> PosattnForCausalLM (decoder, ``generate`` with a cache)

A folder written by :func:`posattn.save` (or ``posattn pretrain``) loads directly with
``from_pretrained``: its ``config.json`` carries ``model_type: "posattn"`` and its tensors are
the wrapped model's without the ``posattn.`` prefix, which ``transformers`` adds on load.
Folders written before ``model_type`` was stored convert with :func:`posattn.hf.convert`.
"""
from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    GenerationMixin,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import (
    BaseModelOutput,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    SequenceClassifierOutput,
)

from ..attention.decode import blockers
from ..errors import PositionError
from ..mechanisms import build
from ..models.config import ModelConfig
from ..models.transformer import MODEL_KINDS, Decoder, Encoder, Transformer

MODEL_FIELDS = [f.name for f in fields(ModelConfig)]
# transformers 5.24 renamed the outputs' cache field past_key_values -> cache (the old name warns)
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


class PosattnConfig(PreTrainedConfig):
    """``kind`` ("encoder" | "decoder") plus the :class:`ModelConfig` fields, as a transformers config.

    ``n_classes > 0`` sets ``num_labels`` unless labels are given; the standard names
    (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``max_position_embeddings``) read and write the posattn fields.
    """

    model_type = "posattn"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers",
                     "num_attention_heads": "n_heads", "max_position_embeddings": "max_len"}

    def __init__(self, kind: str = "encoder", **kwargs: Any) -> None:
        kwargs.pop("format", None)
        model = {k: kwargs.pop(k) for k in MODEL_FIELDS if k in kwargs}
        if kind not in MODEL_KINDS:
            raise PositionError(f"PosattnConfig: kind must be one of {', '.join(MODEL_KINDS)}, got {kind!r}")
        self.kind = kind
        for key, value in ModelConfig.from_dict(model).to_dict().items():
            setattr(self, key, value)
        if self.n_classes and "num_labels" not in kwargs and "id2label" not in kwargs:
            kwargs["num_labels"] = self.n_classes
        kwargs.setdefault("tie_word_embeddings", self.tie_embeddings)
        super().__init__(**kwargs)

    def model_config(self, **override: Any) -> ModelConfig:
        """The posattn :class:`ModelConfig` these fields describe (with ``override`` applied)."""
        return ModelConfig.from_dict({**{k: getattr(self, k) for k in MODEL_FIELDS}, **override})


def shared_parameters(model: nn.Module) -> dict[str, str]:
    """Each repeated name of a parameter shared by several layers (t5's bias by default) -> its
    first name: transformers saves it once and ties it again on load."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


class PosattnPreTrainedModel(PreTrainedModel):
    """Shared base: builds the wrapped posattn model and re-creates its initialisation
    (mechanism parameters keep the initialisation their constructor gives them)."""

    config_class = PosattnConfig
    base_model_prefix = "posattn"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    kind: str | None = None  # the checkpoint kind a head needs; None: either

    def __init__(self, config: PosattnConfig, **override: Any) -> None:
        super().__init__(config)
        if self.kind is not None and config.kind != self.kind:
            raise PositionError(f"{type(self).__name__} needs a posattn {self.kind} checkpoint, "
                                f"this one is a {config.kind}")
        self.posattn: Transformer = MODEL_KINDS[config.kind](config.model_config(**override))
        self._tied_weights_keys = shared_parameters(self)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """posattn's own initialisation (used by transformers for weights a checkpoint lacks)."""
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            if std is None:
                module.reset_parameters()
            else:
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        elif isinstance(module, Encoder):
            nn.init.zeros_(module.mlm_bias)
        if module._non_persistent_buffers_set:
            self._restore_buffers(module)

    def _restore_buffers(self, module: nn.Module) -> None:
        """Recompute the buffers no checkpoint holds (rope frequencies, alibi slopes) of one
        mechanism: transformers builds the model on the meta device and leaves them empty."""
        path = next(name for name, m in self.named_modules() if m is module).split(".")
        core = self.posattn
        with torch.device("cpu"):
            built = build(core.cfg.mechanisms, core.dims)
        if path[1] == "input_mechanisms":
            fresh = built.input[int(path[2])]
        else:  # posattn.blocks.<layer>.attn.mechanisms.<index>
            fresh = built.layers[int(path[2])][int(path[5])]
        for name in module._non_persistent_buffers_set:
            getattr(module, name).copy_(getattr(fresh, name))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.posattn.tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.posattn.tokens = value


def _keep(attention_mask: Tensor | None) -> Tensor | None:
    return None if attention_mask is None else attention_mask.bool()


class PosattnModel(PosattnPreTrainedModel):
    """Final hidden states of a posattn encoder or decoder (``last_hidden_state``)."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, position_ids: Tensor | None = None,
                document_ids: Tensor | None = None, **kwargs: Any) -> BaseModelOutput:
        """``document_ids`` ([b, n] long): packed rows, positions restart and no attention crosses
        a document (:mod:`posattn.models.transformer`)."""
        segments = token_type_ids if self.config.kind == "encoder" else None
        h = self.posattn.hidden(input_ids, segments, _keep(attention_mask), position_ids,
                                document_ids=document_ids)
        return BaseModelOutput(last_hidden_state=h)


class PosattnForMaskedLM(PosattnPreTrainedModel):
    """BERT-style masked LM (tied decoder): ``labels`` with −100 where no loss is taken."""

    kind = "encoder"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, position_ids: Tensor | None = None,
                labels: Tensor | None = None, document_ids: Tensor | None = None, **kwargs: Any) -> MaskedLMOutput:
        model: Encoder = self.posattn  # type: ignore[assignment]
        logits = model.mlm_logits(model.hidden(input_ids, token_type_ids, _keep(attention_mask), position_ids,
                                               document_ids=document_ids))
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)


class PosattnForSequenceClassification(PosattnPreTrainedModel):
    """[CLS]-pooled classifier with ``config.num_labels`` outputs (regression when 1)."""

    kind = "encoder"

    def __init__(self, config: PosattnConfig) -> None:
        super().__init__(config, n_classes=config.num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, position_ids: Tensor | None = None,
                labels: Tensor | None = None, document_ids: Tensor | None = None,
                **kwargs: Any) -> SequenceClassifierOutput:
        """With ``document_ids`` (packed rows) one row of logits per document, in order, and
        ``labels`` one per document."""
        model: Encoder = self.posattn  # type: ignore[assignment]
        logits = model.classify(input_ids, token_type_ids, _keep(attention_mask), position_ids, document_ids)
        loss = None
        if labels is not None:
            loss = (F.mse_loss(logits.squeeze(-1), labels.float()) if self.config.num_labels == 1
                    else F.cross_entropy(logits, labels))
        return SequenceClassifierOutput(loss=loss, logits=logits)


class PosattnForCausalLM(PosattnPreTrainedModel, GenerationMixin):
    """Causal LM; ``labels`` (usually ``input_ids``) are shifted inside, −100 ignored.

    ``generate`` decodes incrementally from a key/value cache (transformers' ``DynamicCache``,
    see :mod:`posattn.attention.decode`) when every mechanism allows it and the batch has no
    padding; otherwise it warns once and recomputes the whole prefix for every new token.
    """

    kind = "decoder"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None,
                cache: Any = None, use_cache: bool | None = None, past_key_values: Any = None,
                document_ids: Tensor | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        """With ``cache`` (``past_key_values`` before transformers 5.24), ``input_ids`` are the tokens
        after the cached prefix. ``document_ids`` ([b, n] long): packed rows (not with a cache)."""
        model: Decoder = self.posattn  # type: ignore[assignment]
        cache = cache if cache is not None else past_key_values
        if cache is not None and document_ids is not None:
            raise PositionError("document_ids: packed rows cannot continue from a key/value cache; "
                                "decode one document per row")
        if cache is not None:
            logits = model.decode(input_ids, cache)
        else:
            logits = model(input_ids, _keep(attention_mask), position_ids, document_ids=document_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    def prepare_inputs_for_generation(self, input_ids: Tensor, past_key_values: Any = None,
                                      attention_mask: Tensor | None = None, use_cache: bool | None = True,
                                      cache: Any = None, **kwargs: Any) -> dict[str, Any]:
        """The new tokens and the cache when decoding can be incremental, else the whole prefix.
        transformers ≥ 5.24 passes the cache as ``cache``, earlier 5.x as ``past_key_values``; it
        goes back under the name it came in."""
        name = "cache" if cache is not None else "past_key_values"
        cache = cache if cache is not None else past_key_values
        if cache is None or use_cache is False:
            return {"input_ids": input_ids, "attention_mask": attention_mask}
        blocked = blockers(self.posattn.mechanisms())
        padded = attention_mask is not None and not bool(attention_mask.all())
        if blocked or padded:
            if not getattr(self, "_warned_recompute", False):
                why = f"{', '.join(blocked)} cannot decode incrementally" if blocked else "the batch has padding"
                warnings.warn(f"posattn: {why}; generate recomputes the whole prefix for every token", stacklevel=2)
                self._warned_recompute = True
            return {"input_ids": input_ids, "attention_mask": attention_mask}
        return {"input_ids": input_ids[:, cache.get_seq_length():], name: cache}


AutoConfig.register("posattn", PosattnConfig, exist_ok=True)
for _auto, _cls in ((AutoModel, PosattnModel), (AutoModelForMaskedLM, PosattnForMaskedLM),
                    (AutoModelForSequenceClassification, PosattnForSequenceClassification),
                    (AutoModelForCausalLM, PosattnForCausalLM)):
    _auto.register(PosattnConfig, _cls, exist_ok=True)
