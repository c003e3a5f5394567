"""Peer implementations of the same layer, benchmarked in the same run when installed.

- Hugging Face ``transformers`` 4.x BERT, one layer, ``position_embedding_type=
  "relative_key_query"`` (Shaw/Huang relative keys on both the query and the key side; eager
  attention, which these types require; skipped with a message under transformers 5, which
  removed it), and BERT with absolute positions for reference;
- ``x-transformers`` encoder/decoder, one layer, with its T5 relative bias and with ALiBi.

Each peer is matched with the posattn mechanism it should be compared with (``MATCH``).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from .spec import Case, CaseSpec, Sizes

# peer -> posattn mechanism list it is compared with
MATCH: dict[str, list[Any]] = {
    "hf_bert_relative_key_query": ["dynamic_conv", "key_dynamic_conv"],
    "hf_bert_absolute": ["absolute"],
    "xt_t5": ["t5"],
    "xt_alibi": ["alibi"],
}
REQUIRES = {"hf_bert_relative_key_query": "transformers", "hf_bert_absolute": "transformers",
            "xt_t5": "x_transformers", "xt_alibi": "x_transformers"}
# peers that exist only below a major version of their library: (major, why)
BELOW_MAJOR = {"hf_bert_relative_key_query": (5, "transformers 5 removed BERT's relative position "
                                                 "embeddings (position_embedding_type is ignored)")}


def _major(module: str) -> int:
    from importlib.metadata import version

    return int(version(module.replace("_", "-")).split(".")[0])


def skipped() -> dict[str, str]:
    """Installed-library peers that cannot run with the installed version, and why."""
    out = {}
    for peer, (major, why) in BELOW_MAJOR.items():
        mod = REQUIRES[peer]
        if importlib.util.find_spec(mod) is not None and _major(mod) >= major:
            out[peer] = f"skipped: needs {mod} < {major}; {why}"
    return out


def available() -> list[str]:
    """The peers whose library is installed in a version that has them."""
    skip = skipped()
    return [p for p, mod in REQUIRES.items() if importlib.util.find_spec(mod) is not None and p not in skip]


Forward = Callable[[torch.Tensor], torch.Tensor]


def _hf_bert(kind: str, sizes: Sizes, n: int) -> tuple[torch.nn.Module, Forward]:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=sizes.vocab, hidden_size=sizes.d_model, num_hidden_layers=1,
                     num_attention_heads=sizes.heads, intermediate_size=4 * sizes.d_model,
                     max_position_embeddings=max(n, sizes.max_len), position_embedding_type=kind,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     is_decoder=sizes.causal, attn_implementation="eager")
    model = BertModel(cfg, add_pooling_layer=False).eval()
    return model, lambda ids: model(input_ids=ids).last_hidden_state


def _xt(position_option: str, sizes: Sizes, n: int) -> tuple[torch.nn.Module, Forward]:
    """An x-transformers layer with its position option ``position_option`` switched on."""
    from x_transformers import Decoder, Encoder, TransformerWrapper

    layers = (Decoder if sizes.causal else Encoder)(
        dim=sizes.d_model, depth=1, heads=sizes.heads, attn_dim_head=sizes.head_dim,
        **{position_option: True})
    model = TransformerWrapper(num_tokens=sizes.vocab, max_seq_len=max(n, sizes.max_len),
                               attn_layers=layers, use_abs_pos_emb=False).eval()
    return model, lambda ids: model(ids, return_embeddings=True)


def peer_case(spec: CaseSpec, sizes: Sizes) -> Case:
    torch.manual_seed(0)
    builders = {
        "hf_bert_relative_key_query": lambda: _hf_bert("relative_key_query", sizes, spec.n),
        "hf_bert_absolute": lambda: _hf_bert("absolute", sizes, spec.n),
        "xt_t5": lambda: _xt("rel_pos_bias", sizes, spec.n),
        "xt_alibi": lambda: _xt("alibi_pos_bias", sizes, spec.n),
    }
    model, forward = builders[spec.name]()
    model.to(sizes.device, sizes.torch_dtype)
    ids = torch.randint(0, sizes.vocab, (sizes.batch, spec.n), generator=torch.Generator().manual_seed(1))
    ids = ids.to(sizes.device)

    def train() -> None:
        model.zero_grad(set_to_none=True)
        forward(ids).float().pow(2).mean().backward()

    def infer() -> None:
        with torch.no_grad():
            forward(ids)

    return Case(spec, train, infer, "peer")
