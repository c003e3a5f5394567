"""Position mechanisms, one module per family, looked up by name in :mod:`.registry`.

A model names its mechanisms as a list of specs: a name (``"tisa"``) or a dict with options
(``{"name": "tisa", "n_kernels": 3}``). :func:`build` turns the list into modules and refuses,
with one :class:`~posattn.errors.PositionError`, what it cannot honour.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Union

from torch import nn

from ..errors import PositionError

# Registration order is the order `posattn mechanisms` lists them in.
from . import (  # noqa: F401, I001  # noqa: F401, I001  (mixers: they replace softmax(s)·V)
    absolute,
    alibi,
    conv_bias,
    conv_layers,
    convbert,
    cope,
    dape,
    deberta,
    diet,
    dynamic_pos_bias,
    fire,
    forgetting,
    kerple,
    landmark,
    lincat,
    linformer,
    none,
    rope,
    sandwich,
    segment,
    t5,
    tisa,
    transformer_xl,
    tupe,
    xpos,
)
from .base import COST_CLASSES, Context, Dims, Mechanism, Structure, check_layer
from .registry import REGISTRY, get, names

SpecLike = Union[str, dict[str, Any], "Spec"]


@dataclass(frozen=True)
class Spec:
    """A mechanism name with its options."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: SpecLike) -> Spec:
        if isinstance(spec, Spec):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            opts = {k: v for k, v in spec.items() if k != "name"}
            return cls(spec["name"], opts)
        raise PositionError(f"a mechanism spec is a name or a dict with a 'name' key, got {spec!r}")

    def to_json(self) -> str | dict[str, Any]:
        return {"name": self.name, **self.options} if self.options else self.name


@dataclass
class Built:
    """The mechanisms of one model: input-level ones and one list per layer."""

    input: list[Mechanism]
    layers: list[list[Mechanism]]


def validate(specs: list[SpecLike], dims: Dims) -> list[Spec]:
    """Parse specs and check names, options and the combination; return the parsed specs."""
    parsed = [Spec.parse(s) for s in specs]
    seen: set[str] = set()
    for s in parsed:
        cls = get(s.name)
        unknown = sorted(set(s.options) - set(cls.option_names()))
        if unknown:
            raise PositionError(f"{s.name}: unknown option(s) {', '.join(unknown)}; valid options: "
                                f"{', '.join(cls.option_names()) or 'none'}")
        if s.name in seen:
            raise PositionError(f"{s.name}: listed twice; give it once with the options you want")
        seen.add(s.name)
    for i, s in enumerate(parsed):
        others = [o.name for j, o in enumerate(parsed) if j != i]
        cls = get(s.name)
        for o in others:
            both = cls.claims & REGISTRY[o].claims
            if both:
                raise PositionError(f"{s.name} and {o} both provide {', '.join(sorted(both))}; keep one")
        cls.validate(s.options, others, dims)
    transforms = [s.name for s in parsed if get(s.name).cost_class == "score_transform"]
    if len(transforms) > 1:
        raise PositionError(f"{transforms[0]} and {transforms[1]} both rewrite the attention scores (score "
                            f"transforms); a layer takes one")
    mixers = [s.name for s in parsed if get(s.name).mixes]
    if transforms and mixers:
        raise PositionError(f"{transforms[0]} rewrites the attention scores, but {mixers[0]} replaces softmax "
                            f"attention (a mixer); drop one of them")
    return parsed


def build(specs: list[SpecLike], dims: Dims) -> Built:
    """Instantiate the mechanisms: once for the input, per layer otherwise, or once for every
    layer where the mechanism shares its parameters across layers."""
    shared: dict[str, nn.Module] = {}
    built = Built(input=[], layers=[[] for _ in range(dims.n_layers)])
    for s in validate(specs, dims):
        cls = get(s.name)
        if cls.placement_for(s.options) == "input":
            built.input.append(cls(dims, shared, **s.options))
            continue
        one = cls(dims, shared, **s.options) if cls.layer_shared(s.options) else None
        for layer in built.layers:
            layer.append(one or cls(dims, shared, **s.options))
    for layer in built.layers:
        check_layer(layer)
    return built


def runs_in_decoder(spec: SpecLike, dims: Dims) -> bool:
    """Whether the mechanism accepts a causal model (Linformer-style mixers do not)."""
    try:
        validate([spec], replace(dims, causal=True))
    except PositionError:
        return False
    return True


def cost_classes() -> dict[str, str]:
    """Name -> cost class (a key of :data:`COST_CLASSES`) of every registered mechanism, at its
    default options, in registration order."""
    return {name: cls.cost_class for name, cls in REGISTRY.items()}


def length_scalings() -> tuple[str, ...]:
    """Every length-rescaling kind some registered mechanism accepts (:meth:`Mechanism.length_scaled`)."""
    return tuple(dict.fromkeys(k for cls in REGISTRY.values() for k in cls.length_scalings))


def with_length_scaling(specs: list[SpecLike], kind: str, factor: float, trained_len: int) -> list[Spec] | None:
    """The specs with every mechanism that can rescale for inputs ``factor`` times longer than
    ``trained_len`` rescaled by ``kind`` (e.g. rope with YaRN), the others as they are; None
    when no mechanism in the list can."""
    parsed = [Spec.parse(s) for s in specs]
    scaled = [get(s.name).length_scaled(s.options, kind, factor, trained_len) for s in parsed]
    if all(o is None for o in scaled):
        return None
    return [s if o is None else Spec(s.name, o) for s, o in zip(parsed, scaled)]


def properties(spec: SpecLike, dims: Dims) -> dict[str, Any]:
    """What ``posattn mechanisms`` reports for one mechanism, computed from the built modules
    (an encoder-only mechanism is counted as built for an encoder)."""
    s = Spec.parse(spec)
    decoder = runs_in_decoder(s, dims)
    built = build([s], dims if decoder else replace(dims, causal=False))
    mechs = built.input or list({id(m): m for layer in built.layers for m in layer}.values())
    params = {id(p): p.numel() for m in mechs for p in m.parameters()}
    first = mechs[0]
    return {
        "name": s.name,
        "acts_on": list(first.acts_on),
        "inductive": first.inductive,
        "translation_invariant": first.translation_invariant,
        "decoder": decoder,
        "positional_params": sum(params.values()),
        "paper": first.paper,
        "equation": first.equation,
    }


__all__ = ["properties", "runs_in_decoder", "Built", "COST_CLASSES", "Context", "Dims", "Mechanism", "Spec",
           "Structure", "build", "cost_classes", "get", "length_scalings", "names", "validate", "with_length_scaling",
           "REGISTRY"]
