"""Papers' claims about how models rank, as data in a recipe config, judged on measured results.

A claim (``claims:`` in a ``posattn finetune`` or ``posattn compare`` config)::

    - claim: relative convolutions beat absolute positions, which beat none (Chang et al., Table 1)
      paper: none 68.4, absolute 71.1, fixed_conv 74.5, dynamic_conv 74.7, composite 75.2
      holds: [fixed_conv > absolute, dynamic_conv > absolute, absolute > none]

Each relation compares rows (labels may contain spaces) by the mean over seeds of their score,
with its standard error: ``a > b`` claims that a scores higher, ``a !> b`` that a does not
score higher (e.g. "adds nothing"), ``a >= 0.99`` that a reaches a value. A difference counts
when it exceeds :data:`SIGMAS` standard errors of the difference, √(se_a² + se_b²) (against a
value: se_a). Per relation: ``holds`` (``>``: a difference that counts in the claimed
direction; ``!>``: none against it; ``>=``: the mean reaches the value), ``contradicted`` (a
difference that counts against it) or ``within noise``. Per claim: **reproduced** when every
relation holds, **not reproduced** when one is contradicted, otherwise **not distinguishable
at this scale**; **not measured** when a row is missing or has fewer than two seeds.
A ``compare`` claim may add ``at: {d_model, train_length, length}`` (see
:mod:`posattn.synthetic.report`); it is judged at every setting it covers and :func:`combine`
merges the verdicts.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

SIGMAS = 2.0
RELATION = re.compile(r"^(?P<left>.+?)\s+(?P<op>!>|>=|>)\s+(?P<right>.+)$")
VERDICTS = ("not reproduced", "not distinguishable at this scale", "not measured", "reproduced")


@dataclass(frozen=True)
class Relation:
    """``left op right`` between two row labels, or ``left >= value``."""

    left: str
    op: str
    right: str

    def __str__(self) -> str:
        return f"{self.left} {self.op} {self.right}"

    @staticmethod
    def parse(text: Any) -> Relation | None:
        m = RELATION.match(text.strip()) if isinstance(text, str) else None
        if m is None or m["left"] == m["right"]:
            return None
        if m["op"] == ">=":
            try:
                float(m["right"])
            except ValueError:
                return None
        return Relation(m["left"], m["op"], m["right"])


@dataclass(frozen=True)
class Claim:
    claim: str
    paper: str
    holds: tuple[Relation, ...]
    at: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The config form that :func:`parse_claims` reads back (``at`` only when given)."""
        return {"claim": self.claim, "paper": self.paper, "holds": [str(r) for r in self.holds],
                **({"at": self.at} if self.at else {})}


def parse_claims(raw: Any, errors: list[str], optional: tuple[str, ...] = ()) -> list[Claim]:
    """Claims from a config's ``claims`` list; every problem is appended to ``errors``.
    ``optional``: extra keys a claim may have (``at`` for compare)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        errors.append(f"claims must be a list of {{claim, paper, holds}}, got {raw!r}")
        return []
    out = []
    for i, entry in enumerate(raw):
        keys = set(entry) if isinstance(entry, dict) else set()
        if not {"claim", "paper", "holds"} <= keys or keys - {"claim", "paper", "holds", *optional}:
            allowed = ", ".join(["claim", "paper", "holds", *(f"{k} (optional)" for k in optional)])
            errors.append(f"claims[{i}]: needs the keys {allowed}; got {entry!r}")
            continue
        if not isinstance(entry.get("at", {}), dict):
            errors.append(f"claims[{i}].at must be a mapping, got {entry['at']!r}")
            continue
        relations = []
        for text in entry["holds"] if isinstance(entry["holds"], list) else [entry["holds"]]:
            rel = Relation.parse(text)
            if rel is None:
                errors.append(f"claims[{i}].holds: {text!r} is not 'A > B', 'A !> B' (two different rows) "
                              f"or 'A >= number'")
                continue
            relations.append(rel)
        if relations:
            out.append(Claim(str(entry["claim"]), str(entry["paper"]), tuple(relations), dict(entry.get("at") or {})))
    return out


@dataclass(frozen=True)
class Judged:
    """One relation: the difference left − right of the suite means, its standard error and status."""

    relation: Relation
    diff: float
    se: float
    status: str       # holds | contradicted | within noise

    def __str__(self) -> str:
        return f"{self.relation.left} − {self.relation.right} = {self.diff:+.3g} ± {self.se:.2g}: {self.status}"


def judge_relation(rel: Relation, stats: dict[str, list[float]]) -> Judged | str:
    """The relation judged on per-seed scores; a string says why it cannot be."""
    rows = (rel.left,) if rel.op == ">=" else (rel.left, rel.right)
    for label in rows:
        if len(stats.get(label, [])) < 2:
            return f"no row {label!r} with two or more seeds"
    a = stats[rel.left]
    var = statistics.variance(a) / len(a)
    if rel.op == ">=":
        diff = statistics.fmean(a) - float(rel.right)
    else:
        b = stats[rel.right]
        diff = statistics.fmean(a) - statistics.fmean(b)
        var += statistics.variance(b) / len(b)
    se = math.sqrt(var)
    counts = abs(diff) > SIGMAS * se
    if rel.op == ">":
        status = "within noise" if not counts else ("holds" if diff > 0 else "contradicted")
    elif rel.op == "!>":
        status = "contradicted" if counts and diff > 0 else "holds"
    else:
        status = "holds" if diff >= 0 else ("contradicted" if counts else "within noise")
    return Judged(rel, diff, se, status)


def judge(claim: Claim, stats: dict[str, list[float]]) -> tuple[str, list[str]]:
    """(verdict, one line per relation) for a claim, given each row's per-seed suite scores."""
    judged = [judge_relation(r, stats) for r in claim.holds]
    lines = [str(j) if isinstance(j, Judged) else f"{r}: not measured ({j})" for r, j in zip(claim.holds, judged)]
    if any(isinstance(j, str) for j in judged):
        return "not measured", lines
    statuses = {j.status for j in judged}   # every relation was judged
    if "contradicted" in statuses:
        return "not reproduced", lines
    if "within noise" in statuses:
        return "not distinguishable at this scale", lines
    return "reproduced", lines


def combine(verdicts: list[str]) -> str:
    """One verdict for a claim judged at several settings: the first of :data:`VERDICTS` present
    (a contradiction anywhere decides; reproduced only when reproduced everywhere)."""
    return next((v for v in VERDICTS if v in verdicts), "not measured")


def report_row(claim: Claim, verdict: str, details: list[str]) -> list[str]:
    """The report-table row of a judged claim: claim, paper, our numbers, verdict."""
    return [claim.claim, claim.paper, "<br>".join(details) or "no setting of this sweep", f"**{verdict}**"]
