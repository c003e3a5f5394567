"""Packed sequences (``document_ids``): a packed batch gives the outputs and the gradients (to the
embedded input and to every parameter) of its documents run one by one, for every registered
mechanism, encoder and decoder, on the reference and the fast path; positions restart at each
document, no token sees another document, and bad document ids are refused."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from posattn.errors import PositionError
from posattn.mechanisms import names, validate
from posattn.mechanisms.base import document_lengths, document_positions
from posattn.models import Decoder, Encoder

from .helpers import dims, model, spec_id, tokens

D_MODEL, HEADS, LAYERS, MAX_LEN = 32, 2, 2, 24
B, N = 3, 12
# document lengths per row: unequal, 2 or 3 per row; the last row ends in 2 padding tokens
LENGTHS = [[5, 7], [3, 4, 5], [6, 4]]
PADDING = 2
ROTATED = D_MODEL // HEADS // 2  # rope's frequencies per head

# every registered mechanism at its defaults, and the options that change what it computes
VARIANTS: list[list[Any]] = [
    [{"name": "alibi", "heads": 1}],
    [{"name": "alibi", "learned": True}],
    [{"name": "alibi", "learned": True, "bidirectional": "asymmetric"}],
    *[[{"name": "rope", "scaling": kind, "factor": 4.0, "original_max_len": 4}]
      for kind in ("linear", "ntk", "dynamic", "yarn", "llama3")],
    [{"name": "rope", "scaling": "longrope", "factor": 4.0, "original_max_len": 4,
      "short_factor": [1.0 + i / 4 for i in range(ROTATED)], "long_factor": [2.0 + i for i in range(ROTATED)]}],
    [{"name": "rope", "fraction": 0.5, "xpos": True, "scale_base": 8.0}],
    [{"name": "kerple", "kernel": "power"}],
    [{"name": "dynamic_pos_bias", "log_distance": True, "norm": True}],
    [{"name": "tupe", "relative_bias": True}],
    [{"name": "tupe", "untie_cls": True}],
    [{"name": "tisa", "mode": "supplement"}, "absolute"],
    [{"name": "segment", "mode": "input"}],
    [{"name": "diet_abs", "sharing": "layer"}],
    [{"name": "dape", "bias": "t5"}],
    [{"name": "forgetting", "bias_init": 1.0}],
    ["rope", "alibi", "diet_abs", "segment"],
]
SPECS: list[list[Any]] = [[name] for name in names()] + VARIANTS


def runs(specs: list[Any], causal: bool) -> bool:
    try:
        validate(specs, dims(causal, D_MODEL, HEADS, LAYERS, MAX_LEN))
    except PositionError:
        return False
    return True


# (specs, causal) for every mechanism and variant in the models that accept it
CASES = [pytest.param(specs, causal, id=f"{spec_id(specs)}-{'decoder' if causal else 'encoder'}")
         for specs in SPECS for causal in (False, True) if runs(specs, causal)]


def packed_documents() -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids [B, N] (padding: a document of its own) and the padding mask [B, N]."""
    docs = torch.zeros(B, N, dtype=torch.long)
    keep = torch.ones(B, N, dtype=torch.bool)
    for r, lengths in enumerate(LENGTHS):
        cuts = torch.tensor(lengths).cumsum(0)
        docs[r] = (torch.arange(N)[:, None] >= cuts).sum(1)
        keep[r, int(cuts[-1]):] = False
    assert int(keep.sum()) == B * N - PADDING
    return docs, keep


def spans() -> list[tuple[int, int, int]]:
    """(row, start, end) of every real document."""
    out = []
    for r, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            out.append((r, start, start + length))
            start += length
    return out


def segments(ids: torch.Tensor) -> torch.Tensor:
    seg = torch.zeros_like(ids)
    seg[:, 1::3] = 1
    return seg


def hidden(m, ids, seg, keep=None, docs=None, positions=None) -> torch.Tensor:
    if isinstance(m, Decoder):
        return m.hidden(ids, None, keep, positions, document_ids=docs)
    return m.hidden(ids, seg, keep, positions, document_ids=docs)


def with_grads(m, run) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``run()``'s hidden states, the gradient of a fixed weighted sum of them (``weights`` of
    the same shape) to the embedded input, and to every parameter."""
    captured: list[torch.Tensor] = []
    hook = m.tokens.register_forward_hook(lambda mod, inp, out: captured.append(out) or None)
    try:
        h, weights = run()
    finally:
        hook.remove()
    params = dict(m.named_parameters())
    grads = torch.autograd.grad((h * weights).sum(), captured + list(params.values()), allow_unused=True)
    by_name = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads[len(captured):])}
    return h, torch.cat([g.flatten(0, 1) for g in grads[:len(captured)]]), by_name


def close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 2e-5) -> None:
    err = (a - b).abs().max().item() if a.numel() else 0.0
    bound = tol * (1.0 + b.abs().max().item())
    assert err <= bound, f"{what}: max |packed − one by one| = {err:.3e} > {bound:.1e}"


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("specs,causal", CASES)
def test_packed_batch_equals_documents_one_by_one(specs, causal, path):
    m = model(specs, causal=causal, dtype=torch.float32, seed=3, path=path, d_model=D_MODEL, n_heads=HEADS,
              n_layers=LAYERS, max_len=MAX_LEN, d_ff=48)
    ids = tokens(B, N, seed=1)
    seg = segments(ids)
    docs, keep = packed_documents()
    weights = torch.randn(B, N, D_MODEL, generator=torch.Generator().manual_seed(5)) * keep[..., None]

    h_packed, gx_packed, g_packed = with_grads(m, lambda: (hidden(m, ids, seg, keep, docs), weights))

    def one_by_one():
        hs = [hidden(m, ids[r:r + 1, s:e], seg[r:r + 1, s:e]) for r, s, e in spans()]
        return (torch.cat([h[0] for h in hs]),
                torch.cat([weights[r, s:e] for r, s, e in spans()]))

    h_alone, gx_alone, g_alone = with_grads(m, one_by_one)
    real = torch.cat([torch.arange(r * N + s, r * N + e) for r, s, e in spans()])
    close(h_packed.flatten(0, 1)[real], h_alone, "hidden states")
    close(gx_packed[real], gx_alone, "gradient of the embedded input")
    assert gx_packed[~keep.flatten()].abs().max() == 0, "padding reached the loss"
    for name in g_alone:
        close(g_packed[name], g_alone[name], f"gradient of {name}")
    assert gx_alone.abs().max() > 0


@pytest.mark.parametrize("specs,causal", CASES)
def test_no_attention_across_documents(specs, causal):
    """Other documents' tokens change nothing (fast path); the document's own tokens do."""
    m = model(specs, causal=causal, dtype=torch.float32, seed=4, path="fast", d_model=D_MODEL, n_heads=HEADS,
              n_layers=LAYERS, max_len=MAX_LEN, d_ff=48)
    ids = tokens(B, N, seed=2)
    seg = segments(ids)
    docs, keep = packed_documents()
    with torch.no_grad():
        base = hidden(m, ids, seg, keep, docs)
        other = ids.clone()
        other[1, 3:7] = (other[1, 3:7] + 1) % m.cfg.vocab_size  # row 1's second document
        moved = hidden(m, other, seg, keep, docs)
    close(moved[1, 7:], base[1, 7:], "the third document after the second changed", tol=1e-6)
    close(moved[1, :3], base[1, :3], "the first document after the second changed", tol=1e-6)
    close(moved[[0, 2]], base[[0, 2]], "other rows after row 1 changed", tol=1e-6)
    assert (moved[1, 6] - base[1, 6]).abs().max() > 1e-4  # the changed document's own last token


def test_positions_restart_at_each_document():
    docs, keep = packed_documents()
    assert document_positions(docs)[1].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert document_lengths(docs, document_positions(docs))[2].tolist() == [6] * 6 + [4] * 4 + [2] * 2
    m = model("absolute", d_model=D_MODEL, n_heads=HEADS, max_len=MAX_LEN)
    ids = tokens(B, N)
    ctx = m.context(ids, None, keep, None, docs)
    assert torch.equal(ctx.positions, document_positions(docs)) and torch.equal(ctx.documents, docs)
    given = torch.arange(N).expand(B, N)
    assert torch.equal(m.context(ids, None, keep, given, docs).positions, given)  # positions given: kept
    # an absolute table is read at the restarted positions: the second document of a row is the
    # same tokens at positions 0, 1, ... as the document alone, not at positions 5, 6, ...
    h = m.hidden(ids, None, None, None, document_ids=docs)
    shifted = m.hidden(ids, None, None, given, document_ids=docs)
    close(h[0, 5:], m.hidden(ids[:1, 5:])[0], "second document")
    assert (shifted[0, 5:] - h[0, 5:]).abs().max() > 1e-3


def test_one_document_per_row_is_the_unpacked_model():
    """document_ids that hold one document per row change nothing, bit for bit."""
    m = model(["alibi", "rope"], causal=True, d_model=D_MODEL, n_heads=HEADS, path="fast", dtype=torch.float32)
    ids = tokens(B, N)
    assert m.context(ids, None, None, None, torch.full((B, N), 3)).documents is None
    assert torch.equal(m(ids, document_ids=torch.full((B, N), 3)), m(ids))


@pytest.mark.parametrize("bad,reason", [
    (torch.zeros(B, N + 1, dtype=torch.long), "shape"),
    (torch.zeros(B, N), "LongTensor"),
    (torch.tensor([[0] * 6 + [1] * 6, [0] * 6 + [1] * 3 + [0] * 3, [0] * N]), "non-decreasing"),
    ([[0] * N] * B, "LongTensor"),
])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_bad_document_ids_are_refused(bad, reason, causal):
    m = model("alibi", causal=causal, d_model=D_MODEL, n_heads=HEADS)
    with pytest.raises(PositionError, match=f"document_ids.*{reason}|{reason}.*document_ids"):
        m(tokens(B, N), document_ids=bad)


def test_scored_rows_and_padding_with_documents():
    """The rows a loss reads (``scored``: the last layer attends those rows alone) see their
    own document only, as in the whole forward pass."""
    docs, keep = packed_documents()
    ids = tokens(B, N, seed=3)
    for causal in (False, True):
        m = model(["t5", "rope"], causal=causal, d_model=D_MODEL, n_heads=HEADS, path="fast")
        scored = torch.rand(B, N, generator=torch.Generator().manual_seed(1)) < 0.4
        whole = hidden(m, ids, None, keep, docs)
        rows = m.hidden(ids, None, keep, None, scored, docs)
        close(rows, whole[scored], "scored rows", tol=1e-10)


def test_classify_gives_one_row_per_document():
    docs, keep = packed_documents()
    ids = tokens(B, N, seed=4)
    m = model("t5", d_model=D_MODEL, n_heads=HEADS, n_classes=3)
    logits = m.classify(ids, None, keep, None, docs)
    alone = torch.cat([m.classify(ids[r:r + 1, s:e]) for r, s, e in spans()])
    assert logits.shape == (len(spans()), 3)
    close(logits, alone, "per-document logits", tol=1e-10)


def test_encoder_and_decoder_take_document_ids_the_same_way():
    docs, keep = packed_documents()
    ids = tokens(B, N, seed=5)
    for cls in (Encoder, Decoder):
        m = model("sinusoidal", causal=cls is Decoder, d_model=D_MODEL, n_heads=HEADS)
        assert isinstance(m, cls)
        close(m(ids, document_ids=docs)[0, 5:], m(ids[:1, 5:])[0], "second document", tol=1e-10)
