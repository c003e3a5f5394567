"""``posattn report RECIPE``: a recipe's tables, claims and plots, from the results store plus local runs.

The cells of ``results/<recipe>/`` and of any run folders given (merged by id; the store's record
of a cell wins) go through the report code of their kind of sweep, the same functions the sweep
itself calls: :mod:`posattn.synthetic.report` (compare), :mod:`posattn.finetune.report` (fine-tuning
suites), :mod:`posattn.pretrain.report` (pretraining recipes), :mod:`posattn.hf.table3` and
:mod:`posattn.bench.records` (the GPU benchmark recipes, whose records carry their provenance). A
recipe known only by summary records (tables whose cells are gone) is rendered from that data by
:mod:`posattn.experiments.summary`; while its cells are re-run, the summary tables follow the
partial report until every cell is present. A pretraining recipe's ``posattn eval-lm`` rows
(``lengths`` records) add its perplexity-against-length section
(:func:`posattn.pretrain.report.lengths_text`). The report says how many of the recipe's cells are
present.
"""
from __future__ import annotations

import copy
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posattn.errors import PositionError
from posattn.experiments import store
from posattn.experiments.publish import comparable
from posattn.experiments.runs import read_run
from posattn.experiments.summary import summary_report
from posattn.markdown import table
from posattn.runtime.files import write_json_atomic, write_text_atomic


@dataclass
class Gathered:
    """What is known of a recipe: its sweep and config (from ``recipe.json`` or a run folder), its
    finished cells by id, its summary records, and the store's folder they were read from."""

    recipe: str
    root: str | Path | None = None
    sweep: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    total: int | None = None
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)
    summaries: list[dict[str, Any]] = field(default_factory=list)
    lengths: list[dict[str, Any]] = field(default_factory=list)   # eval-lm rows, whole records
    made_by: dict[str, str] | None = None   # the provenance of recipe.json: the command that trains the recipe
    provenance: dict[str, dict[str, str]] = field(default_factory=dict)   # cell id -> its record's provenance

    def counts(self) -> str:
        """``N of M cells present (K missing)``, or what the summary data holds."""
        if self.cells or self.sweep:
            if self.total is None:
                return f"{self.recipe}: {len(self.cells)} cells present (the recipe's total is not known)"
            return (f"{self.recipe}: {len(self.cells)} of {self.total} cells present "
                    f"({max(0, self.total - len(self.cells))} missing)")
        if not self.summaries:
            return f"{self.recipe}: no cells; {len(self.lengths)} eval-lm row(s)"
        dates = sorted({r["provenance"]["date"] for r in self.summaries})
        return (f"{self.recipe}: no cells; {len(self.summaries)} summary table(s) measured {', '.join(dates)}, "
                f"regenerated from their recorded numbers")


def gather(recipe: str, root: str | Path | None = None, runs: list[str | Path] = ()) -> Gathered:
    """The records of ``recipe`` in the store plus the finished cells of ``runs``; one error if there is
    nothing, or if a run folder holds another config under this name."""
    got = Gathered(store.check_name(recipe, "recipe"), root)
    for record in store.load(recipe, root):
        if record["kind"] == "recipe":
            got.sweep, got.config, got.total = (record["result"]["sweep"], record["result"]["config"],
                                                record["result"]["cells_total"])
            got.made_by = record["provenance"]
        elif record["kind"] == "summary":
            got.summaries.append(record)
        elif record["kind"] == "lengths":
            got.lengths.append(record)
        else:
            got.cells[record["id"]] = record["result"]
            got.provenance[record["id"]] = record["provenance"]
    for folder in runs:
        run = read_run(folder)
        if got.sweep is None:
            got.sweep, got.config, got.total = run.sweep, run.config, run.total
        elif run.sweep != got.sweep or comparable(run.sweep, run.config) != comparable(got.sweep, got.config):
            raise PositionError(f"{folder}: its {run.sweep} config is not the one of recipe {recipe!r} in the store")
        for cell_id, result in run.cells.items():
            got.cells.setdefault(cell_id, result)
    if got.sweep is None and not got.summaries and not got.lengths:
        known = ", ".join(store.recipes(root)) or "none"
        raise PositionError(f"no recipe {recipe!r} in {store.results_root(root)}/ and no run folder given "
                            f"(recipes there: {known}); add cells with `posattn results add RUN`")
    return got


def _compare(got: Gathered, out: Path | None) -> str:
    from posattn.synthetic.report import report_text, select_lr, summarise, write_plots

    results = sorted(copy.deepcopy(list(got.cells.values())),
                     key=lambda r: (r["train_length"], r["d_model"], r["label"], r["lr"], r["seed"]))
    select_lr(results)
    text = report_text(got.config, results, got.total or len(results))
    if out is not None:
        write_json_atomic(out / "results.json", summarise(got.recipe, got.config, results, got.total))
        write_plots(got.config, results, out)
    return text


def _finetune(got: Gathered, out: Path | None) -> str:
    from posattn.finetune.report import report_text, summarise, write_plots

    cells = sorted(got.cells.values(), key=lambda c: (c["seed"], c["label"], c["task"]))
    summary = summarise(got.recipe, got.config, cells, got.total or len(cells))
    if out is not None:
        write_json_atomic(out / "results.json", summary)
        write_plots(got.config, summary, out)
    return report_text(got.config, summary)


def _pretrain(got: Gathered, out: Path | None) -> str:
    from posattn.pretrain.report import summary_text, write_summary

    order = {label: i for i, label in enumerate(got.config.get("labels", []))}
    results = sorted(got.cells.values(), key=lambda r: (order.get(r["label"], len(order)), r["label"]))
    if out is not None:
        write_summary(got.recipe, results, out, got.total)
    return summary_text(got.recipe, results, got.total)


def _table3(got: Gathered, out: Path | None) -> str:
    from posattn.hf.table3 import report, summarise, write

    cells, tasks = list(got.cells.values()), got.config["tasks"]
    folder = str(got.config.get("model") or "model")
    meta = {"model": Path(folder).name, "protocol": got.config.get("protocol") or ""}
    if out is not None:
        write(out, cells, tasks, meta["model"], folder, meta["protocol"], plots=True)
    return report(cells, summarise(cells, tasks), tasks, meta)


def _bench(got: Gathered, out: Path | None) -> str:
    from posattn.bench.records import report

    return report(got.recipe, got.config, got.root, out)


def _lengths(got: Gathered, out: Path | None) -> str:
    from posattn.pretrain.report import lengths_text, write_length_report

    rows, labels = [r["result"] for r in got.lengths], got.config.get("labels", [])
    if out is not None:
        write_length_report(rows, labels, out)
    commands = sorted((r["provenance"] for r in got.lengths), key=lambda p: p["command"])
    return lengths_text(rows, labels, [got.made_by] * (got.made_by is not None) + commands)


ONE_CELL = "CELL_ID"


def one_cell_command(command: str) -> str:
    """``command`` with the cells its ``--only`` picked (ids or model labels) replaced by
    :data:`ONE_CELL`: the command that retrains any one of them, so that the runs that differ only
    in the cells they were given count as one way of training."""
    try:
        words = shlex.split(command)
    except ValueError:   # not a shell line (a record written by hand): shown as it is
        return command
    if "--only" not in words:
        return command
    at = words.index("--only") + 1
    end = next((i for i in range(at, len(words)) if words[i].startswith("--")), len(words))
    return shlex.join([*words[:at], ONE_CELL, *words[end:]])


def cells_provenance(got: Gathered) -> list[str]:
    """Where the cells come from: how many each (hardware, command) trained, and when, the cells
    a run was given (``--only``) folded to one (:func:`one_cell_command`); cells of local run
    folders, not in the store, are counted apart."""
    groups: dict[tuple[str, str], list[str]] = {}
    for cell_id in got.cells:
        prov = got.provenance.get(cell_id)
        key = (prov["hardware"], one_cell_command(prov["command"])) if prov else ("", "")
        groups.setdefault(key, []).append(prov["date"] if prov else "")
    rows = []
    for (hardware, command), dates in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        if not hardware:
            rows.append([str(len(dates)), "–", "a local run folder (not in the store)", "–"])
            continue
        span = min(dates) if min(dates) == max(dates) else f"{min(dates)} to {max(dates)}"
        rows.append([str(len(dates)), span, hardware, f"`{command}`"])
    folded = any(f"--only {ONE_CELL}" in command for _, command in groups)
    return ["## Where the cells come from", "",
            "Times in the tables are wall time on the machine that trained the cell."
            + (f" `--only {ONE_CELL}` stands for the cells a run was given: with a cell's id it retrains "
               "that cell (its record in the store keeps the whole command)." if folded else ""), "",
            *table(["cells", "date", "hardware", "command"], rows)]


REPORTS = {"compare": _compare, "finetune": _finetune, "pretrain": _pretrain, "table3": _table3, "bench": _bench}


def build(recipe: str, root: str | Path | None = None, runs: list[str | Path] = (),
          out: str | Path | None = None) -> tuple[Gathered, str]:
    """The recipe's report text; with ``out``, also written there (report.md, results.json, plots)."""
    got = gather(recipe, root, runs)
    folder = None if out is None else Path(out)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    if got.sweep is None and not got.summaries:   # eval-lm rows only
        text = f"# Pretraining recipe `{recipe}`\n"
    elif got.sweep is None or (not got.cells and got.summaries):
        text = summary_report(recipe, got.summaries, root)
        if folder is not None:
            write_json_atomic(folder / "results.json", {"name": recipe, "summaries": got.summaries})
    else:
        text = REPORTS[got.sweep](got, folder)
        if got.cells and got.sweep != "bench":   # benchmark records give their provenance per table
            text = text.rstrip() + "\n\n" + "\n".join(cells_provenance(got))
        if got.summaries and len(got.cells) < (got.total or 0):   # the measured table stands until the cells do
            text += "\n\n" + summary_report(recipe, got.summaries, root)
    if got.lengths:
        text = text.rstrip() + "\n\n" + _lengths(got, folder)
    if folder is not None:
        write_text_atomic(folder / "report.md", text)
    return got, text
