"""Summary records: a measured table whose cells are gone, kept as data with its provenance.

A summary record (``kind: "summary"``, ``results/<recipe>/summary-<what>.json``) holds one table
as it was measured, until its cells are re-run and ``posattn report`` builds it from them::

    {"title": "chang_table1 on CPU checkpoints", "about": "test score ×100, mean ± s.e. over 5 seeds ...",
     "columns": ["movie", ..., "suite", "Chang T1"], "digits": 1,
     "rows": [{"label": "none", "values": [{"mean": 67.1, "se": 0.4}, ..., {"mean": 67.0, "se": 0.1,
               "median": 67.1}, 68.4], "seeds": [67.10, 67.11, 66.81, 67.23, 66.89]}, ...],
     "claims": [{"claim": ..., "paper": ..., "holds": ["fixed_conv > absolute", ...],
                 "verdict": "not distinguishable at this scale", "ours": "fixed_conv − absolute −0.48 ± 0.25, ..."}],
     "notes": ["..."]}

``row_title`` (default "model") heads the label column; ``digits`` (default 1) sets the decimals.
A value is a number, a list of numbers (shown ``a / b``, e.g. loss / accuracy), ``{"mean", "se"
or "sd"[, "median"]}`` (shown ``mean ± se (median)``, or ``median (mean ± se)`` where the table
has ``median_first``), a string, or null (blank). ``seeds`` (optional) are a row's per-seed
scores, the statistic its claims compare: where every row a claim names has two or more, the
claim's verdict is recomputed with :func:`posattn.claims.judge` (as the sweep's report would);
otherwise the recorded verdict is carried, marked as such.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from posattn.claims import SIGMAS, judge, parse_claims, report_row
from posattn.errors import PositionError
from posattn.experiments import store
from posattn.markdown import table as md_table

KEYS = ("title", "columns", "rows")


def check(result: Any, where: str) -> dict[str, Any]:
    """``result`` if it is summary data (title, columns, rows of the columns' width, claims that parse),
    else one error naming ``where``."""
    problems = []
    if not isinstance(result, dict) or not set(KEYS) <= set(result):
        raise PositionError(f"{where}: summary data needs the keys {', '.join(KEYS)}")
    width = len(result["columns"])
    for i, row in enumerate(result["rows"]):
        if not isinstance(row, dict) or "label" not in row or len(row.get("values", [])) != width:
            problems.append(f"rows[{i}] needs a label and {width} values (one per column)")
        elif not all(isinstance(s, (int, float)) for s in row.get("seeds", [])):
            problems.append(f"rows[{i}].seeds must be numbers")
    parse_claims([{k: c[k] for k in ("claim", "paper", "holds") if k in c} for c in result.get("claims", [])],
                 problems)
    if problems:
        raise PositionError(f"{where}: not valid summary data: " + "; ".join(problems))
    return result


def value_text(value: Any, digits: int, median_first: bool = False) -> str:
    """One table cell: ``mean ± spread (median)`` (``median (mean ± spread)`` with ``median_first``),
    a number, numbers joined by " / ", a string, or blank."""
    if value is None:
        return ""
    if isinstance(value, dict):
        spread = value.get("se", value.get("sd"))
        text = f"{value['mean']:.{digits}f}" + ("" if spread is None else f" ± {spread:.{digits}f}")
        if "median" not in value:
            return text
        median = f"{value['median']:.{digits}f}"
        return f"{median} ({text})" if median_first else f"{text} ({median})"
    if isinstance(value, list):
        return " / ".join(value_text(v, digits) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.{digits}f}"
    return str(value)


def claim_rows(result: dict[str, Any]) -> list[list[str]]:
    """One row per claim: recomputed from the rows' per-seed scores where they are recorded, else the
    recorded verdict, marked as carried."""
    stats = {row["label"]: list(row["seeds"]) for row in result["rows"] if row.get("seeds")}
    rows = []
    for entry in result.get("claims", []):
        [claim] = parse_claims([{k: entry[k] for k in ("claim", "paper", "holds")}], [])
        labels = {r.left for r in claim.holds} | {r.right for r in claim.holds if r.op != ">="}
        if all(len(stats.get(label, [])) >= 2 for label in labels):
            verdict, details = judge(claim, stats)
            if entry.get("verdict") and entry["verdict"] != verdict:
                details.append(f"(recorded verdict: {entry['verdict']})")
            rows.append(report_row(claim, verdict, details))
        else:
            rows.append(report_row(claim, entry.get("verdict", "not measured"),
                                   [entry.get("ours", ""), "(verdict as recorded: the per-seed scores it was "
                                                           "judged on are not kept)"]))
    return rows


def render(record: dict[str, Any]) -> list[str]:
    """Markdown lines of one summary record: its table, its claims judged, its notes and provenance."""
    result, prov = record["result"], record["provenance"]
    digits = int(result.get("digits", 1))
    lines = [f"## {result['title']}", ""]
    if result.get("about"):
        lines += [result["about"], ""]
    median_first = result.get("median_first", False)
    lines += md_table([result.get("row_title", "model"), *result["columns"]],
                      [[row["label"], *(value_text(v, digits, median_first) for v in row["values"])]
                       for row in result["rows"]])
    if result.get("claims"):
        lines += [f"Claims (a difference counts beyond {SIGMAS:g} s.e.):", "",
                  *md_table(["claim", "paper", "ours", "verdict"], claim_rows(result))]
    lines += [f"- {note}" for note in result.get("notes", [])]
    lines += [*([""] if result.get("notes") else []),
              f"Measured {prov['date']} on {prov['hardware']}: `{prov['command']}`.", ""]
    return lines


def summary_report(recipe: str, records: list[dict[str, Any]], root: str | Path | None = None) -> str:
    """``report.md`` of a recipe known only by its summary records (in the store at ``root``)."""
    lines = [f"# {recipe}: measured tables kept as summary data", "",
             "These tables were measured before their cells were kept; they are regenerated from the "
             "numbers recorded in `results/" + recipe + "/summary-*.json` until the cells are re-run.", ""]
    for record in records:
        check(record["result"], str(store.record_path(recipe, record["id"], root)))
        lines += render(record)
    return "\n".join(lines)
