"""``posattn bench``, ``posattn bench-decode``, ``posattn bench-throughput`` and ``posattn gpu-check``: the
command line of :mod:`posattn.bench`."""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from ..attention.fast import Policy
from ..errors import PositionError, RunError
from ..mechanisms import get
from ..mechanisms.conv import METHODS, SHIFT_MAX
from ..options import add_device_option, add_json_option, natural_int, positive_int, sequence_length
from ..runtime.compile import COMPILE_MODES
from ..runtime.device import resolve_device
from ..runtime.files import write_json_atomic, write_text_atomic
from . import decode, gpu_check, throughput
from .cases import Sizes, parse_mechanisms
from .models import DEFAULT_MECHANISMS, HF_MODELS, MODEL_LENGTHS, MODEL_SIZES, model_name, model_rows
from .peers import skipped as skipped_peers
from .profile import profiles_text
from .report import grid_markdown, model_table, ordered, plot, save_json, table, targets
from .run import COMPILED_CONV_UP_TO, KINDS, BenchOptions, conv_rows, peer_matches, run
from .spec import BASELINE, fields_text

QUICK = dict(lengths=[64, 128], heads=2, head_dim=16, repeats=2, warmup=1)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="time and memory of every mechanism against plain SDPA",
        description="Training-step and inference time and peak memory of each mechanism in a one-block "
                    "model (layer) and in the bare attention op, as ratios to plain SDPA measured in "
                    "the same process (interleaved rounds, medians). On a shared machine set "
                    "OMP_WAIT_POLICY=PASSIVE: spinning OpenMP threads otherwise turn every small "
                    "parallel op into a scheduling stall.")
    p.add_argument("-m", "--mechanisms", nargs="+", metavar="SPEC", type=mechanism_spec,
                   help="mechanisms to measure (default: every registered one, alone): a name, "
                        "names joined by '+', or JSON such as '[{\"name\": \"tisa\", \"n_kernels\": 3}]'")
    p.add_argument("-n", "--lengths", nargs="+", type=sequence_length, help="sequence lengths (default 256 1024 4096)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                   help="a one-block model (layer) and/or the bare attention op")
    p.add_argument("--batch", nargs="+", type=positive_int,
                   help="batch sizes: every length × batch is measured (default 1; --models: 32)")
    p.add_argument("--dropout", type=dropout,
                   help="dropout of every case's model in training steps (default 0; --models: 0.1)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads of every case (default 4)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="width of each head (default 64)")
    p.add_argument("--causal", action="store_true", help="decoder (causal) instead of encoder")
    p.add_argument("--threads", type=positive_int, default=2,
                   help="torch CPU threads of the measuring process (default 2, a 2-core laptop)")
    add_device_option(p)   # CUDA: the FlexAttention path, memory measured in-process
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="precision of models and inputs")
    p.add_argument("--repeats", type=positive_int, help="interleaved rounds, medians reported (default 5)")
    p.add_argument("--warmup", type=natural_int, help="untimed rounds first (default 1)")
    p.add_argument("--policy", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="override fast-path Policy fields, e.g. dense_max_n=256 grad_chunk=64 force=flash_bias, "
                        "or sdpa_backend=flash (every SDPA call, the baseline's too, on FlashAttention alone)")
    p.add_argument("--ab", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="time every mechanism (with --models: every posattn model) a second time under these "
                        "Policy overrides, in the same interleaved rounds (an A/B on a noisy machine), "
                        "e.g. --ab native=False")
    p.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, metavar="MODE",
                   help="compile every case's training step and inference pass with torch.compile (MODE: "
                        f"{', '.join(COMPILE_MODES)}; default 'default'; 'reduce-overhead' adds CUDA graphs, "
                        "'dynamo' only traces); ratios are then to the compiled plain-SDPA model, and peak "
                        "memory is not measured")
    p.add_argument("--profile", nargs="?", const=8, type=positive_int, metavar="K",
                   help="after timing, run each case's training step once under torch.profiler and add its K "
                        "(default 8) most expensive operators by self time (and on CUDA its kernels) to the row "
                        "and to bench.txt: where the time of a slow case goes")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    p.add_argument("--no-time", action="store_true", help="only peak memory (e.g. for n = 16384)")
    p.add_argument("--peers", action="store_true",
                   help="add HF BERT relative_key_query and x-transformers T5/ALiBi when installed")
    p.add_argument("--quick", action="store_true", help="tiny sizes and 2 rounds (a smoke test)")
    p.add_argument("--models", action="store_true",
                   help="instead: whole-model pretraining steps (12 layers, hidden 256, 4 heads, FFN 1024, "
                        "AdamW) of a posattn Encoder (absolute; -m adds more) against Hugging Face "
                        "BertForMaskedLM, and a Decoder (rope) against GPT-NeoX and Llama; tokens/s and "
                        "peak memory (default n 128, batch 32)")
    p.add_argument("--conv", action="store_true",
                   help="instead: time each depthwise-convolution algorithm (shift-add, Conv1d, FFT, the C++ "
                        f"kernel, compiled shift-add up to {COMPILED_CONV_UP_TO} taps) by kernel length")
    p.add_argument("--out", type=Path, default=Path("runs/bench"),
                   help="folder for the table, plot and rows (bench.txt, bench.png, bench.json; default runs/bench)")
    add_json_option(p)
    p.set_defaults(func=bench_command, writes={
        "OUT/bench.json": "one row per measured case (rewritten as cases finish)",
        "OUT/bench.txt": "the table and the targets' checks",
        "OUT/bench.md": "the layer rows as the documentation's Markdown grids (median per-round ratios)",
        "OUT/bench.png": "time and memory ratios against plain attention",
        "OUT/conv.json": "--conv: the convolution timings"})

    p = sub.add_parser("bench-decode", help="cached (incremental) decoding against recomputing the prefix",
                       description=decode.__doc__.split("\n\n")[0])
    p.add_argument("-n", type=sequence_length, nargs="+", default=[512, 2048],
                   help="context lengths (default 512 2048)")
    p.add_argument("-m", nargs="+", default=["none", "rope", "alibi", "t5", "tisa", "cat"],
                   help="mechanisms (default none rope alibi t5 tisa cat)")
    p.add_argument("--new", type=positive_int, default=16, help="new tokens per measurement (default 16)")
    p.add_argument("--d-model", type=positive_int, default=256, help="model width (default 256)")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers (default 4)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    add_device_option(p)
    p.add_argument("--out", type=Path, default=Path("runs/bench-decode"),
                   help="folder for decode.json and decode.png (default runs/bench-decode)")
    p.set_defaults(func=decode_command, writes={
        "OUT/decode.json": "cached and recomputed decoding times per mechanism and length",
        "OUT/decode.png": "the same as a plot"})

    gpu_check.register(sub)
    throughput.register(sub)


def mechanism_spec(text: str) -> list[Any]:
    """One ``-m`` SPEC (argparse type): a name, names joined by '+', or a JSON list of names and
    ``{"name": ..., option: value}`` objects; a malformed one is refused while parsing."""
    try:
        specs = parse_mechanisms(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({e.msg} at character {e.pos})") from None
    bad = [s for s in specs if not isinstance(s, str) and not (isinstance(s, dict) and isinstance(s.get("name"), str))]
    if bad or not specs:
        raise argparse.ArgumentTypeError(f"{text!r}: each mechanism must be a name or an object with a \"name\", "
                                         f"got {json.dumps(bad[0]) if bad else 'nothing'}")
    return specs


def dropout(text: str) -> float:
    """A dropout probability in [0, 1) (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1), got {text!r}")
    return value


def _first(*values: int | None) -> int:
    return next(v for v in values if v is not None)


def options(args: argparse.Namespace) -> BenchOptions:
    quick = QUICK if args.quick else {}
    mechs = args.mechanisms
    for specs in mechs or []:
        for s in specs:
            get(s if isinstance(s, str) else s["name"])
    args.device = str(resolve_device(args.device))   # auto: what it picked, the name the rows record
    if args.models:
        return _model_options(args, quick, mechs)
    lengths = args.lengths or quick.get("lengths") or [256, 1024, 4096]
    sizes = Sizes(heads=quick.get("heads", args.heads), head_dim=quick.get("head_dim", args.head_dim),
                  causal=args.causal, max_len=max(lengths), dropout=args.dropout or 0.0,
                  device=args.device, dtype=args.dtype)
    opts = BenchOptions(lengths=lengths, kinds=tuple(args.kinds), sizes=sizes, threads=args.threads,
                        batches=args.batch or [1],
                        repeats=_first(args.repeats, quick.get("repeats"), 5),
                        warmup=_first(args.warmup, quick.get("warmup"), 1),
                        timing=not args.no_time, memory=not args.no_memory, peers=args.peers,
                        compile=args.compile, policy=policy_overrides(args.policy),
                        ab=policy_overrides(args.ab, "--ab"), profile=args.profile or 0)
    if mechs is not None:
        opts.mechanisms = mechs
    return opts


def policy_overrides(items: list[str], option: str = "--policy") -> dict[str, Any]:
    """``["dense_max_n=256", "force=banded"]`` -> Policy fields (every bad item in one error): an
    unknown field, or a value of another type than the field's (``force`` takes a path's name)."""
    fields = typing.get_type_hints(Policy)
    out: dict[str, Any] = {}
    bad = []
    for item in items:
        key, _, raw = item.partition("=")
        if key not in fields or not raw:
            bad.append(item)
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word: force=banded
        if not _fits(value, fields[key]):
            bad.append(f"{item} (expects {_type_name(fields[key])})")
        out[key] = value
    if bad:
        raise PositionError(f"bench {option}: bad item(s) {', '.join(bad)}; use FIELD=VALUE with FIELD one "
                            f"of {', '.join(fields)}")
    return out


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotated type ``hint`` (int, float, bool, a Literal, unions of them)."""
    if typing.get_origin(hint) is typing.Literal:
        return value in typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) and (hint is bool or not isinstance(value, bool))


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " or ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    return "None" if hint is type(None) else hint.__name__


def _model_options(args: argparse.Namespace, quick: dict, mechs: list | None) -> BenchOptions:
    """--models: the posattn encoder and decoder (default mechanisms, plus any -m) and the HF models."""
    names = [model_name(kind) for kind in DEFAULT_MECHANISMS]
    for m in mechs or []:
        names += [model_name(kind, m) for kind in DEFAULT_MECHANISMS if model_name(kind, m) not in names]
    available = list(HF_MODELS) if importlib.util.find_spec("transformers") is not None else []
    sizes = MODEL_SIZES
    if args.quick:
        sizes = Sizes(heads=2, head_dim=16, vocab=512, layers=2, d_ff=64, dropout=MODEL_SIZES.dropout)
    sizes = Sizes(**{**sizes.__dict__, "dropout": sizes.dropout if args.dropout is None else args.dropout,
                     "device": args.device, "dtype": args.dtype})
    return BenchOptions(lengths=args.lengths or quick.get("lengths", MODEL_LENGTHS), kinds=("model",),
                        sizes=sizes, threads=args.threads, batches=args.batch or [MODEL_SIZES.batch],
                        models=names + available, repeats=_first(args.repeats, quick.get("repeats"), 5),
                        warmup=_first(args.warmup, quick.get("warmup"), 1),
                        timing=not args.no_time, memory=not args.no_memory, compile=args.compile,
                        profile=args.profile or 0, policy=policy_overrides(args.policy),
                        ab=policy_overrides(args.ab, "--ab"))


def setup_line(opts: BenchOptions) -> str:
    """What every ratio of the run depends on beyond its rows: device, precision, threads, eager
    or compiled, and the fast-path Policy fields the run (and an A/B arm) was under."""
    line = (f"posattn bench: {opts.sizes.device}, {opts.sizes.dtype}, {opts.threads} thread(s), "
            f"{f'compile {opts.compile}' if opts.compile else 'eager'}")
    if opts.policy:
        line += f"; fast path under {fields_text(opts.policy)}"
    if opts.ab:
        line += f"; B arm under {fields_text(opts.ab)}"
    return line


def bench_command(args: argparse.Namespace) -> None:
    opts = None if args.conv else options(args)   # every bad option refused before anything is written
    args.out.mkdir(parents=True, exist_ok=True)
    if opts is None:
        rows = conv_rows([1, 2, 3, 4, 5, 9, 17, 33, 65, 129, 257], 512 if args.quick else 4096,
                         16 if args.quick else 256, 2, args.threads, _first(args.repeats, 2 if args.quick else 5),
                         compiled_up_to=SHIFT_MAX + 1 if args.quick else COMPILED_CONV_UP_TO)
        print(f"depthwise conv, training step ms (n={512 if args.quick else 4096}; -: not timed)")
        for r in rows:
            times = "  ".join(f"{m} {r[m + '_ms']:8.2f}" if m + "_ms" in r else f"{m} {'-':>8}" for m in METHODS)
            print(f"k={r['kernel']:4d}  {times}  -> chosen: {r['chosen']}")
        save_json(rows, args.out / "conv.json")
        if args.json:
            print(json.dumps(rows, indent=1))
        return
    if args.peers:
        for peer, why in skipped_peers().items():
            print(f"peer {peer}: {why}", file=sys.stderr if args.json else sys.stdout)
    rows = ordered(run(opts, partial=lambda rows: save_json(ordered(rows), args.out / "bench.json")))
    if args.models:
        rows = model_rows(rows)
    text = setup_line(opts) + "\n\n" + (model_table(rows) if args.models else table(rows))
    checks = targets(rows, peer_matches())
    where = profiles_text(rows)
    write_text_atomic(args.out / "bench.txt", text + ("\n\n" + "\n".join(checks) if checks else "")
                      + ("\n\n" + where if where else "") + "\n")
    save_json(rows, args.out / "bench.json")
    grids = grid_markdown(rows)
    if grids:
        write_text_atomic(args.out / "bench.md", grids)
    if any(r.get("train_ratio") is not None or r.get("peak_mem_mb") is not None for r in rows):
        plot(rows, args.out / "bench.png")
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(text)
        if checks:
            print("\ntargets:")
            print("\n".join("  " + c for c in checks))
        if where:
            print("\n" + where)
        print(f"\nwrote {args.out / 'bench.txt'}, {args.out / 'bench.json'}, {args.out / 'bench.png'}")
    for r in rows:
        if "error" in r:
            print(f"  {r['mechanism']} ({r['kind']}, n={r['n']}): {r['error']}",
                  file=sys.stderr if args.json else sys.stdout)
    cases = [r for r in rows if r["mechanism"] != BASELINE]
    if cases and all("error" in r for r in cases):
        raise RunError(f"bench: every case failed ({len(cases)}); the first: {cases[0]['mechanism']} "
                       f"({cases[0]['kind']}, n={cases[0]['n']}): {cases[0]['error']}")


def decode_command(args: argparse.Namespace) -> None:
    """``posattn bench-decode``: :func:`posattn.bench.decode.decode_speed`, its JSON, plot and table."""
    for name in args.m:
        get(name)
    args.device = str(resolve_device(args.device))
    if args.new < 2 or min(args.n) <= args.new:
        raise PositionError(f"bench-decode: need --new >= 2 and every length -n above it, got --new {args.new} "
                            f"and -n {' '.join(map(str, args.n))}")
    rows = decode.decode_speed(args.m, args.n, args.new, args.d_model, args.layers, args.heads, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": args.device, "d_model": args.d_model, "layers": args.layers, "heads": args.heads,
              "rows": rows}
    write_json_atomic(args.out / "decode.json", report, indent=2)
    decode.plot(rows, args.out / "decode.png")
    for r in rows:
        print(f"{r['mechanism']:10s} n={r['n']:5d}  cached {r['cached_tokens_per_s']:8.1f} tok/s  "
              f"recompute {r['recompute_tokens_per_s']:8.1f} tok/s  x{r['speedup']:.1f}  same={r['same_tokens']}")
