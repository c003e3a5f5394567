"""Packed rows in the sequence convolutions and mixers: the shared slot layout, the depthwise
convolution (every algorithm) and linear attention (reference and fast forms) on a packed row
equal each document run alone, outputs and gradients; Landmark CAT's position check per
document. The whole models, every mechanism, are covered by tests/core/test_packed.py."""
from __future__ import annotations

import pytest
import torch

from posattn.attention import native
from posattn.mechanisms.base import Context, document_rank
from posattn.mechanisms.conv import conv_method, depthwise_conv1d
from posattn.mechanisms.documents import DocumentSlots
from posattn.mechanisms.lincat import linear_attention, linear_attention_dense

# two rows: documents of 3, 5, 1 and 11 tokens; of 7 and 13 (ids need not start at 0)
DOCS = torch.tensor([[0] * 3 + [1] * 5 + [2] + [3] * 11, [5] * 7 + [6] * 13])


def pieces(documents: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(row, token indices) of every document."""
    return [(r, (documents[r] == d).nonzero()[:, 0]) for r in range(documents.shape[0])
            for d in documents[r].unique()]


def alone(fn, documents: torch.Tensor, *tensors: torch.Tensor, dim: int) -> torch.Tensor:
    """fn run on each document alone, put back in place: the slow per-document reference."""
    out = None
    for r, idx in pieces(documents):
        y = fn(*(t[r:r + 1].index_select(dim, idx) for t in tensors))
        if out is None:
            out = torch.zeros((documents.shape[0],) + y.shape[1:dim] + (documents.shape[1],) + y.shape[dim + 1:],
                              dtype=y.dtype)
        out[r:r + 1].index_copy_(dim, idx, y)
    return out


def test_document_rank_and_slots_layout():
    assert document_rank(DOCS)[0].tolist() == [0] * 3 + [1] * 5 + [2] + [3] * 11
    slots = DocumentSlots.build(torch.tensor([[4, 4, 4, 9, 9]]), 5, 1, torch.device("cpu"), gap=2)
    assert slots.slot.tolist() == [[0, 1, 2, 5, 6]] and slots.size == 9
    assert slots.filled.tolist() == [[True, True, True, False, False, True, True, False, False]]
    # blocks of 4, the first document starting at position 3 (slot 3), the second at position 0
    lead = torch.tensor([[3, 4, 5, 0, 0]])
    slots = DocumentSlots.build(torch.tensor([[0, 0, 0, 1, 1]]), 5, 1, torch.device("cpu"), block=4, lead=lead % 4)
    assert slots.slot.tolist() == [[3, 4, 5, 8, 9]] and slots.size == 12
    x = torch.arange(1.0, 6.0).view(1, 5, 1)
    placed = slots.place(x, 1)
    assert placed[0, :, 0].tolist() == [0, 0, 0, 1, 2, 3, 0, 0, 4, 5, 0, 0]
    assert torch.equal(slots.take(placed, 1), x)


def conv_cases():
    cases = [(k, causal, shared, torch.float64) for k in (1, 3, 9, 113) for causal in (True, False)
             for shared in (False, True)]
    return cases + [(9, causal, False, torch.float32) for causal in (True, False)]  # the C++ kernel where it builds


@pytest.mark.parametrize("k,causal,shared,dtype", conv_cases())
def test_depthwise_conv_never_reads_across_documents(k, causal, shared, dtype):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(2, 20, 6, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(*((k,) if shared else (6, k)), generator=g, dtype=dtype, requires_grad=True)
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[1, -3:] = False  # padding at the end of the last document
    out = torch.randn(2, 20, 6, generator=g, dtype=dtype)
    packed = depthwise_conv1d(x, w, causal, keep, DOCS)
    ref = alone(lambda xi, ki: depthwise_conv1d(xi, w, causal, ki), DOCS, x, keep, dim=1)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(packed, ref, rtol=tol, atol=tol)
    grads = torch.autograd.grad((packed * out).sum(), (x, w))
    expected = torch.autograd.grad((ref * out).sum(), (x, w))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    if dtype == torch.float32 and native.kernels() is not None:
        assert conv_method(k, x) == "native"
    if k > 1:  # a wider filter would read across the boundaries without the documents
        assert (packed - depthwise_conv1d(x, w, causal, keep)).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "encoder"])
@pytest.mark.parametrize("chunk", [1, 3, 4, 8, 64])
def test_linear_attention_per_document(causal, chunk):
    g = torch.Generator().manual_seed(chunk)
    fq, fk, v = (torch.rand(2, 3, 20, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = torch.randn(2, 3, 20, 4, generator=g, dtype=torch.float64)
    ref = alone(lambda a, b, c: linear_attention_dense(a, b, c, causal), DOCS, fq, fk, v, dim=2)
    expected = torch.autograd.grad((ref * out).sum(), (fq, fk, v))
    for got in (linear_attention_dense(fq, fk, v, causal, DOCS), linear_attention(fq, fk, v, causal, chunk, DOCS)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad((got * out).sum(), (fq, fk, v))
        for a, b in zip(grads, expected):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_landmark_cat_wants_consecutive_positions_in_each_document():
    from posattn.errors import PositionError
    from posattn.mechanisms import Dims, build

    mech = build(["landmark_cat"], Dims(8, 2, 1, 40, 1, False)).layers[0][0]
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    ctx = Context(positions=torch.tensor([[0, 1, 2, 0, 1, 2]]), segments=torch.zeros(1, 6, dtype=torch.long),
                  keep=None, causal=False, documents=docs)
    mech.check(ctx)
    ctx.positions = torch.tensor([[4, 5, 6, 9, 10, 11]])  # each document consecutive from its own start
    mech.check(ctx)
    ctx.positions = torch.tensor([[0, 1, 2, 0, 2, 3]])
    with pytest.raises(PositionError, match=r"^landmark_cat: blocks are runs of consecutive positions"):
        mech.check(ctx)
