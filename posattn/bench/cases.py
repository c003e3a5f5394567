"""What gets measured: one *case* = a training step and an inference pass of one setup.

- ``layer``: a one-block model (token embedding, the mechanism's input part, pre-LN attention
  + MLP with d_ff = 4·d_model, final norm) on the fast path; baseline: the same model with
  ``none`` (plain SDPA, no position term).
- ``op``: the bare attention op on leaf q, k, v [b, h, n, d_h]: the mechanism's q/k/v
  transform, score terms, fast attention and output transform; baseline: plain
  ``scaled_dot_product_attention``. Input-only mechanisms have no op case.
- ``peer``: another library's layer of the same size (:mod:`.peers`).
- ``model``: a whole posattn or Hugging Face model's pretraining step (:mod:`.models`).

A training step is forward + backward of the mean square of the output (gradients set to
None first); inference is a forward under ``torch.no_grad``. Cases are described by plain
data (:class:`~.spec.CaseSpec`, :mod:`.spec`) so a memory-measuring child process can rebuild
them; :func:`make_case` builds any kind (model and peer cases in :mod:`.models`, :mod:`.peers`).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch

from ..attention import fast
from ..attention.layer import mix
from ..mechanisms import Context, Dims, build
from ..models import Decoder, Encoder, ModelConfig
from .models import model_case
from .peers import peer_case
from .spec import BASELINE, Case, CaseSpec, Sizes, record_paths, spec_label

__all__ = ["BASELINE", "Case", "CaseSpec", "Sizes", "make_case", "parse_mechanisms", "spec_label"]

def parse_mechanisms(text: str) -> list[Any]:
    """``t5``, ``cat+tisa``, or JSON (``[{"name": "tisa", "n_kernels": 3}]``) -> spec list."""
    text = text.strip()
    if text.startswith("[") or text.startswith("{"):
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    return [part.strip() for part in text.split("+") if part.strip()]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def layer_case(spec: CaseSpec, sizes: Sizes, record: bool = True) -> Case:
    mechanisms = ["none"] if spec.name == BASELINE else json.loads(spec.name)
    cfg = ModelConfig(vocab_size=sizes.vocab, d_model=sizes.d_model, n_layers=sizes.layers,
                      n_heads=sizes.heads, d_ff=sizes.ff, max_len=sizes.max_len, n_segments=2,
                      mechanisms=mechanisms, attn_path="fast", dropout=sizes.dropout)
    torch.manual_seed(0)
    model = (Decoder if sizes.causal else Encoder)(cfg).to(sizes.device, sizes.torch_dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, sizes.vocab, (sizes.batch, spec.n), generator=g).to(sizes.device)
    segments = torch.zeros_like(ids)
    segments[:, spec.n // 2:] = 1

    def forward() -> torch.Tensor:
        if sizes.causal:
            return model.hidden(ids)
        return model.hidden(ids, segments)

    def train() -> None:
        model.train(sizes.dropout > 0)  # training mode only for dropout (it changes the attention path)
        model.zero_grad(set_to_none=True)
        _loss(forward()).backward()

    def infer() -> None:
        model.eval()
        with torch.no_grad():
            forward()

    return Case(spec, train, infer, record_paths(train, infer) if record else "")


def op_case(spec: CaseSpec, sizes: Sizes, record: bool = True) -> Case | None:
    b, h, n, d = sizes.batch, sizes.heads, spec.n, sizes.head_dim
    g = torch.Generator().manual_seed(2)
    like = dict(device=sizes.device, dtype=sizes.torch_dtype)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(**like).requires_grad_() for _ in range(3))
    x = torch.randn(b, n, sizes.d_model, generator=g).to(**like).requires_grad_()
    if spec.name == BASELINE:
        def attention() -> torch.Tensor:
            return fast.sdpa(q, k, v, causal=sizes.causal)  # under the run's Policy.sdpa_backend
        mechs: list[Any] = []
    else:
        dims = Dims(sizes.d_model, h, 1, sizes.max_len, 2, sizes.causal)
        torch.manual_seed(0)
        built = build(json.loads(spec.name), dims)
        mechs = built.layers[0]
        if not mechs:
            return None
        for m in mechs:
            m.to(**like)
        positions = torch.arange(n, device=sizes.device).expand(b, n)
        segments = torch.zeros(b, n, dtype=torch.long, device=sizes.device)
        segments[:, n // 2:] = 1

        def attention() -> torch.Tensor:
            ctx = Context(positions=positions, segments=segments, keep=None, causal=sizes.causal, x=x)
            q2, k2, v2 = q, k, v
            for m in mechs:
                q2, k2, v2 = m.transform_qkv(q2, k2, v2, ctx)
            o = mix(mechs, q2, k2, v2, ctx, "fast")  # score terms, then softmax or the mixer
            for m in mechs:
                o = m.transform_output(o, v2, ctx)
            return o

    params = [p for m in mechs for p in m.parameters()]

    def train() -> None:
        for t in (q, k, v, x, *params):
            t.grad = None
        _loss(attention()).backward()

    def infer() -> None:
        with torch.no_grad():
            attention()

    return Case(spec, train, infer, record_paths(train, infer) if mechs and record else "sdpa")


def make_case(spec: CaseSpec, sizes: Sizes, record: bool = True) -> Case | None:
    """Build a case (None when it does not apply, e.g. the op case of an input mechanism);
    ``record``: run it once to record the fast-path algorithms it uses."""
    if spec.kind in ("layer", "op", "model") and spec.policy:
        case = make_case(replace(spec, policy=""), sizes, record=False)
        return None if case is None else _under_policy(case, spec, torch.device(sizes.device), record)
    if spec.kind == "layer":
        return layer_case(spec, sizes, record)
    if spec.kind == "op":
        return op_case(spec, sizes, record)
    if spec.kind == "model":
        return model_case(spec, sizes, record)
    return peer_case(spec, sizes)


def sizes_dict(sizes: Sizes) -> dict[str, Any]:
    return asdict(sizes)


def _under_policy(case: Case, spec: CaseSpec, device: torch.device, record: bool) -> Case:
    """``case`` with its steps run under the current fast-path policy plus ``spec.policy``."""
    overrides = json.loads(spec.policy)

    def under(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with fast.using(fast.policy_for(device, **overrides)):
                fn()
        return run

    train, infer = under(case.train), under(case.infer)
    return Case(spec, train, infer, record_paths(train, infer) if record else "")
