"""``report.md``, ``results.json`` and ``valid_loss.png`` of a pretraining recipe, from its runs' records.

A run's record is its ``result.json`` with its ``label`` and its metrics ``history`` (the rows of
``metrics.jsonl``): what :func:`finished_run` reads from a run folder and what the results store
keeps, so that ``posattn pretrain`` and ``posattn report`` write the same summary.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import PositionError
from ..experiments.store import read_json
from ..runtime.files import write_json_atomic, write_text_atomic
from ..runtime.metrics import METRICS
from .plots import plot_recipe
from .run import RESULT


def finished_run(folder: Path, label: str) -> dict[str, Any] | None:
    """The record of the run in ``folder`` (``label``, its result, its metrics history); None until it
    has finished. A file that is not JSON gets one error naming it."""
    if not (folder / RESULT).is_file():
        return None
    result = read_json(folder / RESULT)
    if not isinstance(result, dict) or not {"steps", "valid_loss"} <= set(result):
        raise PositionError(f"{folder / RESULT}: not a pretraining result (needs steps and valid_loss)")
    history = []
    lines = (folder / METRICS).read_text(encoding="utf-8").splitlines() if (folder / METRICS).is_file() else []
    for i, line in enumerate(lines):
        try:
            if line.strip():
                history.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise PositionError(f"{folder / METRICS}: line {i + 1} is not JSON ({e})") from None
    return {"label": label, **result, "history": history}


def summary_text(name: str, results: list[dict[str, Any]], runs_total: int | None = None) -> str:
    """The recipe's ``report.md``: one row per finished run (fewer than ``runs_total``: partial)."""
    clm = results[0]["objective"] == "clm"
    metric = "perplexity" if clm else "MLM accuracy"
    lines = [f"# Pretraining recipe `{name}`", ""]
    if runs_total is not None and len(results) < runs_total:
        lines += [f"**Partial: {len(results)} of {runs_total} runs finished.**", ""]
    lines += [f"| run | mechanisms | parameters | steps | tokens | held-out loss | held-out {metric} | tokens/s "
              f"| minutes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        value = r["valid_perplexity"] if clm else r["valid_accuracy"]
        mechs = " + ".join(m if isinstance(m, str) else m["name"] for m in r["mechanisms"]) or "none"
        lines.append(f"| {r['label']} | {mechs} | {r['parameters']:,} | {r['steps']} | {r['tokens']:,} | "
                     f"{r['valid_loss']:.3f} | {value:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['train_seconds'] / 60:.1f} |")
    return "\n".join(lines) + "\n"


def write_summary(name: str, results: list[dict[str, Any]], out: Path, runs_total: int | None = None) -> None:
    """``results.json`` (the records without their histories), ``report.md`` and ``valid_loss.png``."""
    write_json_atomic(out / "results.json", [{k: v for k, v in r.items() if k != "history"} for r in results],
                      indent=2)
    write_text_atomic(out / "report.md", summary_text(name, results, runs_total))
    plot_recipe({r["label"]: r.get("history", []) for r in results}, out / "valid_loss.png",
                f"{name}: held-out loss")
