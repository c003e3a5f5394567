"""``posattn`` command line. Each area adds its sub-commands through ``register(subparsers)``.

Every command ends a bad input the same way: one ``posattn: error: ...`` line on stderr, exit
status 2 for a bad command line, configuration or file (:class:`~posattn.errors.PositionError`,
also when a worker process finds it: :class:`~posattn.errors.CellInputError`), 1 for a failure
while running (a worker's error, an operating-system error such as a full disk, an error no check
foresaw), 130 when interrupted, and no Python traceback unless ``--debug`` asks for one.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import NoReturn

from . import __version__
from .errors import CellError, PositionError, RunError
from .heap import keep_freed_memory
from .options import add_json_option, check_args, positive_int

AREAS = ["posattn.synthetic.cli", "posattn.pretrain.cli", "posattn.bench.cli", "posattn.analysis.cli",
         "posattn.finetune.cli", "posattn.experiments.cli", "posattn.studies"]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one ``posattn: error:`` line (exit 2) instead of a usage
    block; the line names the command and where its help is. Sub-commands inherit it."""

    def error(self, message: str) -> NoReturn:
        for action in self._actions:   # a missing sub-command: say which there are
            if isinstance(action, argparse._SubParsersAction) and f"required: {action.dest}" in message:
                message += f" (one of {', '.join(action.choices)})"
        command = self.prog.removeprefix("posattn").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"posattn: error: {where}{message}; see `{self.prog} --help`\n")


def mechanisms_command(args: argparse.Namespace) -> None:
    """Print every mechanism's properties, computed from its code (TISA Tables 1-2)."""
    from .mechanisms import Dims, names, properties

    if args.d_model % args.heads:
        raise PositionError(f"mechanisms: --d-model {args.d_model} is not a multiple of --heads {args.heads}")
    dims = Dims(args.d_model, args.heads, args.layers, args.max_len, 2, args.decoder)
    rows = [properties(n, dims) for n in names()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    head = ["name", "acts on", "inductive", "transl. inv.", "pos. params", "decoder", "paper"]
    table = [[r["name"], ",".join(r["acts_on"]) or "-", "yes" if r["inductive"] else "no",
              "yes" if r["translation_invariant"] else "no", f"{r['positional_params']:,}",
              "yes" if r["decoder"] else "no", r["paper"]]
             for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    kind = "a decoder" if args.decoder else "an encoder"
    print(f"positional parameters for {kind} with d_model={args.d_model}, heads={args.heads}, "
          f"layers={args.layers}, max_len={args.max_len}")
    for row in [head, ["-" * w for w in widths], *table]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="posattn", description="Positional information inside attention: "
               "list mechanisms, compare them, benchmark them, look inside models.")
    p.add_argument("--version", action="version", version=f"posattn {__version__}",
                   help="print posattn's version and exit")
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the Python traceback as well as the one-line message")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mechanisms", help="list every mechanism with its properties",
                       description="Every registered mechanism with its properties, computed from its code for "
                                   "the model size given (TISA Tables 1-2).")
    add_json_option(m)
    m.add_argument("--d-model", type=positive_int, default=768, help="model width (default 768, BERT-base)")
    m.add_argument("--heads", type=positive_int, default=12, help="attention heads (default 12)")
    m.add_argument("--layers", type=positive_int, default=12, help="layers (default 12)")
    m.add_argument("--max-len", type=positive_int, default=512, help="longest sequence (default 512)")
    m.add_argument("--decoder", action="store_true", help="count for a causal decoder")
    m.set_defaults(func=mechanisms_command)
    for area in AREAS:
        importlib.import_module(area).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (0: done, 1: it failed while running, 2: bad input)."""
    args = parser().parse_args(argv)
    keep_freed_memory()  # large CPU tensors reuse freed memory instead of page-faulting (posattn.heap)
    try:
        check_args(args)
        status = args.func(args)
    except (PositionError, RunError, OSError) as e:
        if args.debug:
            raise
        print(f"posattn: error: {_message(e)}", file=sys.stderr)
        return 2 if isinstance(e, PositionError) else 1
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("posattn: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - an error no check foresaw: still one line; --debug shows where
        if args.debug:
            raise
        print(f"posattn: error: {_first_line(e)} (unforeseen: `posattn --debug ...` shows the traceback)",
              file=sys.stderr)
        return 1
    return status or 0


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _message(error: Exception) -> str:
    """The one line an error prints: a worker's failure without its traceback (``--debug`` shows it),
    an operating-system error as its file and reason (a full disk, a folder that vanished)."""
    if isinstance(error, CellError):
        return f"{error.summary()}; --debug shows the worker's traceback"
    if isinstance(error, OSError) and not isinstance(error, PositionError):
        return f"{error.filename}: {error.strerror}" if error.filename and error.strerror else str(error)
    return str(error)


if __name__ == "__main__":
    sys.exit(main())
