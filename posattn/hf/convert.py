"""posattn models and checkpoint folders to transformers models and folders.

A folder written by :func:`posattn.save` loads directly with ``AutoModel*.from_pretrained``
(its ``config.json`` names ``model_type: "posattn"``). :func:`convert` rewrites any posattn
checkpoint folder (also one written before ``model_type`` was stored) as a transformers folder,
with its ``tokenizer.json`` wrapped for pipelines when there is one.
"""
from __future__ import annotations

from pathlib import Path

from ..models import Transformer, load
from ..models.transformer import Encoder
from ..text.tokenizer import FILENAME
from .modeling import PosattnConfig, PosattnForCausalLM, PosattnForMaskedLM, PosattnPreTrainedModel
from .tokenizer import hf_tokenizer


def from_posattn(model: Transformer) -> PosattnPreTrainedModel:
    """The transformers model (masked LM for an encoder, causal LM for a decoder) that wraps
    ``model`` itself: its parameters are shared, not copied."""
    config = PosattnConfig(**model.config_dict())
    cls = PosattnForMaskedLM if isinstance(model, Encoder) else PosattnForCausalLM
    wrapped = cls(config)
    wrapped.posattn = model
    return wrapped


def convert(folder: str | Path, out: str | Path) -> Path:
    """Write the posattn checkpoint in ``folder`` to ``out`` with ``save_pretrained`` (and its
    tokenizer, BERT template added for an encoder); return ``out``."""
    folder, out = Path(folder), Path(out)
    model = from_posattn(load(folder))
    model.save_pretrained(out)
    if (folder / FILENAME).is_file():
        hf_tokenizer(folder, template=model.config.kind == "encoder").save_pretrained(out)
    return out
