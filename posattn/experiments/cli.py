"""The ``results`` and ``report`` sub-commands of ``posattn`` (the results store); :func:`register` adds them."""
from __future__ import annotations

import argparse
import sys

from posattn.experiments import store
from posattn.experiments.publish import add_run
from posattn.experiments.report import build

RESULTS_HELP = """\
The results store: results/<recipe>/<cell id>.json, one small record per finished cell with its
provenance (date, hardware, command), committed with the code so that results outlive the machine
that ran them. `results add RUN` copies the finished cells of run folders in (a compare sweep, a
fine-tuning suite, a pretraining run or recipe, the TISA Table 3 study); cells from any machine
merge by id and a cell already there is kept. `results list` shows each recipe's cells present
and in all."""


REPORT_HELP = """\
Rebuild a recipe's report (report.md, results.json, the claims' verdicts and the plots) from its
cells in results/<recipe>/ plus the finished cells of local run folders (--runs), with the report
code of its kind of sweep, and say how many of the recipe's cells are present and missing. A recipe
whose cells are gone is rendered from its summary data (results/<recipe>/summary-*.json), claims
re-judged where the per-seed scores are recorded. --markdown prints the tables as Markdown only
(to paste or generate the README's and the docs' tables) and writes nothing."""


def report_command(args: argparse.Namespace) -> None:
    out = None if args.markdown else (args.out or f"runs/report-{store.check_name(args.recipe, 'recipe')}")
    got, text = build(args.recipe, args.results, args.runs or [], out)
    print(text)
    print(got.counts(), file=sys.stderr if args.markdown else sys.stdout)
    if out is not None:
        print(f"report, results and plots in {out}/")


def add_command(args: argparse.Namespace) -> None:
    for run in args.runs:
        print(add_run(run, args.recipe, args.results, command=args.command, hardware=args.hardware))


def list_command(args: argparse.Namespace) -> None:
    names = store.recipes(args.results)
    if not names:
        print(f"no recipe in {store.results_root(args.results)}/")
    for name in names:
        records = store.load(name, args.results)
        cells = sum(r["kind"] == "cell" for r in records)
        summaries = sum(r["kind"] == "summary" for r in records)
        recipe = next((r["result"] for r in records if r["kind"] == "recipe"), None)
        lengths = sum(r["kind"] == "lengths" for r in records)
        tables = ", ".join(filter(None, [f"{summaries} summary table(s)" if summaries else "",
                                         f"{lengths} eval-lm row(s)" if lengths else ""]))
        if recipe is None:
            print(f"{name:28s} {'-':9s} {tables or f'{cells} cells'}")
            continue
        total = recipe.get("cells_total")
        present = f"{cells}/{total if total is not None else '?'} cells"
        print(f"{name:28s} {recipe['sweep']:9s} {present}" + (f", {tables}" if tables else ""))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``results`` (``add``, ``list``) and ``report`` to the main parser."""
    fmt = argparse.RawDescriptionHelpFormatter
    r = subparsers.add_parser("results", help="the results store: add finished cells of run folders, list recipes",
                              description=RESULTS_HELP, formatter_class=fmt)
    sub = r.add_subparsers(dest="results_command", required=True)
    a = sub.add_parser("add", help="copy the finished cells of run folders into results/<recipe>/",
                       description=RESULTS_HELP, formatter_class=fmt)
    a.add_argument("runs", nargs="+", metavar="RUN", help="run folders (runs/compare-NAME, runs/finetune-NAME, "
                   "runs/pretrain-NAME, runs/hf/table3)")
    a.add_argument("--recipe", help="store them under this recipe name (default: the sweep's own name)")
    a.add_argument("--command", help="the command that ran them (default: read from the run folder's config)")
    a.add_argument("--hardware", help="the machine they ran on (default: the device the run recorded, else "
                   "this machine's GPU or CPU)")
    a.set_defaults(func=add_command, writes={
        "results/<recipe>/<id>.json": "one record per finished cell (date, hardware, command, result)",
        "results/<recipe>/recipe.json": "what the recipe is: its sweep, config and number of cells"})
    s = sub.add_parser("list", help="every recipe in the store with its cells present / in all")
    s.set_defaults(func=list_command)
    p = subparsers.add_parser("report", help="a recipe's tables, claims and plots from results/ plus local runs",
                              description=REPORT_HELP, formatter_class=fmt)
    p.add_argument("recipe", metavar="RECIPE", help="a recipe in the store (posattn results list)")
    p.add_argument("--runs", nargs="+", metavar="FOLDER", help="local run folders whose finished cells join the "
                   "store's (merged by id)")
    p.add_argument("--out", help="output folder (default runs/report-RECIPE)")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown only; write nothing")
    p.set_defaults(func=report_command, writes={
        "OUT/report.md": "the recipe's tables and the claims' verdicts (nothing with --markdown)",
        "OUT/results.json": "the results the tables are made of",
        "OUT/*.png": "the recipe's plots"})
    for q in (a, s, p):
        q.add_argument("--results", default=None, help=f"the store's folder (default ${store.ROOT_ENV}, else results)")
