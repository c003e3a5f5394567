"""The ``compare`` sub-command of ``posattn``; :func:`register` adds it to the main parser."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import yaml

from posattn.experiments import store
from posattn.experiments.config import ConfigError
from posattn.experiments.executors import add_executor_options, executor_from
from posattn.experiments.publish import add_run, stored_cells
from posattn.options import add_compile_option, add_device_option, add_threads_option
from posattn.runtime.device import resolve_device
from posattn.synthetic.compare import Sweep, builtin_configs, load_config, run_sweep, schema_text, validate_config

DESCRIPTION = """\
Train position mechanisms side by side on a synthetic recall/copying task, evaluate every
model at several test lengths, and write results.json, report.md and PNG plots.
Without CONFIG it runs the built-in `default` sweep (MQAR, 1-layer cat vs 2-layer attention with
other mechanisms, trained at one length, tested at 1x-8x; about 1.5 minutes of CPU time, 3-4
minutes of wall time on a busy 2-core machine).
Finished cells are never re-run: rerun the same command to resume an interrupted sweep.
With --store, the cells already in the results store (results/<name>/, from any machine) count
as finished too, and each cell this run finishes is added to it as it finishes: a long recipe is
finished a few cells at a time, on any machine, e.g.
`posattn compare cat_fair_ar_length --store --time-limit 3600`, then commit results/."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``compare`` to ``subparsers``; the parsed namespace's ``func`` runs it and returns an exit code."""
    parser = subparsers.add_parser("compare", help="train mechanisms side by side on recall/copying tasks",
                                   description=DESCRIPTION, epilog=schema_text(),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=None,
                        help=f"YAML config file or built-in name ({', '.join(builtin_configs())}); default: default")
    add_sweep_options(parser, "compare")
    parser.add_argument("--only", nargs="+", metavar="MODEL_OR_ID",
                        help="train only the cells of these models (their labels, e.g. 'cat (1L)') or with these "
                             "cell ids, the others waiting for a later run; the report covers every finished cell")
    parser.add_argument("--store", action="store_true",
                        help=f"take the cells in the results store (${store.ROOT_ENV}, else results/) as finished and "
                             f"add each cell this run finishes to it as it finishes")
    parser.set_defaults(func=run, writes={
        "OUT/cells/<id>/": "one cell: result.json when finished, metrics.jsonl, checkpoint.pt while it "
                           "trains, model/ (a posattn checkpoint)",
        "OUT/results.json": "every cell's result and the sweep's config",
        "OUT/report.md": "accuracy against test length and width, the claims' verdicts",
        "OUT/accuracy_vs_*.png": "the report's plots",
        "results/<name>/<id>.json": "with --store: one record per cell this run finished (and recipe.json)"})
    return parser


def add_sweep_options(parser: argparse.ArgumentParser, command: str) -> None:
    """The options every sweep command shares: --out, the executor's (--workers, --time-limit), --threads,
    --device, --compile, --no-progress, --dump-config, --report."""
    parser.add_argument("--out", default=None, help=f"output folder (default: runs/{command}-<name>)")
    add_executor_options(parser)
    add_threads_option(parser)
    add_device_option(parser)
    add_compile_option(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--dump-config", action="store_true", help="print the config's YAML and exit")
    parser.add_argument("--report", action="store_true",
                        help="train nothing: write the report and plots of the cells finished so far (e.g. while "
                             "the sweep runs elsewhere) and say how many are missing")


def run(args: argparse.Namespace) -> None:
    """Run ``posattn compare`` with parsed arguments; a bad config raises :class:`ConfigError`."""
    raw = load_config(args.config)
    if args.dump_config:
        print(yaml.safe_dump(raw, sort_keys=False), end="")
        return
    sweep = validate_config(raw)
    only = chosen_cells(sweep, args.only) if args.only else None
    out = args.out or f"runs/compare-{sweep.name}"
    executor = executor_from(args, args.threads, raw.get("executor"), out)
    stored = stored_cells(sweep.name, "compare", sweep.config, f"sweep {sweep.name!r}") if args.store else None
    publish = None
    if stored is not None and not args.report:
        command, hardware = store_command(args, sweep.name), store.hardware(resolve_device(args.device))

        def publish(*_: object) -> None:   # every finished cell of the run folder (a cell already there is kept)
            add_run(out, command=command, hardware=hardware)
    try:
        run_sweep(sweep, out, executor, device=args.device, progress=not args.no_progress, report_only=args.report,
                  compile=args.compile, stored=stored, on_cell=publish, only=only)
    finally:   # also when the sweep stops on an error: the cells finished so far are in the store
        if publish is not None and (Path(out) / "config.yaml").exists():
            publish()
            ids = {cell.id for cell in sweep.cells}
            now = ids & {r["id"] for r in store.load(sweep.name, kind="cell")}
            print(f"results store: {len(now - set(stored))} cell(s) of this run added to "
                  f"{store.results_root()}/{sweep.name}/, {len(now)} of {len(ids)} cells there")
    print((Path(out) / "report.md").read_text())
    print(f"results, report and plots in {out}/")


def chosen_cells(sweep: Sweep, only: list[str]) -> set[str]:
    """The ids of the cells ``--only`` names, by model label or cell id; one ConfigError naming
    the labels there are when an entry matches no cell."""
    labels = list(dict.fromkeys(cell.label for cell in sweep.cells))
    unknown = [x for x in only if x not in labels and x not in {cell.id for cell in sweep.cells}]
    if unknown:
        raise ConfigError(f"--only: no model or cell {', '.join(map(repr, unknown))} in sweep {sweep.name!r}; "
                          f"its models: {', '.join(map(repr, labels))}")
    return {cell.id for cell in sweep.cells if cell.label in only or cell.id in only}


def store_command(args: argparse.Namespace, name: str) -> str:
    """The command that trains a recipe's cells with --store, as its store records give it."""
    command = ["posattn", "compare", args.config or name, "--store"]
    if args.device != "auto":
        command += ["--device", args.device]
    if args.workers not in (None, 1):
        command += ["--workers", str(args.workers)]
    if args.compile:
        command += ["--compile", args.compile]
    if args.only:
        command += ["--only", *args.only]
    return shlex.join(command)
