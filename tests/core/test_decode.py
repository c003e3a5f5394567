"""Cached (incremental) decoding equals recomputing the prefix, for every mechanism that allows it."""
from __future__ import annotations

import pytest
import torch

from posattn import Decoder, ModelConfig, PositionError
from posattn.attention.decode import KVCache, blockers, mode
from posattn.attention.terms import Dense, LowRank, QueryRelative, Toeplitz
from posattn.mechanisms import names

CANNOT = {"depthwise_conv", "conv_qkv", "forgetting"}  # output transform; conv of, or gates from, the layer input


def decoder(mechanisms: list) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=30, d_model=16, n_heads=2, n_layers=2, max_len=32,
                                mechanisms=mechanisms)).eval()
    with torch.no_grad():  # move every parameter off its (often symmetric or zero) initialisation
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def decoder_mechanisms() -> list[str]:
    ok = []
    for name in names():
        try:
            decoder([name])
        except PositionError:
            continue  # an encoder-only mechanism
        ok.append(name)
    return ok


@pytest.mark.parametrize("name", decoder_mechanisms())
def test_cached_decoding_equals_recompute(name):
    model = decoder([name])
    ids = torch.randint(0, 30, (2, 13), generator=torch.Generator().manual_seed(1))
    if blockers(model.mechanisms()):
        assert name in CANNOT or any(getattr(m, "mixes", False) for m in model.mechanisms())
        with pytest.raises(PositionError, match="cannot decode incrementally"):
            model.decode(ids, KVCache())
        return
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        parts = [model.decode(ids[:, :5], cache)]  # a prompt, then one token at a time
        parts += [model.decode(ids[:, t:t + 1], cache) for t in range(5, 12)]
        parts.append(model.decode(ids[:, 12:], cache))
    assert cache.get_seq_length() == 13
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=2e-6, rtol=1e-5)


def test_the_modes_are_what_the_mechanisms_need():
    modes = {name: {mode(m) for m in decoder([name]).mechanisms()} for name in decoder_mechanisms()}
    assert modes["rope"] == {"rows"} and modes["cat"] == {"prefix"} and modes["tisa"] == {"rows"}
    assert modes["depthwise_conv"] == {None} and modes["conv_qkv"] == {None}


def test_term_rows_are_rows_of_the_dense_term():
    g = torch.Generator().manual_seed(0)
    n, start = 7, 4
    q = torch.randn(2, 3, n, 5, generator=g)
    terms = [Toeplitz(torch.randn(3, 2 * n - 1, generator=g)),
             LowRank(torch.randn(1, 3, n, 2, generator=g), torch.randn(1, 3, n, 2, generator=g)),
             QueryRelative(q, torch.randn(5, 5, generator=g), 2, 0.5),
             QueryRelative(q, torch.randn(3, 5, 5, generator=g), 2, 0.5, key_side=True),
             Dense(torch.randn(2, 3, n, n, generator=g))]
    for t in terms:
        torch.testing.assert_close(t.rows(torch.arange(start, n)[None], n), t.dense(n)[..., start:, :])
    rows_only = QueryRelative(q[..., start:, :], terms[2].weight, 2, 0.5)  # q of the new rows only
    torch.testing.assert_close(rows_only.rows(torch.arange(start, n)[None], n), terms[2].dense(n)[..., start:, :])


def test_decoding_past_max_len_is_refused_for_absolute():
    model = decoder(["absolute"])
    cache = KVCache()
    model.decode(torch.zeros(1, 32, dtype=torch.long), cache)
    with pytest.raises(PositionError, match="needs 33 positions"):
        model.decode(torch.zeros(1, 1, dtype=torch.long), cache)
