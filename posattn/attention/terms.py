"""Score-term structures. A mechanism declares each additive score term by its structure;
the reference path materializes every term densely (:meth:`Term.dense`), the fast path picks an
exact algorithm per structure (:mod:`posattn.attention.fast`).

Shapes: b batch, h heads, n length, d head dim. A leading size-1 dim broadcasts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import PositionError


def row_offsets(index: Tensor, n: int) -> Tensor:
    """[..., m, n] offsets j − i of the query rows i in ``index`` [..., m] against keys 0 … n − 1."""
    return torch.arange(n, device=index.device) - index[..., None]


def relative_index(n: int, device: torch.device) -> Tensor:
    """[n, n] index of r = j − i into a table over offsets −(n−1) … n−1 (entry r + n − 1)."""
    return row_offsets(torch.arange(n, device=device), n) + (n - 1)


def clipped_band(prod: Tensor, n: int, window: int) -> Tensor:
    """[..., n, n] with entry (i, j) = prod[..., i, clip(j − i, −w, w) + w], from ``prod``
    [..., n, 2w + 1], built from a pad, views and the two edge columns times masks, so that its
    backward only slices and sums. The same tensor as ``prod.gather`` with the clipped index,
    whose backward instead scatter-adds the n − 2w − 1 clipped offsets of every row into the same
    two edge slots (atomic adds that serialise on a GPU).

    Skewing: row i of ``prod`` padded with n zeros and read back with rows one element shorter
    lands at columns i … i + 2w, so columns w … w + n − 1 hold the band |j − i| ≤ w."""
    width = n + 2 * window
    skew = F.pad(prod, (0, n)).flatten(-2)[..., :n * width].unflatten(-1, (n, width))
    r = relative_index(n, prod.device) - (n - 1)  # j − i
    left, right = (r < -window).to(prod.dtype), (r > window).to(prod.dtype)
    return skew[..., window:window + n] + prod[..., :1] * left + prod[..., -1:] * right


def take_rows(t: Tensor, index: Tensor) -> Tensor:
    """Rows ``index`` [b|1, m] of t [b|1, ..., n, d] along its second-to-last dim: [b, ..., m, d]."""
    shape = (index.shape[0], *([1] * (t.dim() - 3)), index.shape[1], 1)
    return torch.take_along_dim(t, index.reshape(shape), dim=-2)


def batch_free(t: Tensor) -> bool:
    """True when every batch row of t is the same, so one batch row serves the batch. Inside
    ``torch.compile`` only what the shape and strides show: comparing the rows is a host sync
    that would split a compiled step (False is always safe: the term is then taken per row)."""
    if t.shape[0] == 1 or t.stride(0) == 0:
        return True
    return not torch.compiler.is_compiling() and bool(torch.equal(t, t[:1].expand_as(t)))


class Term:
    """An additive score term s_ij += t_ij."""

    def dense(self, n: int) -> Tensor:
        """The term as a broadcastable [b|1, h|1, n, n] tensor (reference path)."""
        raise NotImplementedError

    def rows(self, index: Tensor, n: int) -> Tensor:
        """Query rows ``index`` ([b|1, m] positions, m < n or all n in order) of the term built
        for length n, [b|1, h|1, m, n], in O(m·n): cached decoding's new rows (:mod:`.decode`),
        or the rows a loss reads (:func:`posattn.attention.reference.attend_rows`). A tensor
        made from the queries may hold all n rows or these m alone."""
        raise NotImplementedError

    def tensors(self) -> list[Tensor]:
        """The tensors the term is made of (gradient checks, cache keys)."""
        raise NotImplementedError

    def position_only(self) -> bool:
        """True when the term depends on positions alone: no q or k, the same for every batch row."""
        return False

    def first_row(self) -> Term:
        """A position-only term with its batch dimension reduced to 1."""
        return self

    def constant_beyond(self) -> int | None:
        """w when the term is constant (per row) for |j − i| > w on each side, else None."""
        return None

    def bias(self, n: int) -> Tensor:
        """The fastest exact dense form [b|1, h|1, n, n] (the fast path's dense bias)."""
        return self.dense(n)

    def fusable(self) -> bool:
        """Whether the fused C++ kernels (:mod:`.fused`) take this term (:meth:`kernel_input`)."""
        return False

    def kernel_input(self) -> tuple[str, Tensor]:
        """(name, tensor) of this term as an input of the fused C++ kernels: ``table``
        [h|1, 2n − 1], ``qband`` / ``kband`` [b, h, n, 2w + 1], ``lowrank`` [2, b|1, h|1, n, r]
        (u and v), or ``sided`` [4, b|1, h|1, n] (a, x, b, y of :class:`TwoSided`)."""
        raise NotImplementedError


@dataclass
class Toeplitz(Term):
    """t_ij = table[h, j − i + n − 1]: one value per head and offset (T5, TISA, DIET-REL, ...).

    ``window``: the table is constant for r < −window and for r > window (clipped mechanisms):
    those entries are one value with one parameterisation (e.g. clipped copies of the edge
    weight), so the fast path may hand their summed gradient to the entries at r = ∓(window+1).
    ``causal_form``: an equivalent low-rank term that differs from this one by a per-row
    constant on the causal (j ≤ i) side, so it gives the same softmax under a causal mask.
    ``formula``: ``formula(h, r)`` = table[h, r + n − 1] from traceable tensor ops, for heads
    ``h`` and offsets ``r`` = j − i (integer tensors of one shape), where the mechanism has a closed
    form (ALiBi's −m_h·|r|): FlexAttention computes it per score instead of reading the table
    under ``fast.Policy.flex_formula``.
    """

    table: Tensor  # [h, 2n − 1]
    window: int | None = None
    causal_form: LowRank | None = None
    formula: Callable[[Tensor, Tensor], Tensor] | None = None

    def dense(self, n: int) -> Tensor:
        return self.table[:, relative_index(n, self.table.device)].unsqueeze(0)

    def bias(self, n: int) -> Tensor:
        """:meth:`dense` from views: the table's windows of n (``unfold``: row s holds offsets
        s − n + 1 .. s) in reverse row order, so that row i starts at offset −i. The index's
        backward scatter-adds n² gradients into 2n − 1 entries (atomics on a GPU, 0.5 ms per layer
        of a T5 encoder at n 512 on an H100); unfold's sums each entry's diagonal."""
        if self.table.dim() != 2:
            return self.dense(n)
        return self.table[:, :2 * n - 1].unfold(-1, n, 1).flip(-2).unsqueeze(0)

    def rows(self, index: Tensor, n: int) -> Tensor:
        return self.table[:, row_offsets(index, n) + n - 1].movedim(0, 1)

    def tensors(self) -> list[Tensor]:
        return [self.table]

    def position_only(self) -> bool:
        return True

    def constant_beyond(self) -> int | None:
        return self.window

    def fusable(self) -> bool:
        return self.table.dim() == 2

    def kernel_input(self) -> tuple[str, Tensor]:
        return "table", self.table


@dataclass
class LowRank(Term):
    """t_ij = u_i · v_j: folds exactly into extra q/k dimensions (DIET-ABS, TUPE, segment)."""

    u: Tensor  # [b|1, h|1, n, r]
    v: Tensor  # [b|1, h|1, n, r]

    def dense(self, n: int) -> Tensor:
        return self.u @ self.v.transpose(-1, -2)

    def rows(self, index: Tensor, n: int) -> Tensor:
        u = take_rows(self.u, index) if self.u.shape[-2] == n else self.u
        return u @ self.v.transpose(-1, -2)

    def tensors(self) -> list[Tensor]:
        return [self.u, self.v]

    def position_only(self) -> bool:
        return batch_free(self.u) and batch_free(self.v)

    def first_row(self) -> LowRank:
        return LowRank(self.u[:1], self.v[:1])

    def fusable(self) -> bool:
        return True

    def kernel_input(self) -> tuple[str, Tensor]:
        return "lowrank", torch.stack(torch.broadcast_tensors(self.u, self.v))


@dataclass
class QueryRelative(Term):
    """t_ij = scale · q_i · W[clip(j − i, −w, w) + w] (Shaw et al. 2018; Chang Eq 5).

    ``weight``: [2w + 1, d] shared by the heads, or [h, 2w + 1, d].
    ``key_side``: the key-based twin t_ij = scale · k_j · W[clip(i − j, −w, w) + w] (Huang et al.
    2020), with ``vec`` holding k instead of q.
    """

    vec: Tensor  # [b, h, n, d]
    weight: Tensor
    window: int
    scale: float
    key_side: bool = False

    def relative_embeddings(self, n: int) -> Tensor:
        """Shaw's explicit tensor a_ij = W[clip(·)], [n, n, d] or [h, n, n, d]."""
        r = relative_index(n, self.weight.device) - (n - 1)
        r = -r if self.key_side else r
        return self.weight[..., r.clamp(-self.window, self.window) + self.window, :]

    def _contract(self, vec: Tensor, a: Tensor) -> Tensor:
        """scale · vec_i · a_ij (query side) or scale · vec_j · a_ij (key side)."""
        eq = "bhid,ijd->bhij" if a.dim() == 3 else "bhid,hijd->bhij"
        if self.key_side:
            eq = eq.replace("bhid,", "bhjd,")
        return torch.einsum(eq, vec, a) * self.scale

    def dense(self, n: int) -> Tensor:
        return self._contract(self.vec, self.relative_embeddings(n))

    def rows(self, index: Tensor, n: int) -> Tensor:
        """Gathered from the products vec·W[r] of the chosen query rows (query side) or of every
        key (key side), never Shaw's m×n×d tensor."""
        r = row_offsets(index, n)  # [b|1, m, n]
        if self.key_side:  # t_ij = prod[j, clip(i − j)]
            prod = self.products().transpose(-1, -2)  # [b, h, 2w + 1, n]
            idx = (-r).clamp(-self.window, self.window) + self.window
            return prod.gather(-2, idx[:, None].expand(*prod.shape[:2], *idx.shape[1:]))
        vec = take_rows(self.vec, index) if self.vec.shape[-2] == n else self.vec
        prod = replace(self, vec=vec).products()  # [b, h, m, 2w + 1]
        idx = r.clamp(-self.window, self.window) + self.window
        return prod.gather(-1, idx[:, None].expand(*prod.shape[:2], *idx.shape[1:]))

    def tensors(self) -> list[Tensor]:
        return [self.vec, self.weight]

    def constant_beyond(self) -> int | None:
        return self.window

    def products(self) -> Tensor:
        """[b, h, n, 2w + 1]: scale · vec_i · W[r] for every offset r of the window."""
        w = self.weight if self.weight.dim() == 3 else self.weight.unsqueeze(0)  # [h|1, 2w+1, d]
        return torch.einsum("bhid,hmd->bhim", self.vec, w) * self.scale

    def fusable(self) -> bool:
        return True

    def kernel_input(self) -> tuple[str, Tensor]:
        return "kband" if self.key_side else "qband", self.products()

    def bias(self, n: int, skew: bool = False) -> Tensor:
        """[b, h, n, n] gathered from the [b, h, n, 2w+1] products q·W[r]ᵀ, never Shaw's
        n×n×d tensor; ``skew``: the same tensor from :func:`clipped_band` (no scatter in its
        backward)."""
        prod = self.products()
        if skew:  # key side: t_ij = prod[j, clip(i − j)], the query-side band of prod transposed
            band = clipped_band(prod, n, self.window)
            return band.transpose(-1, -2) if self.key_side else band
        r = relative_index(n, self.vec.device) - (n - 1)
        idx = (r.T if self.key_side else r).clamp(-self.window, self.window) + self.window  # [n, n]
        if self.key_side:  # t_ij = prod[j, idx_ij]
            return prod.gather(-1, idx.T.expand(*prod.shape[:2], n, n)).transpose(-1, -2)
        return prod.gather(-1, idx.expand(*prod.shape[:2], n, n))


@dataclass
class Dense(Term):
    """Anything else: an explicit [b|1, h|1, n, n] tensor (last resort)."""

    bias: Tensor

    def dense(self, n: int) -> Tensor:
        return self.bias

    def rows(self, index: Tensor, n: int) -> Tensor:
        return take_rows(self.bias, index) if self.bias.shape[-2] == n else self.bias

    def tensors(self) -> list[Tensor]:
        return [self.bias]

    def position_only(self) -> bool:
        return batch_free(self.bias)

    def first_row(self) -> Dense:
        return Dense(self.bias[:1]) if self.bias.dim() == 4 else self


class _TwoSidedDense(torch.autograd.Function):
    """The dense form of :class:`TwoSided` from a, x, b, y [..., n]: [..., n, n].

    Backward, with G = ∂L/∂t and L its lower triangle (j ≤ i): ∂a = rowsums(L), ∂x = colsums(L),
    ∂b = rowsums(G) − rowsums(L), ∂y = colsums(G) − colsums(L): one masked pass and four
    reductions over G, instead of autograd's two broadcast sums and a masked select per side."""

    @staticmethod
    def forward(ctx: object, a: Tensor, x: Tensor, b: Tensor, y: Tensor) -> Tensor:
        n = x.shape[-1]
        lower = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        ctx.save_for_backward(lower)  # type: ignore[attr-defined]
        ctx.shapes = tuple(t.shape for t in (a, x, b, y))  # type: ignore[attr-defined]
        return torch.where(lower, a[..., :, None] + x[..., None, :], b[..., :, None] + y[..., None, :])

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, ...]:
        (lower,) = ctx.saved_tensors  # type: ignore[attr-defined]
        low = grad * lower
        rows, cols, rows_low, cols_low = grad.sum(-1), grad.sum(-2), low.sum(-1), low.sum(-2)
        grads = (rows_low, cols_low, rows - rows_low, cols - cols_low)
        return tuple(g.sum_to_size(shape) for g, shape in zip(grads, ctx.shapes))  # type: ignore[attr-defined]


@dataclass
class TwoSided(Term):
    """t_ij = a_i + x_j for j ≤ i and b_i + y_j for j > i: a separable term on each side of the
    diagonal (the Forgetting Transformer's bidirectional gates: a = c, x = −c, b = −c', y = c').
    Each side alone is rank 2; together they are dense, but every block of the term comes from
    the four [b|1, h|1, n] vectors, so the fused kernels add it and reduce dS into their
    gradients (row and column sums per side) without an n×n tensor."""

    lower_row: Tensor  # a [b|1, h|1, n]
    lower_col: Tensor  # x
    upper_row: Tensor  # b
    upper_col: Tensor  # y

    def vectors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(a, x, b, y)."""
        return self.lower_row, self.lower_col, self.upper_row, self.upper_col

    def dense(self, n: int) -> Tensor:
        return _TwoSidedDense.apply(*self.vectors())

    def inputs(self) -> list[Tensor]:
        """The tensors :meth:`block` reads, in its order: (a, x, b, y)."""
        return list(self.vectors())

    def stacked(self) -> Tensor:
        """[4, b|1, h|1, n]: a, x, b, y broadcast to one shape (the fused kernels', FlexAttention's input)."""
        return torch.stack(torch.broadcast_tensors(*self.vectors()))

    def block(self, inputs: Sequence[Tensor], rows: Tensor, keys: Tensor) -> Tensor:
        """[b|1, h|1, m, k]: the term at query rows ``rows`` ([b|1, m] or [m]) and keys ``keys``
        ([k]), from ``inputs`` (:meth:`inputs`, or leaf copies of them), as :meth:`RowNormalised.block`."""
        rows = rows if rows.dim() == 2 else rows[None]
        a, x, b, y = inputs

        def at_rows(t: Tensor) -> Tensor:
            return torch.take_along_dim(t, rows[:, None].expand(t.shape[0], t.shape[1], -1), dim=-1)

        lower = (keys <= rows[..., None])[:, None]  # [b|1, 1, m, k]
        return torch.where(lower, at_rows(a)[..., None] + x[..., None, keys],
                           at_rows(b)[..., None] + y[..., None, keys])

    def rows(self, index: Tensor, n: int) -> Tensor:
        return self.block(self.inputs(), index, torch.arange(n, device=index.device))

    def tensors(self) -> list[Tensor]:
        return self.inputs()

    def position_only(self) -> bool:
        return all(batch_free(t) for t in self.vectors())

    def first_row(self) -> TwoSided:
        return TwoSided(*(t[:1] for t in self.vectors()))

    def fusable(self) -> bool:
        return True

    def kernel_input(self) -> tuple[str, Tensor]:
        return "sided", self.stacked()


@dataclass
class RowNormalised(Term):
    """t_ij = f(d[|i − j|] / z_i): a pointwise function f of a distance table d [n] normalised
    per query row by z (FIRE, Li et al. 2023). It depends on the row i as well as on i − j, so it
    is not Toeplitz; every block of rows and keys is computed from the small inputs alone
    (:meth:`block`), so a path builds it block by block in linear memory and differentiates each
    block with autograd.

    ``fn(x, params)``: x [...] normalised distances -> [..., h] (or [..., 1]); it reads only
    ``params`` (tensors), never a module, so a block rebuilt from leaf copies of the inputs
    gives those inputs' gradients."""

    distance: Tensor  # [n], d[r] for r = 0 … n − 1
    norm: Tensor  # [b|1, n], z_i > 0 per row
    params: tuple[Tensor, ...]
    fn: Callable[[Tensor, Sequence[Tensor]], Tensor]

    def inputs(self) -> list[Tensor]:
        """The tensors :meth:`block` reads, in its order."""
        return [self.distance, self.norm, *self.params]

    def block(self, inputs: Sequence[Tensor], rows: Tensor, keys: Tensor) -> Tensor:
        """[b|1, h|1, m, k]: the term at query rows ``rows`` ([b|1, m] or [m]) and keys ``keys``
        ([k]), from ``inputs`` (:meth:`inputs`, or leaf copies of them)."""
        distance, norm, *params = inputs
        rows = rows if rows.dim() == 2 else rows[None]
        z = torch.take_along_dim(norm, rows, dim=-1)  # [b|1, m]
        x = distance[(rows[..., None] - keys).abs()] / z[..., None]  # [b|1, m, k]
        return self.fn(x, params).movedim(-1, 1)

    def dense(self, n: int) -> Tensor:
        idx = torch.arange(n, device=self.distance.device)
        return self.block(self.inputs(), idx, idx)

    def rows(self, index: Tensor, n: int) -> Tensor:
        return self.block(self.inputs(), index, torch.arange(n, device=index.device))

    def tensors(self) -> list[Tensor]:
        return self.inputs()

    def position_only(self) -> bool:
        return batch_free(self.norm)

    def first_row(self) -> RowNormalised:
        return replace(self, norm=self.norm[:1])


@dataclass
class ScoreTransform(Term):
    """Not an additive term: the scores become s'_ij = fn(l, b, ok, rows)_ij, from the logits
    l = q·kᵀ/√d_h, the sum b of every additive term (zeros when there is none), the allowed
    mask ``ok`` (bool, broadcastable to the scores; None when everything is allowed) and the
    positions ``rows`` [b|1, m] of the score rows (0 … n − 1, or the rows decoded). Applied
    after every additive term and before the mask and softmax (CoPE, DAPE). Only a path that
    writes the scores out can apply it; a layer takes one (:func:`posattn.mechanisms.validate`).

    ``inputs``: the tensors ``fn`` reads (gradient checks)."""

    fn: Callable[[Tensor, Tensor, Tensor | None, Tensor], Tensor]
    inputs: tuple[Tensor, ...] = ()

    def apply(self, logits: Tensor, bias: Tensor, ok: Tensor | None, rows: Tensor) -> Tensor:
        """The transformed scores [b, h, m, n]."""
        return self.fn(logits, bias, ok, rows)

    def dense(self, n: int) -> Tensor:
        raise PositionError("a score transform is no additive score term: it rewrites the scores "
                            "(ScoreTransform.apply), so it has no bias table of its own")

    def rows(self, index: Tensor, n: int) -> Tensor:
        return self.dense(n)

    def tensors(self) -> list[Tensor]:
        return list(self.inputs)


def split_transforms(terms: list[Term]) -> tuple[list[Term], list[ScoreTransform]]:
    """(additive terms, score transforms) of ``terms``, in their order."""
    return ([t for t in terms if not isinstance(t, ScoreTransform)],
            [t for t in terms if isinstance(t, ScoreTransform)])
