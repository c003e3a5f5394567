"""Whole models against Hugging Face ``transformers`` (``posattn bench --models``).

A *model case* is one pretraining step of a whole model: forward, loss, backward and an AdamW
step (the optimizer state is allocated before timing), at the shape of :class:`~.cases.Sizes`
(default in :data:`MODEL_SIZES`: 12 layers, hidden 256, 4 heads, FFN 1024, BERT's vocabulary,
dropout 0.1 everywhere as in BERT pretraining). Pairs compared in the same run (:data:`PAIRS`):

- posattn :class:`~posattn.models.Encoder` with ``absolute``, MLM head (transform + decoder
  tied to the token embeddings + bias), cross-entropy on 15% of the positions, against
  ``BertForMaskedLM`` (sdpa attention) with the same sizes, dropout, tied decoder and head.
  ``posattn_encoder`` computes what BERT computes (logits at every position);
  ``posattn_mlm`` is the same model trained as ``posattn pretrain`` trains it
  (:class:`~posattn.pretrain.objective.MaskedLM`: the last block, the head and the logits only at
  the masked positions), the same loss up to rounding for less work;
- posattn :class:`~posattn.models.Decoder` with ``rope`` (all channels rotated, base 10⁴,
  tied embeddings), next-token loss, against ``GPTNeoXForCausalLM`` configured to match
  (sequential residual, rotary on every channel, GELU MLP with biases, tied embeddings) and
  ``LlamaForCausalLM`` (RMSNorm, SwiGLU: its MLP has 3 matrices of the FFN width, not 2).

Architectural differences that remain (none changes the arithmetic by more than a LayerNorm):
posattn blocks are pre-LN with a final norm; BERT is post-LN with an embedding LayerNorm and
adds a token-type embedding. Each posattn model's loss has its Hugging Face peer's precision:
``posattn_encoder`` takes the cross-entropy on the logits in the model's dtype, as
``BertForMaskedLM`` does; ``posattn_decoder`` upcasts the logits to fp32, as the causal-LM loss
of GPT-NeoX and Llama does (``ForCausalLMLoss``); ``posattn_mlm`` computes its loss as posattn's
pretraining objective does (fp32, the masked rows only). Until 2026-11-27 ``posattn_encoder``
upcast too: in bf16 at BERT-base's vocabulary, n 512 and batch 32 its profiled H100 step (52.2
ms against BERT's 44.2) spent 4.7 ms in the fp32 log-softmax, forward and backward (BERT 2.3 in
bf16), and 4.0 ms in copies (18 calls, the logits' fp32 copy and its gradient's among them).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..models import Decoder, Encoder, ModelConfig
from ..pretrain.data import Batch
from ..pretrain.objective import MaskedLM
from .spec import Case, CaseSpec, Sizes, record_paths, without_arm

MODEL_SIZES = Sizes(heads=4, head_dim=64, batch=32, vocab=30522, layers=12, d_ff=1024, dropout=0.1,
                    max_len=512)
MODEL_LENGTHS = [128]
MASK_FRACTION = 0.15
# (posattn model, Hugging Face model it is compared with)
PAIRS: list[tuple[str, str]] = [("posattn_encoder", "hf_bert"), ("posattn_mlm", "hf_bert"),
                                ("posattn_decoder", "hf_gpt_neox"), ("posattn_decoder", "hf_llama")]
DEFAULT_MECHANISMS = {"posattn_encoder": ["absolute"], "posattn_mlm": ["absolute"], "posattn_decoder": ["rope"]}

Loss = Callable[[], torch.Tensor]


def model_name(kind: str, mechanisms: list[Any] | None = None) -> str:
    """CaseSpec name of a posattn model: ``posattn_encoder`` (default mechanisms) or JSON."""
    if mechanisms is None or mechanisms == DEFAULT_MECHANISMS[kind]:
        return kind
    return json.dumps([kind, mechanisms])


def _parse(name: str) -> tuple[str, list[Any]]:
    if name.startswith("["):
        kind, mechs = json.loads(name)
        return kind, mechs
    return name, DEFAULT_MECHANISMS.get(name, [])


def _batch(sizes: Sizes, n: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels: next tokens (causal) or 15% masked positions (−100 elsewhere)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, sizes.vocab, (sizes.batch, n), generator=g)
    labels = ids.clone()
    if not causal:
        labels[torch.rand(ids.shape, generator=g) >= MASK_FRACTION] = -100
    return ids.to(sizes.device), labels.to(sizes.device)


def _next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Labels shifted left by one, −100 at the end: the loss needs no shifted copy of the
    logits (as in Hugging Face's causal-LM loss)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def _posattn(kind: str, mechanisms: list[Any], sizes: Sizes, n: int) -> tuple[torch.nn.Module, Loss]:
    cfg = ModelConfig(vocab_size=sizes.vocab, d_model=sizes.d_model, n_layers=sizes.layers,
                      n_heads=sizes.heads, d_ff=sizes.ff, max_len=max(n, sizes.max_len),
                      mechanisms=mechanisms, dropout=sizes.dropout, attn_path="fast",
                      tie_embeddings=True, init_std=0.02)
    causal = kind == "posattn_decoder"
    model = (Decoder if causal else Encoder)(cfg)
    ids, labels = _batch(sizes, n, causal)
    if causal:
        labels = _next_tokens(labels)
    if kind == "posattn_mlm":
        objective = MaskedLM(model)
        batch = Batch(ids, labels, torch.zeros_like(ids), torch.ones_like(ids, dtype=torch.bool))
        return model, lambda: objective(batch)[0] / (labels != -100).sum()

    def loss() -> torch.Tensor:
        logits = model(ids) if causal else model.mlm_logits(model(ids))
        logits = logits.view(-1, sizes.vocab)
        return F.cross_entropy(logits.float() if causal else logits, labels.view(-1), ignore_index=-100)

    return model, loss


def _hf(name: str, sizes: Sizes, n: int) -> tuple[torch.nn.Module, Loss]:
    import transformers as tf

    common = dict(vocab_size=sizes.vocab, hidden_size=sizes.d_model, num_hidden_layers=sizes.layers,
                  num_attention_heads=sizes.heads, intermediate_size=sizes.ff,
                  max_position_embeddings=max(n, sizes.max_len), tie_word_embeddings=True)
    if name == "hf_bert":
        cfg = tf.BertConfig(**common, hidden_act="gelu", hidden_dropout_prob=sizes.dropout,
                            attention_probs_dropout_prob=sizes.dropout)
        model = tf.BertForMaskedLM(cfg)
    elif name == "hf_gpt_neox":
        cfg = tf.GPTNeoXConfig(**common, hidden_act="gelu", use_parallel_residual=False,
                               attention_bias=True, hidden_dropout=sizes.dropout,
                               attention_dropout=sizes.dropout, use_cache=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 1.0})
        model = tf.GPTNeoXForCausalLM(cfg)
    else:
        cfg = tf.LlamaConfig(**common, attention_dropout=sizes.dropout, use_cache=False)
        model = tf.LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    ids, labels = _batch(sizes, n, name != "hf_bert")
    return model, lambda: model(input_ids=ids, labels=labels).loss


HF_MODELS = ("hf_bert", "hf_gpt_neox", "hf_llama")


def model_case(spec: CaseSpec, sizes: Sizes, record: bool = True) -> Case:
    """One whole-model pretraining step (and an inference forward) as a bench case."""
    torch.manual_seed(0)
    kind, mechanisms = _parse(spec.name)
    if kind in HF_MODELS:
        model, loss = _hf(kind, sizes, spec.n)
    else:
        model, loss = _posattn(kind, mechanisms, sizes, spec.n)
    model.to(sizes.device, sizes.torch_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train() -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()

    def infer() -> None:
        model.eval()
        with torch.no_grad():
            loss()

    train()  # AdamW allocates its state on the first step: keep it out of timing and memory
    path = record_paths(train, infer) if record and kind not in HF_MODELS else "hf (sdpa)" * (kind in HF_MODELS)
    return Case(spec, train, infer, path)


def model_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add tokens/s, and per posattn model its speed and memory against each HF model it is
    paired with (``vs``: HF step time ÷ ours, > 1 = posattn faster)."""
    by = {(r["mechanism"], r["n"], r["batch"]): r for r in rows}
    for r in rows:
        if r.get("train_ms"):
            r["tokens_per_s"] = r["batch"] * r["n"] / (r["train_ms"] / 1e3)
    out = []
    for r in rows:
        kind = without_arm(r["mechanism"]).split("(")[0]  # "posattn_decoder(t5) [...]" -> "posattn_decoder"
        r = dict(r)
        peers = [hf for ours, hf in PAIRS if ours == kind]
        for hf in peers:
            other = by.get((hf, r["n"], r["batch"]))
            if other and other.get("train_ms") and r.get("train_ms"):
                r[f"speed_vs_{hf}"] = other["train_ms"] / r["train_ms"]
            if other and other.get("peak_mem_mb") and r.get("peak_mem_mb"):
                r[f"mem_vs_{hf}"] = r["peak_mem_mb"] / other["peak_mem_mb"]
        out.append(r)
    return out
