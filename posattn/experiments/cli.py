"""The ``results`` sub-command of ``posattn`` (the results store); :func:`register` adds it."""
from __future__ import annotations

import argparse

from posattn.experiments import store
from posattn.experiments.publish import add_run

RESULTS_HELP = """\
The results store: results/<recipe>/<cell id>.json, one small record per finished cell with its
provenance (date, hardware, command), committed with the code so that results outlive the machine
that ran them. `results add RUN` copies the finished cells of run folders in (a compare sweep, a
fine-tuning suite, a pretraining run or recipe, the TISA Table 3 study); cells from any machine
merge by id and a cell already there is kept. `results list` shows each recipe's cells present
and in all."""


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
        recipe = next((r["result"] for r in records if r["kind"] == "recipe"), {})
        total = recipe.get("cells_total")
        what = f"{cells}/{total if total is not None else '?'} cells"
        print(f"{name:28s} {recipe.get('sweep', 'summary' if summaries else '?'):9s} {what}"
              + (f", {summaries} summary table(s)" if summaries else ""))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``results`` (``add``, ``list``) to the main parser."""
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
    a.set_defaults(func=add_command)
    s = sub.add_parser("list", help="every recipe in the store with its cells present / in all")
    s.set_defaults(func=list_command)
    for p in (a, s):
        p.add_argument("--results", default=None, help=f"the store's folder (default ${store.ROOT_ENV}, else results)")
