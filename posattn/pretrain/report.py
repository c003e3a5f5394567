"""``report.md``, ``results.json`` and ``valid_loss.png`` of a pretraining recipe, from its runs' records.

A run's record is its ``result.json`` with its ``label`` and its metrics ``history`` (the rows of
``metrics.jsonl``): what :func:`finished_run` reads from a run folder and what the results store
keeps, so that ``posattn pretrain`` and ``posattn report`` write the same summary.

A recipe's ``posattn eval-lm`` rows in the store (``lengths`` records) add a section: perplexity
against evaluation length, its plots and the papers' length-extrapolation claims
(:data:`LENGTH_CLAIMS`) judged on paired per-block losses.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..claims import SIGMAS, Claim, Relation, combine, judge, parse_claims, report_row
from ..errors import PositionError
from ..experiments.store import read_json
from ..markdown import table as md_table
from ..runtime.files import write_json_atomic, write_text_atomic
from ..runtime.metrics import METRICS
from .lm_eval import LENGTHS, length_table
from .plots import plot_lengths, plot_recipe
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
        mechs = " + ".join(m if isinstance(m, str) else m["name"] + " (" + ", ".join(
            f"{k}={v}" for k, v in m.items() if k != "name") + ")" for m in r["mechanisms"]) or "none"
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


# -- perplexity against evaluation length (posattn eval-lm rows in the results store) -------------------
PERPLEXITY_PLOT = "perplexity_vs_length.png"
SCALING_PLOT = "perplexity_vs_length_rope_scaling.png"

# The papers' length-extrapolation claims, judged on a recipe's eval-lm rows (the row labels of
# posattn/pretrain/configs/length_extrapolation*.yaml and their "+ rescaling" rows). ``a > b``: a's
# held-out loss is lower than b's; ``a !> b``: b's is not lower beyond noise.
LENGTH_CLAIMS: list[dict[str, Any]] = [
    {"claim": "ALiBi extrapolates beyond its training length where rotary does not (ALiBi, Press et al. 2022, "
              "abstract, Fig 1)",
     "paper": "a 1.3B-parameter LM trained at 1024 tokens reaches at 2048 tokens the perplexity of a "
              "sinusoidal model trained at 2048 (abstract); WikiText-103 LMs trained at 512-1024 tokens: "
              "ALiBi's perplexity does not degrade far beyond the training length while rotary's and "
              "sinusoidal's rise (Fig 1)",
     "holds": ["alibi > rope"]},
    {"claim": "KERPLE's log kernel extrapolates at least as well as ALiBi and better than rotary (KERPLE, Chi et "
              "al. 2022, Table 3)",
     "paper": "small GPT-NeoX LMs trained at 512 tokens on OpenWebText2, GitHub and ArXiv, tested at 512-16384: "
              "the log variant's perplexity stays low on all three, at or below ALiBi's at the longer lengths in "
              "most cells; rotary's grows sharply beyond the training length",
     "holds": ["kerple > rope", "alibi !> kerple"]},
    {"claim": "FIRE generalizes to longer contexts better than RoPE, ALiBi and KERPLE (FIRE, Li et al. 2023, "
              "Fig 1 and §4.1)",
     "paper": "LMs trained at 2048 tokens on C4, zero-shot at up to 4x that length: FIRE's log perplexity "
              "beyond the training length is the lowest of the encodings compared; RoPE's rises sharply",
     "holds": ["fire > rope", "alibi !> fire", "kerple !> fire"]},
    {"claim": "CoPE generalizes to longer contexts better than token-count positions (CoPE, Golovneva et al. "
              "2024, §5)",
     "paper": "WikiText-103 LMs: lower perplexity than absolute and relative position embeddings, also at "
              "contexts longer than trained; code LMs: lower perplexity than RoPE",
     "holds": ["cope > rope"]},
    {"claim": "YaRN extends a rotary model beyond its training length without fine-tuning, better than position "
              "interpolation (YaRN, Peng et al. 2023, dynamic scaling)",
     "paper": "LLaMA models trained at 2048-4096 tokens: with the scale factor set from the input length at "
              "inference (Dynamic-YaRN), more than 2x context extension without fine-tuning, with lower "
              "perplexity than Dynamic-PI beyond the training length",
     "holds": ["rope + yarn > rope", "rope + yarn > rope + linear"]},
]


def length_rows(records: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """The eval-lm rows of ``records`` (store results), one per row label: rows of one label from
    several records (the plain rope row that every ``--rope-scaling`` folder repeats, or lengths run
    in parts) merge, the first value of each length kept. Ordered as the recipe's ``labels``, each
    model's rescalings after it."""
    merged: dict[str, dict[str, Any]] = {}
    for r in records:
        row = merged.setdefault(r["label"], {**r, **{k: {} for k in ("valid_loss", "valid_perplexity",
                                                                    "block_losses", "skipped")}})
        for key in ("valid_loss", "valid_perplexity", "block_losses", "skipped"):
            for n, value in (r.get(key) or {}).items():
                row[key].setdefault(n, value)
    order = {label: i for i, label in enumerate(labels)}

    def position(row: dict[str, Any]) -> tuple:
        base = row["label"].split(" + ")[0]
        return order.get(base, len(order)), base, row.get("rope_scaling") or ""

    for row in merged.values():
        for key in ("valid_loss", "valid_perplexity", "block_losses"):
            row[key] = dict(sorted(row[key].items(), key=lambda item: int(item[0])))
    return sorted(merged.values(), key=position)


def _paired(rows: dict[str, dict[str, Any]], rel: Relation, length: str) -> dict[str, list[float]] | None:
    """Scores for :func:`posattn.claims.judge` that make its comparison a paired one: the right row's
    block losses minus the left row's (positive: left is better), against zeros, so that the standard
    error is that of the per-block differences on the same text. None if a row lacks the length."""
    a, b = (rows.get(label, {}).get("block_losses", {}).get(length) for label in (rel.left, rel.right))
    if not a or not b or len(a) != len(b):
        return None
    return {rel.left: [y - x for x, y in zip(a, b)], rel.right: [0.0] * len(a)}


def length_claim_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Each of :data:`LENGTH_CLAIMS` judged at the longest evaluation length its rows share beyond the
    training length (as the synthetic recipes judge theirs, ``at: {length: longest}``) on the paired
    block losses (:func:`_paired`); a claim's verdict combines its relations."""
    by_label = {r["label"]: r for r in rows}
    out = []
    for c in parse_claims(LENGTH_CLAIMS, []):
        verdicts, details = [], []
        for rel in c.holds:
            train = max((by_label[label]["train_length"] for label in (rel.left, rel.right) if label in by_label),
                        default=0)
            shared = [n for n in by_label.get(rel.left, {}).get("block_losses", {})
                      if int(n) > train and _paired(by_label, rel, n) is not None]
            if not shared:
                missing = [label for label in (rel.left, rel.right) if label not in by_label]
                verdicts.append("not measured")
                details.append(f"{rel}: not measured (" + (f"no row {', '.join(missing)}" if missing else
                                                          "no common length beyond training") + ")")
                continue
            n = max(shared, key=int)
            verdict, lines = judge(Claim(c.claim, c.paper, (rel,)), _paired(by_label, rel, n))
            verdicts.append(verdict)
            details.append(f"{n}: {lines[0]}")
        out.append(report_row(c, combine(verdicts), details))
    return out


def lengths_text(records: list[dict[str, Any]], labels: list[str], provenance: list[dict[str, str]]) -> str:
    """The report's section on perplexity against evaluation length: the table, the two plots, the
    papers' claims judged, and the commands that made the models and rows (``provenance``, in order,
    with their dates and hardware)."""
    rows = length_rows(records, labels)
    train = rows[0]["train_length"]
    blocks = max((len(v) for r in rows for v in r["block_losses"].values()), default=0)
    lines = ["## Held-out perplexity against evaluation length", "",
             f"Models trained at {train} tokens, scored on the same held-out tokens in windows of each length "
             f"(`posattn eval-lm`); `model + KIND`: the model's rope rescaled at evaluation by KIND with factor "
             f"length / {train}.", "", *length_table(rows, ratio=True), "",
             f"![perplexity against evaluation length]({PERPLEXITY_PLOT})", ""]
    if any(r.get("rope_scaling") for r in rows):
        lines += [f"![rope and xPos with each rescaling]({SCALING_PLOT})", ""]
    lines += [f"### The papers' claims, judged at the longest length (a difference counts beyond {SIGMAS:g} s.e.)",
              "",
              f"`a − b = d ± s.e.` at the longest length both rows have: b's held-out loss minus a's (nats per "
              f"token; positive: a is better), the mean over {blocks} blocks of the same text and its standard "
              f"error. Like the papers, this compares perplexity at the long length itself, which includes each "
              f"model's quality at the training length; the table's last column (perplexity at the longest "
              f"length over perplexity at {train}) shows the change with length alone. These are the papers' "
              f"claims for models of hundreds of millions of parameters; a verdict says what this scale shows, "
              f"no more.", "",
              *md_table(["claim", "paper", "ours", "verdict"], length_claim_rows(rows)),
              "### Reproduce", ""]
    for command, date, hardware in dict.fromkeys((p["command"], p["date"], p["hardware"]) for p in provenance):
        lines.append(f"- `{command}` ({date}, {hardware})")
    return "\n".join(lines) + "\n"


def write_length_report(records: list[dict[str, Any]], labels: list[str], out: Path) -> None:
    """``lengths.json`` (the merged rows) and the two plots: every model unscaled, and the rope and
    xPos models with their rescalings."""
    rows = length_rows(records, labels)
    write_json_atomic(out / LENGTHS, rows, indent=2)
    train = rows[0]["train_length"]
    plot_lengths([r for r in rows if not r.get("rope_scaling")], out / PERPLEXITY_PLOT, train, "valid_perplexity")
    scaled = {r["label"].split(" + ")[0] for r in rows if r.get("rope_scaling")}
    if scaled:
        plot_lengths([r for r in rows if r["label"].split(" + ")[0] in scaled], out / SCALING_PLOT, train,
                     "valid_perplexity")
