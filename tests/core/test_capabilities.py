"""What mechanisms declare for other packages matches what they build: the cost class (bench
targets) follows from their term structures and hooks, and only mechanisms that declare
``reads_layer_input`` need the layer's input x."""
from __future__ import annotations

import pytest
import torch

from posattn.attention.layer import mix
from posattn.attention.terms import Dense, LowRank, QueryRelative, RowNormalised, ScoreTransform, Toeplitz, TwoSided
from posattn.mechanisms import COST_CLASSES, REGISTRY, Context, Dims, build, cost_classes, names

DIMS = Dims(d_model=16, n_heads=2, n_layers=1, max_len=16, n_segments=2, causal=False)
N = 10


def built(name: str) -> list:
    torch.manual_seed(0)
    b = build([name], DIMS)
    return b.input or b.layers[0]


def context(x: torch.Tensor | None) -> Context:
    positions = torch.arange(N).expand(2, N)
    segments = (positions >= N // 2).long()
    return Context(positions=positions, segments=segments, keep=None, causal=False, x=x)


@pytest.mark.parametrize("name", names())
def test_cost_class_follows_from_what_the_mechanism_builds(name: str) -> None:
    cls = REGISTRY[name]
    assert cost_classes()[name] == cls.cost_class and cls.cost_class in COST_CLASSES
    (mech,) = built(name)
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 2, N, 8, generator=g) for _ in range(2))
    ctx = context(torch.randn(2, N, 16, generator=g))
    terms = [] if mech.placement == "input" else mech.score_terms(q, k, ctx)
    kinds = {type(t) for t in terms}
    learned = any(p.requires_grad for t in terms if isinstance(t, Toeplitz) for p in t.tensors())
    rank = sum(t.u.shape[-1] for t in terms if isinstance(t, LowRank))
    expected = {
        "none": not mech.acts_on,
        "input": mech.placement == "input",
        "rotation": not terms and set(mech.acts_on) == {"q", "k"},
        "fixed_bias": kinds == {Toeplitz} and not learned,
        "learned_table": kinds == {Toeplitz} and learned,
        "relative_embedding": QueryRelative in kinds,
        "data_dependent_bias": mech.reads_layer_input and bool(kinds) and kinds <= {LowRank, TwoSided, Dense},
        "narrow_low_rank": LowRank in kinds and rank < DIMS.head_dim,
        "wide_low_rank": LowRank in kinds and rank >= DIMS.head_dim,
        "convolution": not terms and not mech.mixes and set(mech.acts_on) <= {"q", "k", "v", "output"},
        "mixer": mech.mixes,
        "learned_function": RowNormalised in kinds,
        "score_transform": ScoreTransform in kinds,
    }
    assert expected[cls.cost_class], f"{name}: declared {cls.cost_class!r}, builds {kinds or 'no terms'}"


@pytest.mark.parametrize("name", [n for n in names() if not REGISTRY[n].reads_layer_input])
def test_only_mechanisms_that_declare_it_read_the_layer_input(name: str) -> None:
    mechs = built(name)
    ctx = context(None)  # no x: a hook that reads it fails
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, N, 8, generator=g) for _ in range(3))
    x = torch.randn(2, N, 16, generator=g)
    for m in mechs:
        if m.placement == "input":
            m.embed(x, ctx)
            continue
        q, k, v = m.transform_qkv(q, k, v, ctx)
    layer = [m for m in mechs if m.placement != "input"]
    o = mix(layer, q, k, v, ctx, "reference")
    for m in layer:
        o = m.transform_output(o, v, ctx)
    assert o.isfinite().all()
