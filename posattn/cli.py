"""``posattn`` command line. Each area adds its sub-commands through ``register(subparsers)``."""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from .errors import PositionError
from .heap import keep_freed_memory

AREAS = ["posattn.synthetic.cli", "posattn.pretrain.cli", "posattn.bench.cli", "posattn.analysis.cli",
         "posattn.finetune.cli", "posattn.experiments.cli", "posattn.studies"]


def mechanisms_command(args: argparse.Namespace) -> None:
    """Print every mechanism's properties, computed from its code (TISA Tables 1-2)."""
    from .mechanisms import Dims, names, properties

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
    p = argparse.ArgumentParser(prog="posattn", description="Positional information inside attention: "
                                "list mechanisms, compare them, benchmark them, look inside models.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mechanisms", help="list every mechanism with its properties")
    m.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    m.add_argument("--d-model", type=int, default=768)
    m.add_argument("--heads", type=int, default=12)
    m.add_argument("--layers", type=int, default=12)
    m.add_argument("--max-len", type=int, default=512)
    m.add_argument("--decoder", action="store_true", help="count for a causal decoder")
    m.set_defaults(func=mechanisms_command)
    for area in AREAS:
        importlib.import_module(area).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    keep_freed_memory()  # large CPU tensors reuse freed memory instead of page-faulting (posattn.heap)
    try:
        args.func(args)
    except PositionError as e:
        print(f"posattn: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
