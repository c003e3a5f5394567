"""A bench case as plain data, and what running it records.

:class:`CaseSpec` names a case (kind, mechanism list or peer or model name, length) so that a
memory-measuring child process can rebuild it; :class:`Sizes` is the shape every case shares;
:class:`Case` holds its training step and inference pass; :func:`record_paths` notes the
fast-path algorithms they take. :mod:`.cases` builds layer and op cases, :mod:`.models` and
:mod:`.peers` the model and peer cases, all from these types.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..attention import fast
from ..mechanisms import Spec

BASELINE = "sdpa"


@dataclass(frozen=True)
class Sizes:
    """The shared size of every case."""

    heads: int = 4
    head_dim: int = 64
    batch: int = 1
    causal: bool = False
    vocab: int = 256
    max_len: int = 4096
    layers: int = 1  # blocks (layer cases: 1; model cases: 12)
    d_ff: int | None = None  # None: 4·d_model
    dropout: float = 0.0  # every dropout of the model (training steps)
    device: str = "cpu"
    dtype: str = "float32"  # "bfloat16" / "float16": model and inputs in that precision

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    @property
    def ff(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class CaseSpec:
    """Plain-data description of a case: kind, mechanism list (JSON) or peer name, length."""

    kind: str  # "layer" | "op" | "peer" | "model"
    name: str  # mechanism list as JSON, "sdpa", a peer name, or a model name (:mod:`.models`)
    n: int
    policy: str = ""  # JSON of fast-path Policy fields this case runs under, over the run's (``--ab``)

    @property
    def label(self) -> str:
        if self.policy:
            return f"{replace(self, policy='').label} [{fields_text(json.loads(self.policy), ',')}]"
        if self.kind == "model" and self.name.startswith("["):
            kind, mechanisms = json.loads(self.name)
            return f"{kind}({spec_label(mechanisms)})"
        if self.kind in ("peer", "model") or self.name == BASELINE:
            return self.name
        return spec_label(json.loads(self.name))


def without_arm(label: str) -> str:
    """A case label without the `` [field=value,...]`` of an A/B arm (:attr:`CaseSpec.label`):
    ``posattn_encoder(alibi) [sdpa_backend=cudnn]`` -> ``posattn_encoder(alibi)``."""
    return label.split(" [")[0]


@dataclass
class Case:
    spec: CaseSpec
    train: Callable[[], None]
    infer: Callable[[], None]
    path: str = ""  # the fast-path algorithm(s) the attention used: "train path / inference path"


def fields_text(fields: dict[str, Any], sep: str = " ") -> str:
    """``{"use_flex": False, "relative_bias": "skew"}`` -> ``use_flex=False relative_bias=skew``
    (a label's options and overrides: ``sep=","``; "" for none)."""
    return sep.join(f"{k}={v}" for k, v in fields.items())


def spec_label(specs: list[Any]) -> str:
    """``t5``, ``tisa(n_kernels=3)``, ``cat+tisa``."""
    out = []
    for s in specs:
        p = Spec.parse(s)
        opts = fields_text(p.options, ",")
        out.append(f"{p.name}({opts})" if opts else p.name)
    return "+".join(out)


def record_paths(train: Callable[[], None], infer: Callable[[], None]) -> str:
    """Run a training step and an inference pass, returning the fast-path algorithms
    :func:`fast.plan` chose for each ("train / infer" when they differ)."""
    return " / ".join(dict.fromkeys(_plans(f) for f in (train, infer)))


def _plans(fn: Callable[[], None]) -> str:
    chosen: list[str] = []
    real = fast.plan

    def spy(*args: Any, **kwargs: Any) -> str:
        path = real(*args, **kwargs)
        chosen.append(path)
        return path

    fast.plan = spy  # type: ignore[assignment]
    try:
        fn()
    finally:
        fast.plan = real  # type: ignore[assignment]
    return "+".join(sorted(set(chosen)))
