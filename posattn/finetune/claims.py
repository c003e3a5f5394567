"""Papers' claims about how models rank, judged on a sweep's suite scores.

A claim is data in a recipe config (``claims:``)::

    - claim: relative convolutions beat absolute positions, which beat none (Chang et al., Table 1)
      paper: none 68.4, absolute 71.1, fixed_conv 74.5, dynamic_conv 74.7, composite 75.2
      holds: [fixed_conv > absolute, dynamic_conv > absolute, absolute > none]

Each relation compares two rows' suite scores (mean over seeds, with its standard error):
``a > b`` claims that a scores higher, ``a !> b`` that a does not score higher (e.g. "adds
nothing"). A difference counts when it exceeds :data:`SIGMAS` standard errors of the
difference, √(se_a² + se_b²). Per relation: ``holds`` (``>``: a difference that counts in the
claimed direction; ``!>``: none against it), ``contradicted`` (a difference that counts against
it) or ``within noise`` (``>`` only). Per claim: **reproduced** when every relation holds,
**not reproduced** when one is contradicted, otherwise **not distinguishable at this scale**;
**not measured** when a row is missing or has fewer than two seeds.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

SIGMAS = 2.0
OPS = (">", "!>")


@dataclass(frozen=True)
class Relation:
    """``left op right`` between two row labels."""

    left: str
    op: str
    right: str

    def __str__(self) -> str:
        return f"{self.left} {self.op} {self.right}"


@dataclass(frozen=True)
class Claim:
    claim: str
    paper: str
    holds: tuple[Relation, ...]


def parse_claims(raw: Any, errors: list[str]) -> list[Claim]:
    """Claims from a config's ``claims`` list; every problem is appended to ``errors``."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        errors.append(f"claims must be a list of {{claim, paper, holds}}, got {raw!r}")
        return []
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or set(entry) != {"claim", "paper", "holds"}:
            errors.append(f"claims[{i}]: needs exactly the keys claim, paper, holds; got {entry!r}")
            continue
        relations = []
        for text in entry["holds"] if isinstance(entry["holds"], list) else [None]:
            parts = text.split() if isinstance(text, str) else []
            if len(parts) != 3 or parts[1] not in OPS or parts[0] == parts[2]:
                errors.append(f"claims[{i}].holds: {text!r} is not 'A > B' or 'A !> B' with two different rows")
                continue
            relations.append(Relation(*parts))
        if relations:
            out.append(Claim(str(entry["claim"]), str(entry["paper"]), tuple(relations)))
    return out


@dataclass(frozen=True)
class Judged:
    """One relation: the difference left − right of the suite means, its standard error and status."""

    relation: Relation
    diff: float
    se: float
    status: str       # holds | contradicted | within noise

    def __str__(self) -> str:
        return f"{self.relation.left} − {self.relation.right} = {self.diff:+.1f} ± {self.se:.1f}: {self.status}"


def judge_relation(rel: Relation, stats: dict[str, list[float]]) -> Judged | str:
    """The relation judged on per-seed suite scores; a string says why it cannot be."""
    for label in (rel.left, rel.right):
        if len(stats.get(label, [])) < 2:
            return f"no row {label!r} with two or more seeds"
    a, b = stats[rel.left], stats[rel.right]
    diff = statistics.fmean(a) - statistics.fmean(b)
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    counts = abs(diff) > SIGMAS * se
    if rel.op == ">":
        status = "within noise" if not counts else ("holds" if diff > 0 else "contradicted")
    else:
        status = "contradicted" if counts and diff > 0 else "holds"
    return Judged(rel, diff, se, status)


def judge(claim: Claim, stats: dict[str, list[float]]) -> tuple[str, list[str]]:
    """(verdict, one line per relation) for a claim, given each row's per-seed suite scores."""
    judged = [judge_relation(r, stats) for r in claim.holds]
    lines = [str(j) if isinstance(j, Judged) else f"{r}: not measured ({j})" for r, j in zip(claim.holds, judged)]
    if any(isinstance(j, str) for j in judged):
        return "not measured", lines
    statuses = {j.status for j in judged if isinstance(j, Judged)}
    if "contradicted" in statuses:
        return "not reproduced", lines
    if "within noise" in statuses:
        return "not distinguishable at this scale", lines
    return "reproduced", lines
