"""Hugging Face ``transformers`` integration (the optional extra ``posattn[hf]``).

- :mod:`.modeling`: posattn models as transformers models (``PosattnConfig``, Auto classes);
- :mod:`.tokenizer`: a posattn ``tokenizer.json`` as a transformers tokenizer;
- :mod:`.convert`: posattn checkpoint folders and model objects to and from transformers;
- :mod:`.retrofit`: posattn mechanisms added to a pretrained BERT-family model.
"""
from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    from ..errors import PositionError

    raise PositionError("posattn.hf needs transformers 5: pip install 'posattn[hf]'") from None

from .convert import convert, from_posattn
from .modeling import (
    PosattnConfig,
    PosattnForCausalLM,
    PosattnForMaskedLM,
    PosattnForSequenceClassification,
    PosattnModel,
    PosattnPreTrainedModel,
)
from .retrofit import add_mechanisms, load_retrofitted
from .tokenizer import hf_tokenizer

__all__ = ["PosattnConfig", "PosattnModel", "PosattnForMaskedLM", "PosattnForSequenceClassification",
           "PosattnForCausalLM", "PosattnPreTrainedModel", "add_mechanisms", "convert", "from_posattn", "hf_tokenizer",
           "load_retrofitted"]
