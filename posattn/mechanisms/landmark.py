"""``landmark_cat``: Landmark CAT (Li et al. 2024, §5 and Fig 4): CAT's convolutions on q, k, v,
then each query attends to one landmark per block to pick block(s), and attends locally.

Blocks are B consecutive *positions* (block of token i = position_i // B, so position ids
matter and the mechanism is not translation invariant; positions must be consecutive within a
row). Per head:

    landmark    ℓ_c = Σ_m w_m k_{cB+m}                  (a length-B convolution of the keys, read
                                                          at the block's end; w = 1/B, the block
                                                          mean, unless ``selection="soft"``)
    selection   C_i = top-``top_k`` blocks c by q_i·ℓ_c/√d_h among the candidates: earlier
                blocks (decoder) or every other block (encoder) holding a real token
    output      o_i = softmax_j(q_i·k_j/√d_h + g_ij) v_j over j ∈ (blocks in C_i) ∪ (own block,
                j ≤ i in a decoder), g_ij = 0 (``hard``) or q_i·ℓ_{c(j)}/√d_h for j in a chosen
                block (``soft``)

``selection``: ``hard`` is the paper's top-1 hard attention (``top_k`` = 1): the choice itself
gets no gradient and w stays the fixed block mean. ``soft`` is the trainable form: w is learned
and each chosen block's keys carry their landmark score as a bias, so the landmark filter and
the selection receive a gradient (the grouped softmax of Landmark Attention, Mohtashami & Jaggi
2023). Work per query: O(L/B) landmark scores + O((top_k + 1)·B) local attention; B defaults to
the power of two nearest √max_len, which minimises L/B + B.

Attention dropout (the layer's ``dropout``) drops the probabilities over the candidates. The
two paths lay those out differently ([N', N'] against [N', (top_k + 1)·B]), so they draw
different masks and agree only without dropout.

Chosen rows (``mixes_rows``: a model's last layer when its loss reads a few positions, as the
synthetic tasks' do): the filters, landmarks and slots are those of the whole row, but only the
m chosen queries select and attend, O(m·(L/B + (top_k + 1)·B)·d_h) instead of O(n·(...)). The
reference form is the same dense mask restricted to those queries; the fast form
(:func:`attend_row_blocks`) reads each query's chosen blocks and its own block by index.

Packed rows (``ctx.documents``, positions restarting at each document): each document starts a
fresh block (:class:`Slots`) and a query's candidate blocks are those of its own document, so
every document is handled exactly as if it ran alone.

Paths: ``reference`` materialises the same selection as a dense n×n mask (and bias) and runs
one softmax over it; ``fast`` sorts the (query, chosen block) pairs by block so that each
block's keys and values serve all the queries that chose it in one matmul: O(n·(L/B +
(top_k + 1)·B)·d_h) time, O(n·(L/B + (top_k + 1)·B)) memory beyond q, k, v. Inside
``torch.compile`` the group sizes, which follow the selection, would be shapes read from the data
(a host sync and a new compile for every batch), so there each pair reads its chosen block's
keys and values by index instead, a product and a sum the compiler fuses into one kernel: the
same arithmetic, one graph whatever the selection. Off the CPU, ``Policy.compiled_blocks`` runs
that compiled form from eager code too (eager launches one matmul per block).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from ..attention.dropout import dropout
from ..attention.reference import weighted_values
from ..attention.terms import Term, take_rows
from ..errors import PositionError
from .base import Context, Dims, Softmax, document_positions, document_rank
from .conv_layers import CAT
from .documents import DocumentSlots
from .registry import register

Selection = Literal["hard", "soft"]


def default_block(max_len: int) -> int:
    """The power of two nearest √max_len (at least 2)."""
    return max(2, 2 ** round(math.log2(math.sqrt(max_len))))


class Slots:
    """Tokens placed in block-aligned slots (:class:`~.documents.DocumentSlots`): a document whose
    first position is p starts at slot p mod B of a fresh block, so its blocks are runs of B
    positions as if it ran alone; ``real`` marks slots holding a real (non-padding) token and
    ``doc`` the document rank of each slot (−1 where empty). Without ``documents`` a row is one
    document: token i of row r sits at slot i + (position_{r,0} mod B)."""

    def __init__(self, positions: Tensor, keep: Tensor | None, block: int, documents: Tensor | None = None) -> None:
        b, n = max(t.shape[0] for t in (positions, keep, documents) if t is not None), positions.shape[1]
        positions = positions.expand(b, n)
        self.layout = DocumentSlots.build(documents, n, b, positions.device, block=block, lead=positions % block)
        self.size = self.layout.size
        filled = self.layout.filled
        self.real = filled if keep is None else filled & keep.gather(1, self.layout.token)
        rank = torch.zeros_like(positions) if documents is None else document_rank(documents)
        self.doc = torch.full((b, self.size), -1, dtype=torch.long, device=positions.device).scatter_(
            1, self.layout.slot, rank)
        self.block = block

    def place(self, t: Tensor) -> Tensor:
        """[b, h, n, d] -> [b, h, N', d], zeros in empty slots."""
        return self.layout.place(t, 2) * self.real[:, None, :, None].to(t.dtype)

    def take(self, t: Tensor) -> Tensor:
        """[b, h, N', d] -> [b, h, n, d], the slots of the tokens."""
        return self.layout.take(t, 2)


@register("landmark_cat")
class LandmarkCAT(CAT):
    """Landmark CAT (Li et al. 2024, §5 and Fig 4), a mixer: CAT's filters on q, k, v, then each
    query picks the top_k blocks by its score against one landmark per block and attends over
    those blocks and its own.

    Options:
        kernel_size: CAT's filter length (see ``cat``).
        depthwise: CAT's per-channel (True) or shared (False) filters.
        targets: which of q, k, v CAT filters, letters from "qkv".
        qk_norm: CAT's ℓ2-normalised q and k with a learned temperature.
        block_size: B, positions per block (default: the power of two nearest √max_len).
        top_k: how many blocks each query attends to besides its own.
        selection: "hard" (the paper's choice, no gradient through it, landmark = block mean)
            or "soft" (a learned landmark filter whose scores bias the chosen keys)."""

    paper = "Li et al. 2024 (CAT), Landmark CAT, Fig 4"
    equation = "CAT q,k,v; ℓ_c = block conv of k; attend over top-k blocks by q·ℓ and the own block"
    translation_invariant = False
    mixes = True
    mixes_rows = True
    cost_class = "mixer"
    takes_score_terms = False

    def __init__(self, dims: Dims, shared: dict[str, nn.Module], kernel_size: int = 3,
                 depthwise: bool = True, targets: str = "qkv", qk_norm: bool = False,
                 block_size: int | None = None, top_k: int = 1, selection: Selection = "hard") -> None:
        super().__init__(dims, shared, kernel_size, depthwise, targets, qk_norm)
        self.block = default_block(dims.max_len) if block_size is None else block_size
        if self.block < 1 or top_k < 1:
            raise PositionError(f"landmark_cat: block_size and top_k must be >= 1, got "
                                f"{self.block} and {top_k}")
        if selection not in ("hard", "soft"):
            raise PositionError(f"landmark_cat: unknown selection {selection!r}; valid: hard, soft")
        self.acts_on = self.acts_on + ("mixer",)
        self.top_k, self.selection = top_k, selection
        mean = torch.full((self.block,), 1.0 / self.block)
        if selection == "soft":
            self.landmark = nn.Parameter(mean)
        else:
            self.register_buffer("landmark", mean, persistent=False)

    def check(self, ctx: Context) -> None:
        pos = ctx.positions
        if ctx.documents is None:
            steps = torch.arange(pos.shape[1], device=pos.device).expand_as(pos)
        else:
            steps = document_positions(ctx.documents)
        index = torch.arange(pos.shape[1], device=pos.device).expand_as(pos)
        if not torch.equal(pos, pos.gather(1, index - steps) + steps):
            raise self.fail("blocks are runs of consecutive positions; give each row (each document "
                            "of a packed row) consecutive position ids")

    def select(self, q: Tensor, k: Tensor, slots: Slots, causal: bool,
               at: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Landmark scores [b, h, m, nb], chosen blocks [b, h, m, top_k] and whether each
        choice is a real candidate [b, h, m, top_k], for the queries q [b, h, m, d] at slots
        ``at`` [b|1, m] (None: every slot, m = N')."""
        b, h, size, d = k.shape
        nb, blk = size // self.block, self.block
        landmarks = torch.einsum("bhcmd,m->bhcd", k.view(b, h, nb, blk, d), self.landmark.to(k.dtype))
        scores = q @ landmarks.transpose(-1, -2) / math.sqrt(d)
        at = torch.arange(q.shape[-2], device=q.device)[None] if at is None else at
        own = at // blk
        other = torch.arange(nb, device=q.device)
        cand = other < own[..., None] if causal else other != own[..., None]  # [b|1, m, nb]
        cand = cand & slots.real.view(-1, nb, blk).any(-1)[:, None, :]
        block_doc = slots.doc.view(-1, nb, blk).amax(-1)  # every block lies in one document
        cand = cand & (torch.take_along_dim(slots.doc, at, 1)[..., None] == block_doc[:, None, :])  # own document
        masked = scores.masked_fill(~cand[:, None], float("-inf"))
        top = masked.topk(min(self.top_k, nb), dim=-1)
        return scores, top.indices, top.values > float("-inf")

    def mix(self, q: Tensor, k: Tensor, v: Tensor, terms: list[Term], ctx: Context,
            softmax: Softmax, rows: Tensor | None = None) -> Tensor:
        slots = Slots(ctx.positions, ctx.keep, self.block, ctx.documents)
        qs, ks, vs = slots.place(q), slots.place(k), slots.place(v)
        at = None if rows is None else torch.take_along_dim(slots.layout.slot, rows, 1)  # the rows' slots
        if at is not None:
            qs = take_rows(qs, at)
        scores, chosen, ok = self.select(qs, ks, slots, ctx.causal, at)
        if softmax.path == "reference":
            o = self.dense(qs, ks, vs, scores, chosen, ok, slots, ctx.causal, softmax, at)
        elif at is None:
            o = self.grouped(qs, ks, vs, scores, chosen, ok, slots, ctx.causal, softmax)
        else:
            o = attend_row_blocks(qs, ks, vs, scores, chosen, ok, at, slots.real, ctx.causal, self.block,
                                  self.selection == "soft", softmax.dropout, softmax.training)
        return slots.take(o) if at is None else o

    def dense(self, q: Tensor, k: Tensor, v: Tensor, scores: Tensor, chosen: Tensor, ok: Tensor,
              slots: Slots, causal: bool, softmax: Softmax, at: Tensor | None = None) -> Tensor:
        """Reference: the selection as an m×N' mask (and bias) over every slot, for the queries
        at slots ``at`` (None: every slot, m = N'); one softmax."""
        size, blk = k.shape[-2], self.block
        t = torch.arange(size, device=q.device)
        at = t[None] if at is None else at  # [b|1, m]
        block_of = t // blk
        picked = (block_of[None, None, None, :, None] == chosen[..., None, :]) & ok[..., None, :]
        picked = picked.any(-1)  # [b, h, m, N']: key slot j lies in a chosen block of query t
        own = (at // blk)[..., None] == block_of  # [b|1, m, N']
        if causal:
            own = own & (t <= at[..., None])
        allowed = (picked | own[:, None]) & slots.real[:, None, None, :] | (t == at[..., None])[:, None]
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if self.selection == "soft":
            s = s + picked * scores.gather(-1, block_of.expand(*scores.shape[:3], size))
        return weighted_values(s, allowed, v, softmax.dropout, softmax.training)

    def grouped(self, q: Tensor, k: Tensor, v: Tensor, scores: Tensor, chosen: Tensor, ok: Tensor,
                slots: Slots, causal: bool, softmax: Softmax) -> Tensor:
        """Fast: :func:`attend_blocks`; off the CPU under ``Policy.compiled_blocks`` through
        ``torch.compile`` (:func:`compiled_attend_blocks`)."""
        attend = compiled_attend_blocks() if _compiled_ok(q) else attend_blocks
        return attend(q, k, v, scores, chosen, ok, slots.real, causal, self.block, self.selection == "soft",
                      softmax.dropout, softmax.training)


def attend_blocks(q: Tensor, k: Tensor, v: Tensor, scores: Tensor, chosen: Tensor, ok: Tensor, real: Tensor,
                  causal: bool, blk: int, soft: bool, p_drop: float, training: bool) -> Tensor:
    """Landmark CAT's fast path over slots [b, h, N', d]: each query's scores against the keys of
    its chosen blocks (:class:`SortedPairs` eagerly, :class:`IndexedPairs` inside
    ``torch.compile``) and against its own block as one batched matmul; one softmax over the
    (top_k + 1)·B candidates of each query. ``real`` [b, N'] marks the slots holding a token,
    ``soft`` adds each chosen block's landmark score to its keys' scores."""
    b, h, size, d = q.shape
    nb, kk = size // blk, chosen.shape[-1]
    pairs = (IndexedPairs if torch.compiler.is_compiling() else SortedPairs)(q, k, v, chosen, blk)
    s_sel = pairs.scores().view(b, h, size, kk * blk) / math.sqrt(d)
    real = real.view(-1, 1, nb, blk).expand(b, h, nb, blk)
    picked_real = real.gather(2, chosen.reshape(b, h, size * kk, 1).expand(-1, -1, -1, blk))
    keep_sel = picked_real.view(b, h, size, kk, blk) & ok[..., None]
    if soft:
        s_sel = s_sel + scores.gather(-1, chosen).repeat_interleave(blk, -1)
    s_sel = s_sel.masked_fill(~keep_sel.view(b, h, size, kk * blk), float("-inf"))
    s_own = q.view(b, h, nb, blk, d) @ k.view(b, h, nb, blk, d).transpose(-1, -2) / math.sqrt(d)
    own_ok = real[:, :, :, None, :].expand(b, h, nb, blk, blk)
    if causal:
        own_ok = own_ok.tril()
    own_ok = own_ok | torch.eye(blk, dtype=torch.bool, device=q.device)
    s_own = s_own.masked_fill(~own_ok, float("-inf")).view(b, h, size, blk)
    p = dropout(torch.softmax(torch.cat([s_sel, s_own], -1), -1), p_drop, training)
    o_sel = pairs.values(p[..., : kk * blk].reshape(b, h, size, kk, blk)).sum(-2)
    o_own = (p[..., kk * blk:].view(b, h, nb, blk, blk) @ v.view(b, h, nb, blk, -1)).view(b, h, size, -1)
    return o_sel + o_own


def attend_row_blocks(q: Tensor, k: Tensor, v: Tensor, scores: Tensor, chosen: Tensor, ok: Tensor, at: Tensor,
                      real: Tensor, causal: bool, blk: int, soft: bool, p_drop: float, training: bool) -> Tensor:
    """Landmark CAT's fast path for a few query rows q [b, h, m, d] at slots ``at`` [b|1, m] over
    the slots' k, v [b, h, N', d]: each row reads the keys and values of its chosen blocks and of
    its own block by index (:class:`IndexedPairs`, [b, h, m, top_k + 1, B, d], small for few
    rows); one softmax over the (top_k + 1)·B candidates, as :func:`attend_blocks` for every row."""
    b, h, m, d = q.shape
    nb, kk = k.shape[-2] // blk, chosen.shape[-1]
    blocks = torch.cat([chosen, (at // blk)[:, None, :, None].expand(b, h, m, 1)], -1)  # chosen, then own
    pairs = IndexedPairs(q, k, v, blocks, blk)
    s = pairs.scores() / math.sqrt(d)  # [b, h, m, top_k + 1, B]
    if soft:
        s = s + torch.cat([scores.gather(-1, chosen), scores.new_zeros(b, h, m, 1)], -1)[..., None]
    real = real.view(-1, 1, nb, blk).expand(b, h, nb, blk)
    allow = real.gather(2, blocks.reshape(b, h, m * (kk + 1), 1).expand(-1, -1, -1, blk)).view(b, h, m, kk + 1, blk)
    allow = allow & torch.cat([ok, ok.new_ones(b, h, m, 1)], -1)[..., None]
    slot = blocks[..., kk:, None] * blk + torch.arange(blk, device=q.device)  # own block's slots [b, h, m, 1, B]
    here = at[:, None, :, None, None]
    own = allow[..., kk:, :] & (slot <= here) if causal else allow[..., kk:, :]
    allow = torch.cat([allow[..., :kk, :], own | (slot == here)], -2)
    s = s.masked_fill(~allow, float("-inf")).view(b, h, m, (kk + 1) * blk)
    p = dropout(torch.softmax(s, -1), p_drop, training)
    return pairs.values(p.view(b, h, m, kk + 1, blk)).sum(-2)


def compiled_attend_blocks() -> Callable[..., Tensor]:
    """:func:`attend_blocks` through ``torch.compile`` (one graph per shape, as FlexAttention's):
    the pairs read their blocks by index in fused kernels instead of one matmul per block, which
    an eager GPU step launches b·h·(L/B) of."""
    from ..runtime.compile import compiled_piece

    return compiled_piece(attend_blocks)


def _compiled_ok(q: Tensor) -> bool:
    """``Policy.compiled_blocks`` off the CPU, outside a compiled step (inside one, the step's
    compiler takes :func:`attend_blocks` as it is)."""
    from ..attention.fast import policy_for  # the attention package imports the mechanisms' modules

    return (q.device.type != "cpu" and not torch.compiler.is_compiling()
            and policy_for(q.device).compiled_blocks)


class SortedPairs:
    """The (query, chosen block) pairs of :func:`attend_blocks` sorted by block, so that
    each block's keys and values serve all the queries that chose it in one matmul (no copy of
    a block per query). The groups' sizes follow the selection, a shape read from the data: the
    eager form."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, chosen: Tensor, blk: int) -> None:
        b, h, size, d = q.shape
        bh, nb, kk = b * h, size // blk, chosen.shape[-1]
        self.shape = (b, h, size, kk)
        # one view per block (unbind: a single backward op, not one full-size zero tensor per block)
        self.kb, self.vb = k.reshape(bh * nb, blk, d).unbind(0), v.reshape(bh * nb, blk, -1).unbind(0)
        # pairs (row r = (b, h), slot t, choice) keyed by the chosen block r·nb + c, sorted
        row = torch.arange(bh, device=q.device).view(bh, 1, 1)
        key = (row * nb + chosen.reshape(bh, size, kk)).reshape(-1)
        self.order = torch.argsort(key, stable=True)
        self.unsort = torch.argsort(self.order)
        query_of = (row * size + torch.arange(size, device=q.device).view(1, size, 1)).expand(bh, size, kk)
        q_sorted = q.reshape(bh * size, d).index_select(0, query_of.reshape(-1)[self.order])
        self.counts = torch.bincount(key, minlength=bh * nb).tolist()
        self.groups = [(g, part) for g, part in enumerate(q_sorted.split(self.counts)) if part.shape[0]]

    def scores(self) -> Tensor:
        """q·k against every key of each chosen block, [b, h, N', top_k, B] (unscaled)."""
        s_sorted = torch.cat([part @ self.kb[g].T for g, part in self.groups])  # [pairs, B]
        return s_sorted.index_select(0, self.unsort).view(*self.shape, -1)

    def values(self, p: Tensor) -> Tensor:
        """Σ_m p_m v_m over each chosen block's values, [b, h, N', top_k, d_v], from p [b, h, N', top_k, B]."""
        p_sorted = p.reshape(-1, p.shape[-1]).index_select(0, self.order)
        o_sorted = torch.cat([part @ self.vb[g] for (g, _), part in
                              zip(self.groups, p_sorted.split([c for c in self.counts if c]))])
        return o_sorted.index_select(0, self.unsort).view(*self.shape, -1)


class IndexedPairs:
    """:class:`SortedPairs`' products with each pair reading its block's keys and values by
    index: a product and a sum that ``torch.compile`` can fuse into kernels of indirect loads
    (not checked in its generated code), with no shape read from the data, so a compiled step
    stays one graph and is not compiled again when the selection changes."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, chosen: Tensor, blk: int) -> None:
        b, h, _, d = q.shape
        nb = k.shape[-2] // blk
        self.q = q
        rows = (torch.arange(b, device=q.device).view(b, 1, 1, 1), torch.arange(h, device=q.device).view(1, h, 1, 1))
        self.k = k.view(b, h, nb, blk, d)[(*rows, chosen)]  # [b, h, N', top_k, B, d], fused into its reader
        self.v = v.view(b, h, nb, blk, -1)[(*rows, chosen)]

    def scores(self) -> Tensor:
        return (self.q[:, :, :, None, None, :] * self.k).sum(-1)

    def values(self, p: Tensor) -> Tensor:
        return (p[..., None] * self.v).sum(-2)
