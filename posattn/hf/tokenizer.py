"""A posattn ``tokenizer.json`` as a ``transformers`` tokenizer, for pipelines and the Trainer.

posattn's tokenizers have BERT's special tokens and no post-processor (posattn adds [CLS]/[SEP]
itself). transformers' tools expect the tokenizer to add them, so :func:`hf_tokenizer` sets
BERT's template ``[CLS] A [SEP]`` / ``[CLS] A [SEP] B [SEP]`` (segment 1 for B) by default;
with segment ids; ``template=False`` keeps bare ids and no segment ids (what a causal LM
generating text wants).
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from ..text.tokenizer import SPECIALS, load_tokenizer, special_ids

SPECIAL_NAMES = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIALS))


def hf_tokenizer(source: str | Path | Tokenizer, template: bool = True,
                 model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """Wrap a ``tokenizers`` tokenizer (object, ``tokenizer.json`` or a folder holding one)."""
    tok = source if isinstance(source, Tokenizer) else load_tokenizer(source)
    tok = Tokenizer.from_str(tok.to_str())  # a copy: the caller's tokenizer keeps no post-processor
    if template:
        ids = special_ids(tok)
        tok.post_processor = TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", ids.cls), ("[SEP]", ids.sep)])
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    names = ["input_ids", "token_type_ids", "attention_mask"] if template else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=names, **SPECIAL_NAMES, **extra)
