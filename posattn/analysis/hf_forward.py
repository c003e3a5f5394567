"""Pre-softmax attention scores of a Hugging Face checkpoint, from a real forward pass.

Needs the optional extra ``posattn[hf]`` (``transformers``), imported here only. The model is
loaded from the local folder (``HF_HUB_OFFLINE=1``, ``local_files_only``) in float64; forward hooks
on every layer's query and key projections capture q and k, and the score of head h is
q_i·k_j/√d_h, plus MPNet's relative attention bias where the model has one.
"""
from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from .hf import CheckpointError, HFCheckpoint


def _transformers():  # noqa: ANN202 - the module
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise CheckpointError(
            "this analysis runs the Hugging Face model and needs the optional extra: pip install 'posattn[hf]'"
        ) from None
    return transformers


@torch.no_grad()
def hf_scores(
    ckpt: HFCheckpoint,
    input_ids: Tensor | None = None,
    inputs_embeds: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> list[Tensor]:
    """Per-layer pre-softmax scores ``[b, h, n, n]`` (no padding mask applied) of the HF model."""
    tf = _transformers()
    q_t, k_t, _ = ckpt.layout()
    model = tf.AutoModel.from_pretrained(ckpt.folder, local_files_only=True).to(torch.float64).eval()
    modules = dict(model.named_modules())
    captured: dict[str, Tensor] = {}
    handles = []
    for layer in range(ckpt.n_layers):
        for tmpl in (q_t, k_t):
            name = tmpl.format(l=layer)
            if name not in modules:
                raise CheckpointError(f"{ckpt.folder}: the loaded model has no module {name!r}")
            handles.append(modules[name].register_forward_hook(
                lambda _m, _i, out, name=name: captured.__setitem__(name, out)))
    try:
        embeds = None if inputs_embeds is None else inputs_embeds.to(torch.float64)
        model(input_ids=input_ids, inputs_embeds=embeds, attention_mask=attention_mask)
    finally:
        for h in handles:
            h.remove()
    h, dh = ckpt.n_heads, ckpt.head_dim
    out = []
    for layer in range(ckpt.n_layers):
        q, k = captured[q_t.format(l=layer)], captured[k_t.format(l=layer)]
        b, n, _ = q.shape
        q = q.view(b, n, h, dh).transpose(1, 2)
        k = k.view(b, n, h, dh).transpose(1, 2)
        s = q @ k.transpose(-1, -2) / math.sqrt(dh)
        bias = ckpt.relative_bias(n)
        out.append(s if bias is None else s + bias)
    return out
