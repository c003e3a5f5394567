"""Which score-term structures each fast-path algorithm computes, and the one error for the rest.

Every path of :mod:`.fast` picks its code by term type (:mod:`.terms`) with no fallback: a term
whose type a path does not list here is refused by name before the path runs, and each path's
own code branches over exactly these types. :func:`posattn.attention.fast.plan` only chooses a
path that takes the terms it is given; the refusal guards a path run directly
(:func:`posattn.attention.fast.run`) and any new term type.
"""
from __future__ import annotations

from typing import Literal

from torch import Tensor

from ..errors import PositionError
from .terms import Dense, LowRank, QueryRelative, RowNormalised, ScoreTransform, Term, Toeplitz, TwoSided

Path = Literal["sdpa", "dense", "banded", "flash_bias", "fused", "flex"]

HANDLES: dict[str, tuple[type[Term], ...]] = {
    "sdpa": (LowRank,),  # folded into q/k; nothing else reaches SDPA's own kernel
    # one bias (Term.bias), low-rank folded; with a score transform the scores are written out
    "dense": (Toeplitz, LowRank, QueryRelative, Dense, RowNormalised, TwoSided, ScoreTransform),
    "banded": (Toeplitz, LowRank, QueryRelative),  # terms constant beyond a window; low-rank folded
    # table, band chunks, dense chunks, row-normalised and two-sided blocks
    "flash_bias": (Toeplitz, LowRank, QueryRelative, Dense, RowNormalised, TwoSided),
    "fused": (Toeplitz, LowRank, QueryRelative, TwoSided),  # the C++ kernels' inputs (Term.kernel_input)
    "flex": (Toeplitz, LowRank, QueryRelative, Dense, TwoSided),  # inside score_mod; low-rank folded
}


# the paths whose mask hides the keys of another document of a packed row (Context.documents);
# the kernels of the others know padding and causality alone
TAKES_DOCUMENTS: tuple[str, ...] = ("sdpa", "dense", "flex")


def refused(path: str, term: Term, why: str = "") -> PositionError:
    """The error for a term that ``path`` does not compute (``why``: a reason beyond its type)."""
    takes = ", ".join(t.__name__ for t in HANDLES[path])
    reason = why or f"it computes {takes} terms only"
    return PositionError(f"the {path} attention path cannot compute a {type(term).__name__} score term: {reason}")


def check_terms(path: str, terms: list[Term]) -> None:
    """Refuse, by term type and path, any term ``path`` has no code for (exact types: a subclass
    may change what the term means)."""
    if path not in HANDLES:
        raise PositionError(f"unknown attention path {path!r}; valid: {', '.join(HANDLES)}")
    for t in terms:
        if type(t) not in HANDLES[path]:
            raise refused(path, t)


def check_documents(path: str, documents: Tensor | None) -> None:
    """Refuse packed rows (``documents``) on a path whose mask cannot hide another document's keys."""
    if documents is not None and path not in TAKES_DOCUMENTS:
        raise PositionError(f"the {path} attention path cannot hide the keys of another document of a packed "
                            f"row (document_ids): it takes padding and causality only; the "
                            f"{', '.join(TAKES_DOCUMENTS)} paths take documents (fast.attend picks one)")
