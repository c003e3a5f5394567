"""Mixers: composition errors, fast form against the reference form (outputs and gradients)
for option variants, causality, and the linear-cost forms' pieces."""
from __future__ import annotations

import pytest
import torch

from posattn import Decoder, Encoder, ModelConfig, PositionError
from posattn.mechanisms.lincat import linear_attention, linear_attention_dense

VOCAB = 29


def make(mechanisms, causal=False, path="fast", max_len=40, seed=0, **kw):
    cfg = ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=4, d_ff=24, max_len=max_len,
                      mechanisms=mechanisms, attn_path=path, **kw)
    torch.manual_seed(seed)
    m = (Decoder if causal else Encoder)(cfg).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return m.eval()


def ids_and_keep(b=3, n=23, seed=1):
    ids = torch.randint(0, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[1, :5] = False  # left padding
    keep[2, -7:] = False  # right padding
    return ids, keep


# -- composition rules -----------------------------------------------------------------------

@pytest.mark.parametrize("mechanisms,message", [
    (["lincat", "linformer"], r"lincat and linformer both replace softmax attention"),
    (["convbert", "landmark_cat"], r"both replace softmax attention"),
    (["linformer", "t5"], r"^t5: adds a score term, but linformer has no score matrix"),
    (["lincat", "alibi"], r"^alibi: adds a score term, but lincat has no score matrix"),
    (["cat", "lincat"], r"both provide CAT convolutions"),
])
def test_composition_errors(mechanisms, message):
    with pytest.raises(PositionError, match=message):
        make(mechanisms)


def test_mixers_compose_with_input_and_qkv_mechanisms():
    ids, keep = ids_and_keep()
    for specs in (["absolute", "linformer"], ["rope", "convbert"], ["sinusoidal", "landmark_cat"]):
        h = make(specs).hidden(ids, attention_mask=keep)
        assert torch.isfinite(h).all()


def test_linformer_refuses_a_decoder_and_longer_inputs():
    for name in ("linformer", "diet_abs_lin"):
        with pytest.raises(PositionError, match=rf"^{name}: .*cannot be causal"):
            make([name], causal=True)
        m = make([{"name": name, "k": 5}], max_len=16)
        with pytest.raises(PositionError, match=rf"^{name}: needs 20 positions but it was built with 16"):
            m.hidden(torch.zeros(1, 20, dtype=torch.long))
    with pytest.raises(PositionError, match=r"^linformer: unknown sharing 'rows'"):
        make([{"name": "linformer", "sharing": "rows"}])


def test_bad_options_and_inputs_are_clear():
    with pytest.raises(PositionError, match=r"^landmark_cat: unknown selection 'argmax'"):
        make([{"name": "landmark_cat", "selection": "argmax"}])
    with pytest.raises(PositionError, match=r"^landmark_cat: block_size and top_k must be >= 1"):
        make([{"name": "landmark_cat", "block_size": 0}])
    with pytest.raises(PositionError, match=r"^lincat: chunk must be >= 1"):
        make([{"name": "lincat", "chunk": 0}])
    with pytest.raises(PositionError, match=r"^convbert: head_ratio must be >= 1"):
        make([{"name": "convbert", "head_ratio": 0}])
    m = make(["landmark_cat"])
    pos = torch.tensor([[0, 1, 2, 5, 6]])
    with pytest.raises(PositionError, match=r"^landmark_cat: blocks are runs of consecutive positions"):
        m.hidden(torch.zeros(1, 5, dtype=torch.long), positions=pos)
    with pytest.raises(PositionError, match=r"^linformer: replaces softmax attention; it has no n×n score"):
        make(["linformer"]).score_matrices(torch.zeros(1, 5, dtype=torch.long))


# -- fast form == reference form ---------------------------------------------------------------

VARIANTS = [
    {"name": "lincat", "chunk": 1}, {"name": "lincat", "chunk": 5}, {"name": "lincat", "chunk": 64},
    {"name": "lincat", "depthwise": False, "qk_norm": True},
    {"name": "landmark_cat", "block_size": 4}, {"name": "landmark_cat", "block_size": 3, "top_k": 2},
    {"name": "landmark_cat", "block_size": 5, "top_k": 3, "selection": "soft"},
    {"name": "landmark_cat", "block_size": 32}, {"name": "convbert", "head_ratio": 4, "conv_kernel_size": 4},
]


def hidden_and_loss(m, ids, keep, positions):
    h = m.hidden(ids, attention_mask=keep, positions=positions)
    return h, (h * keep[..., None] * torch.linspace(-1, 1, h.shape[-1], dtype=h.dtype)).sum()


def outputs_and_grads(m, ids, keep, positions, forward=hidden_and_loss):
    h, loss = forward(m, ids, keep, positions)
    grads = torch.autograd.grad(loss, [p for p in m.parameters()], allow_unused=True)
    return h[keep], [torch.zeros(()) if g is None else g for g in grads]


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_fast_equals_reference(spec, causal):
    if spec.get("name") == "convbert" and not causal:
        spec = {**spec, "conv_kernel_size": 5}  # a centered filter is odd
    ids, keep = ids_and_keep()
    offset = torch.tensor([[0], [3], [7]]) + torch.arange(ids.shape[1])  # rows start at other positions
    ref = make([spec], causal, "reference")
    fast = make([spec], causal, "fast")
    for positions in (None, offset):
        h_ref, g_ref = outputs_and_grads(ref, ids, keep, positions)
        h_fast, g_fast = outputs_and_grads(fast, ids, keep, positions)
        torch.testing.assert_close(h_fast, h_ref, rtol=1e-10, atol=1e-10)
        for a, b in zip(g_fast, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert any(g.abs().max() > 0 for g in g_ref)


LANDMARKS = [v for v in VARIANTS if v["name"] == "landmark_cat"]


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("spec", LANDMARKS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_landmark_compiled_form_equals_reference_in_one_graph(spec, causal):
    """Inside torch.compile Landmark CAT reads each chosen block by index and sizes its slots
    without reading the data: the forward is one graph (no host sync splits it), equal to the
    reference in outputs and gradients, and new selections (other rows, other positions) compile
    nothing again (before, each new selection compiled the step again)."""
    from torch._dynamo.testing import CompileCounter

    ids, keep = ids_and_keep()
    ref = make([spec], causal, "reference")
    fast = make([spec], causal, "fast")
    torch._dynamo.reset()
    graphs = CompileCounter()
    forward = torch.compile(hidden_and_loss, backend=graphs)
    offset = torch.tensor([[0], [3], [7]]) + torch.arange(ids.shape[1])
    for seed, positions in ((1, offset), (2, offset + 2), (3, offset + 11)):
        ids, keep = ids_and_keep(seed=seed)
        h_ref, g_ref = outputs_and_grads(ref, ids, keep, positions)
        h_fast, g_fast = outputs_and_grads(fast, ids, keep, positions, forward)
        torch.testing.assert_close(h_fast, h_ref, rtol=1e-10, atol=1e-10)
        for a, b in zip(g_fast, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert graphs.frame_count == 1


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("spec", LANDMARKS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_landmark_scored_rows_alone_equal_the_whole_layer(spec, causal, path, monkeypatch):
    """The last layer's Landmark CAT selects and attends for the scored rows alone (``mixes_rows``),
    on both paths: the same rows and gradients as the whole layer, with padding, rows that start
    at other positions, and packed documents; a row with no scored position gives nothing."""
    from posattn.mechanisms import landmark
    from posattn.mechanisms.base import document_positions

    m = make([spec], causal, path)
    ids, keep = ids_and_keep()
    scored = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) < 0.25
    scored[0, 0] = scored[0, -1] = scored[1, 5] = True
    scored[2] = False
    scored &= keep
    docs = torch.tensor([[0] * 9 + [1] * 14, [3] * 23, [0] * 4 + [1] * 6 + [2] * 13])
    offset = torch.tensor([[0], [3], [7]]) + torch.arange(ids.shape[1])
    from_doc = document_positions(docs) + torch.tensor([[0], [5], [2]])  # each document from its own start
    seen, mixed = [], []
    row_path, mix = landmark.attend_row_blocks, landmark.LandmarkCAT.mix
    monkeypatch.setattr(landmark, "attend_row_blocks", lambda *a: seen.append(a[0].shape[-2]) or row_path(*a))
    monkeypatch.setattr(landmark.LandmarkCAT, "mix", lambda *a, **k: mixed.append(mix(*a, **k)) or mixed[-1])
    weights = torch.linspace(-1, 1, m.cfg.d_model, dtype=torch.float64)
    for positions, documents in ((None, None), (offset, None), (from_doc, docs)):
        kw = {"attention_mask": keep, "positions": positions, "document_ids": documents}
        part = m.hidden(ids, scored=scored, **kw)
        whole = m.hidden(ids, **kw)[scored]
        torch.testing.assert_close(part, whole, rtol=1e-10, atol=1e-10)
        grads = [torch.autograd.grad((out * weights).sum(), list(m.parameters()), allow_unused=True)
                 for out in (part, whole)]
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    rows = int(scored.sum(-1).max())  # the last layer's output rows: the most any batch row scores
    n = ids.shape[1]  # two layers: the first whole, the last for the rows alone, then a whole forward
    assert [o.shape[-2] for o in mixed] == [n, rows, n, n] * 3
    assert seen == ([rows] * 3 if path == "fast" else [])


def test_compiled_blocks_policy_attends_through_inductor_off_the_cpu():
    """``Policy.compiled_blocks`` sends Landmark CAT's fast path off the CPU through
    torch.compile, where each pair reads its block by index; that compiled function (inductor,
    run on the CPU here) gives eager's output and gradients for soft selection, padding and
    choices that are not real candidates."""
    from posattn.attention.fast import Policy, using
    from posattn.mechanisms.landmark import _compiled_ok, attend_blocks, compiled_attend_blocks

    meta = torch.empty(1, device="meta")
    assert not _compiled_ok(meta)
    with using(Policy(compiled_blocks=True)):
        assert _compiled_ok(meta) and not _compiled_ok(torch.empty(1))
    g = torch.Generator().manual_seed(0)
    b, h, blk, nb, d, kk = 2, 2, 4, 5, 8, 2
    q, k, v = (torch.randn(b, h, nb * blk, d, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    scores = torch.randn(b, h, nb * blk, nb, generator=g, dtype=torch.float64, requires_grad=True)
    chosen = torch.randint(0, nb, (b, h, nb * blk, kk), generator=g)
    ok = torch.rand(b, h, nb * blk, kk, generator=g) > 0.2
    real = torch.rand(b, nb * blk, generator=g) > 0.1
    args = (q, k, v, scores, chosen, ok, real, True, blk, True, 0.0, True)  # a decoder's, as in CAT Fig 4
    outs = [f(*args) for f in (attend_blocks, compiled_attend_blocks())]
    grads = [torch.autograd.grad((o * torch.linspace(-1, 1, d, dtype=o.dtype)).sum(), (q, k, v, scores))
             for o in outs]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-10)
    for a, e in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("spec", [v for v in VARIANTS if v["name"] != "convbert"] + [{"name": "convbert"}],
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_decoder_variants_are_causal(spec):
    ids, keep = ids_and_keep(n=20)
    t = 11
    changed = ids.clone()
    changed[:, t + 1:] = (ids[:, t + 1:] + 1) % VOCAB
    for path in ("reference", "fast"):
        m = make([spec], True, path)
        a, b = m.hidden(ids, attention_mask=keep), m.hidden(changed, attention_mask=keep)
        torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-12)
        assert (a[:, t + 1:] - b[:, t + 1:]).abs().max() > 1e-6


def test_soft_selection_trains_the_landmark_filter_and_hard_does_not_have_one():
    ids, keep = ids_and_keep()
    soft = make([{"name": "landmark_cat", "block_size": 4, "selection": "soft"}])
    soft.hidden(ids, attention_mask=keep).pow(2).sum().backward()
    filt = soft.blocks[0].attn.mechanisms[0].landmark
    assert isinstance(filt, torch.nn.Parameter) and filt.grad.abs().max() > 0
    hard = make([{"name": "landmark_cat", "block_size": 4}])
    assert "landmark" not in dict(hard.named_parameters()) and "landmark" not in str(list(hard.state_dict()))


def test_landmark_hard_selection_picks_the_block_of_the_best_landmark():
    """One head, keys alike within each block: the query attends to the block whose landmark
    matches it best and to its own block, never to another block."""
    from posattn.attention import reference
    from posattn.mechanisms import build
    from posattn.mechanisms.base import Context, Dims, Softmax

    dims = Dims(4, 1, 1, 64, 1, True)
    mech = build([{"name": "landmark_cat", "block_size": 4}], dims).layers[0][0].double()
    block = torch.arange(16) // 4
    k = torch.nn.functional.one_hot(block, 4).double()[None, None] * 2.0  # block c's keys along e_c
    v = torch.nn.functional.one_hot(block, 4).double()[None, None]  # values say their block
    q = torch.zeros(1, 1, 16, 4, dtype=torch.float64)
    q[0, 0, 13, 1] = 5.0  # the query at 13 (block 3) matches block 1
    ctx = Context(positions=torch.arange(16)[None], segments=torch.zeros(1, 16, dtype=torch.long),
                  keep=None, causal=True)
    for path in ("reference", "fast"):
        o = mech.mix(q, k, v, [], ctx, Softmax(path, reference.attend, None, True))[0, 0, 13]
        assert o[0] == 0 and o[2] == 0, o  # blocks 0 and 2 are not chosen
        assert o[1] > 0.9 and o[3] > 0, o  # block 1 dominates; the own block is attended too


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("spec,causal", [({"name": "linformer", "k": 8}, False),
                                         ({"name": "landmark_cat", "block_size": 4}, False),
                                         ({"name": "landmark_cat", "block_size": 4, "selection": "soft"}, True)],
                         ids=["linformer", "landmark_cat", "landmark_cat-soft-decoder"])
def test_attention_dropout_is_applied_reproducibly_and_unbiased(spec, causal, path):
    """In training the mixers drop their attention probabilities: a seed fixes the mask, and
    the mean over many masks is the output without dropout (within 5 standard errors)."""
    from posattn.attention import reference
    from posattn.mechanisms import build
    from posattn.mechanisms.base import Context, Dims, Softmax

    dims = Dims(8, 2, 4, 40, 1, causal)
    mech = build([spec], dims).layers[0][0].double()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 4, generator=g, dtype=torch.float64) for _ in range(3))
    ctx = Context(positions=torch.arange(16)[None], segments=torch.zeros(1, 16, dtype=torch.long),
                  keep=None, causal=causal)

    def run(training: bool) -> torch.Tensor:
        return mech.mix(q, k, v, [], ctx, Softmax(path, reference.attend, None, causal, 0.5, training))

    clean = run(False)
    torch.manual_seed(1)
    first = run(True)
    torch.manual_seed(1)
    torch.testing.assert_close(run(True), first, rtol=0, atol=0)
    assert (first - clean).abs().max() > 0.1
    draws = torch.stack([run(True) for _ in range(400)])
    error = (draws.mean(0) - clean).abs()
    assert (error <= 5 * draws.std(0) / 20 + 1e-9).all(), error.max()


# -- linear attention pieces -------------------------------------------------------------------

@pytest.mark.parametrize("n,chunk", [(1, 4), (7, 3), (16, 4), (16, 16), (30, 64)])
def test_chunked_prefix_sums_equal_the_dense_kernel_matrix(n, chunk):
    g = torch.Generator().manual_seed(n)
    fq, fk = (torch.rand(2, 3, n, 5, generator=g, dtype=torch.float64) + 0.1 for _ in range(2))
    v = torch.randn(2, 3, n, 6, generator=g, dtype=torch.float64)
    for causal in (False, True):
        torch.testing.assert_close(linear_attention(fq, fk, v, causal, chunk),
                                   linear_attention_dense(fq, fk, v, causal), rtol=1e-12, atol=1e-12)
