"""The ``compare`` sub-command of ``posattn``; :func:`register` adds it to the main parser."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from posattn.experiments.executors import add_executor_options, executor_from
from posattn.options import add_compile_option, add_device_option, add_threads_option
from posattn.synthetic.compare import builtin_configs, load_config, run_sweep, schema_text, validate_config

DESCRIPTION = """\
Train position mechanisms side by side on a synthetic recall/copying task, evaluate every
model at several test lengths, and write results.json, report.md and PNG plots.
Without CONFIG it runs the built-in `default` sweep (MQAR, 1-layer cat vs 2-layer attention with
other mechanisms, trained at one length, tested at 1x-8x; about 1.5 minutes of CPU time, 3-4
minutes of wall time on a busy 2-core machine).
Finished cells are never re-run: rerun the same command to resume an interrupted sweep."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``compare`` to ``subparsers``; the parsed namespace's ``func`` runs it and returns an exit code."""
    parser = subparsers.add_parser("compare", help="train mechanisms side by side on recall/copying tasks",
                                   description=DESCRIPTION, epilog=schema_text(),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=None,
                        help=f"YAML config file or built-in name ({', '.join(builtin_configs())}); default: default")
    add_sweep_options(parser, "compare")
    parser.set_defaults(func=run, writes={
        "OUT/cells/<id>/": "one cell: result.json when finished, metrics.jsonl, checkpoint.pt while it "
                           "trains, model/ (a posattn checkpoint)",
        "OUT/results.json": "every cell's result and the sweep's config",
        "OUT/report.md": "accuracy against test length and width, the claims' verdicts",
        "OUT/accuracy_vs_*.png": "the report's plots"})
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
    out = args.out or f"runs/compare-{sweep.name}"
    executor = executor_from(args, args.threads, raw.get("executor"), out)
    run_sweep(sweep, out, executor, device=args.device, progress=not args.no_progress, report_only=args.report,
              compile=args.compile)
    print((Path(out) / "report.md").read_text())
    print(f"results, report and plots in {out}/")

