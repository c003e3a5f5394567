"""``posattn study``: the Hugging Face studies of :mod:`posattn.hf` as sub-commands.

- ``posattn study table3``: TISA Table 3 on a pretrained encoder (:mod:`posattn.hf.table3`);
- ``posattn study closeness``: how close a retrofitted encoder starts (:mod:`posattn.hf.closeness`).

This module sits outside :mod:`posattn.hf` and imports it only when a study runs: ``posattn.hf``
needs the optional ``transformers``, and every other command must start without it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .experiments.executors import add_executor_options, executor_from
from .finetune.tasks import OFFLINE_SUITE, TASKS
from .options import positive_float, positive_int
from .runtime.files import write_json_atomic

TABLE3 = "TISA Table 3 on a pretrained transformers encoder, with posattn finetune's tasks and training loop."
CLOSENESS = "How close a retrofitted encoder starts to the pretrained one (TISA App. C's question)."


def table3_command(args: argparse.Namespace) -> None:
    from .hf.table3 import run

    run(args.model, args.tasks, args.seeds, args.max_train, args.max_eval, args.lr, args.epochs, args.out,
        executor=executor_from(args, out=args.out))
    print((args.out / "report.md").read_text())


def closeness_command(args: argparse.Namespace) -> None:
    from .hf.closeness import closeness

    report = closeness(args.model, args.kernels, args.positions, args.max_tokens, args.texts)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / "closeness.json", report, indent=2)
    print(json.dumps(report, indent=2))


def register(sub: argparse._SubParsersAction) -> None:
    study = sub.add_parser("study", help="the Hugging Face studies (TISA Table 3, retrofit closeness)",
                           description="Studies of pretrained transformers encoders (they need transformers): "
                                       "table3 is TISA Table 3, closeness how close a retrofitted encoder "
                                       "starts to the pretrained one.")
    studies = study.add_subparsers(dest="study", required=True)

    p = studies.add_parser("table3", help="TISA Table 3 on a pretrained encoder", description=TABLE3,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm", help="a BERT-family folder, or minilm / mpnet (default minilm)")
    p.add_argument("--tasks", nargs="+", default=list(OFFLINE_SUITE), choices=list(TASKS), metavar="TASK",
                   help=f"tasks to fine-tune on (default the offline suite: {' '.join(OFFLINE_SUITE)})")
    p.add_argument("--seeds", type=positive_int, default=5, help="seeds per task and model (default 5)")
    p.add_argument("--max-train", type=positive_int, default=800,
                   help="cap on training examples per task (default 800)")
    p.add_argument("--max-eval", type=positive_int, default=500,
                   help="cap on validation and test examples per task (default 500)")
    p.add_argument("--lr", type=positive_float, default=1e-4, help="learning rate (default 1e-4)")
    p.add_argument("--epochs", type=positive_float, default=2, help="training epochs (default 2)")
    p.add_argument("--out", type=Path, default=Path("runs/hf/table3"),
                   help="output folder (default runs/hf/table3)")
    add_executor_options(p, block=False)
    p.set_defaults(func=table3_command, writes={
        "OUT/cells/<variant>-<task>-<seed>.json": "one fine-tuning cell's scores",
        "OUT/fit-S<kernels>.npz": "the TISA fit a variant starts from (reused)",
        "OUT/study.json": "the model and settings of the folder's study (another is refused there)",
        "OUT/results.json, OUT/report.md": "Table 3: median (mean ± s.e.) per variant and task, TISA's claims"})

    p = studies.add_parser("closeness", help="how close a retrofitted encoder starts to the pretrained one",
                           description=CLOSENESS)
    p.add_argument("--model", default="minilm", help="a BERT-family folder, or minilm / mpnet")
    p.add_argument("--kernels", type=positive_int, default=5, help="TISA kernels per head of the fit (default 5)")
    p.add_argument("--positions", type=positive_int, default=128, metavar="N",
                   help="positions 0..N-1 of the F̂_P fit (default 128)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per text compared (default 128)")
    p.add_argument("--texts", type=positive_int, default=96, help="texts compared (default 96)")
    p.add_argument("--out", type=Path, default=Path("runs/hf/closeness"),
                   help="output folder for closeness.json (default runs/hf/closeness)")
    p.set_defaults(func=closeness_command, writes={
        "OUT/closeness.json": "cosine of each retrofitted start to the pretrained model"})
