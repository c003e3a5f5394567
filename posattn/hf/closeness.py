"""How close a retrofitted encoder starts to the pretrained one (TISA App. C's question).

    posattn study closeness [--model minilm] [--kernels 5] [--positions 128] [--out DIR]

On held-out BBC News articles (``posattn.text.sources``: the documents no pretraining run sees),
each truncated to ``max_tokens`` word pieces with [CLS]/[SEP], it compares the pretrained model's
outputs with those of each variant:

- ``supplement, a = 0``: TISA added with zero kernels (must be identical: a sanity check);
- ``replace, no TISA``: position embeddings removed (mean folded into the words), nothing in
  their place: what position information alone is worth;
- ``replace, TISA fit (embedding)`` / ``(forward)``: position embeddings removed and TISA kernels
  regressed on the model's own F̂_P (``posattn analyze fit-tisa``, either method).

Metrics: the cosine of the mean-pooled sentence embeddings (all-MiniLM-L6-v2's pooling), the
mean cosine of the token states, and, for scale, the mean cosine between the pretrained
embeddings of *different* articles. Writes ``closeness.json`` to ``--out``.
"""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer, PreTrainedModel

from ..analysis.hf import resolve
from ..text.sources import bbc, split_of
from .retrofit import add_mechanisms, fit_kernels


def heldout_texts(limit: int) -> list[str]:
    """Up to ``limit`` held-out BBC articles (stable order)."""
    docs = sorted((d for d in bbc() if split_of(d) == "heldout"), key=lambda d: d.id)
    return [d.text for d in docs[:limit]]


@torch.no_grad()
def encode(model: PreTrainedModel, batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Mean-pooled, normalised sentence embeddings [N, d] and each batch's token states."""
    sentences, tokens = [], []
    for batch in batches:
        h = model(**batch).last_hidden_state
        m = batch["attention_mask"][..., None].to(h.dtype)
        sentences.append(F.normalize((h * m).sum(1) / m.sum(1), dim=-1))
        tokens.append(h)
    return torch.cat(sentences), tokens


def compare(ref: tuple[torch.Tensor, list[torch.Tensor]], other: tuple[torch.Tensor, list[torch.Tensor]],
            batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    sent = (ref[0] * other[0]).sum(-1)
    tok = torch.cat([F.cosine_similarity(a, b, dim=-1)[batch["attention_mask"].bool()]
                     for a, b, batch in zip(ref[1], other[1], batches)])
    return {"sentence_cosine_mean": round(float(sent.mean()), 4), "sentence_cosine_min": round(float(sent.min()), 4),
            "token_cosine_mean": round(float(tok.mean()), 4)}


def closeness(model: str = "minilm", n_kernels: int = 5, positions: int = 128, max_tokens: int = 128,
              n_texts: int = 96, batch_size: int = 16) -> dict[str, Any]:
    """The report described in the module docstring (a dict)."""
    folder = resolve(model)
    tok = AutoTokenizer.from_pretrained(folder)
    texts = heldout_texts(n_texts)
    batches = [dict(tok(texts[i:i + batch_size], truncation=True, max_length=max_tokens, padding=True,
                        return_tensors="pt")) for i in range(0, len(texts), batch_size)]
    base = AutoModel.from_pretrained(folder).eval()
    ref = encode(base, batches)
    emb = ref[0]
    pairs = emb @ emb.T
    off = pairs[~torch.eye(len(emb), dtype=torch.bool)]
    report: dict[str, Any] = {"model": str(folder), "texts": f"{len(texts)} held-out BBC News articles",
                              "max_tokens": max_tokens, "n_kernels": n_kernels, "fit_positions": positions,
                              "different_articles_sentence_cosine_mean": round(float(off.mean()), 4),
                              "variants": {}}
    variants = {"supplement, a = 0": ("supplement", "zero"), "replace, no TISA": ("replace", "zero"),
                "replace, TISA fit (embedding)": ("replace", "embedding"),
                "replace, TISA fit (forward)": ("replace", "forward")}
    for name, (mode, init) in tqdm(variants.items(), desc="variants"):
        fit = fit_kernels(folder, n_kernels, positions, method=init) if init != "zero" else "zero"
        retro = add_mechanisms(copy.deepcopy(base), [{"name": "tisa", "n_kernels": n_kernels}], mode=mode, init=fit)
        report["variants"][name] = compare(ref, encode(retro, batches), batches)
        if init != "zero":
            report["variants"][name]["fit_r2_median"] = round(float(np.median(fit.r2)), 4)
    return report
