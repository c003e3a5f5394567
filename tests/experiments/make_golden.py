"""The golden values of ``test_pinned.py``: what a tiny compare sweep, a tiny pretraining run and a
tiny fine-tuning suite produce, exactly, on the code they were generated with.

The refactor of the experiment layer must not change a single bit of these results, so they
were generated once from the code before it and are compared for exact equality (threads fixed
to 1 on a CPU). Regenerate only on purpose, when a change is meant to alter results::

    OMP_NUM_THREADS=1 python tests/experiments/make_golden.py   # writes tests/experiments/golden.json

Losses and accuracies are compared as floats (JSON keeps every bit of a float); weights as a
SHA-256 digest of every tensor (name, dtype, shape and bytes). Times and speeds are left out.
``machine`` names the kind of CPU they were made on (:func:`machine`): bits hold on that kind
only, since PyTorch's CPU kernels take other instruction paths on another and round differently.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

TESTS = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).with_name("golden.json")

COMPARE = {
    "name": "pinned", "task": "mqar", "task_params": {"num_kv_pairs": 2}, "vocab_size": 16, "train_length": 16,
    "test_lengths": [16, 32], "max_len": 32, "examples": {"train": 200, "valid": 40, "test": 40}, "d_model": 16,
    "models": [{"mechanisms": ["cat"], "layers": 1}, {"mechanisms": ["rope"], "layers": 2, "dropout": 0.1}],
    "training": {"steps": 24, "batch_size": 16, "lr": 3e-3, "eval_every": 8},
}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def folder_digest(model_dir: Path) -> str:
    return digest(load_file(str(model_dir / "model.safetensors")))


def compare_values(root: Path) -> dict[str, Any]:
    """Two models (1-layer cat; 2-layer rope with dropout) on MQAR, 24 steps each."""
    from posattn.synthetic.compare import run_sweep, validate_config

    out = root / "compare"
    results = run_sweep(validate_config(dict(COMPARE)), out, progress=False)
    keep = ("label", "steps", "stopped_early", "valid_accuracy", "history", "accuracy", "not_applicable", "selected")
    return {r["label"]: {**{k: r.get(k) for k in keep}, "weights": folder_digest(out / "cells" / r["id"] / "model")}
            for r in results}


def pretrain_values(root: Path) -> dict[str, Any]:
    """Masked LM, 6 steps with dropout and checkpoints every 2 steps, on a corpus of generated text
    tokenised with a fixed vocabulary (a trained tokenizer may break ties differently between runs)."""
    from finetune.helpers import tokenizer
    from pretrain.conftest import make_documents, tiny

    from posattn.pretrain.config import parse
    from posattn.pretrain.run import pretrain
    from posattn.text.corpus import build_corpus

    tokenizer().save(str(root / "tokenizer.json"))
    corpus = build_corpus(make_documents(), root / "corpus", tokenizer=root / "tokenizer.json")
    out = root / "pretrain"
    result = pretrain(parse(tiny(corpus, dropout=0.1)), out, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    skip = ("tokens_per_s", "elapsed_s")
    return {"result": {k: result[k] for k in ("steps", "tokens", "valid_loss", "valid_accuracy")},
            "metrics": [{k: v for k, v in r.items() if k not in skip} for r in rows],
            "weights": folder_digest(out / "model")}


def finetune_values(root: Path) -> dict[str, Any]:
    """MNLI then RTE initialised from the MNLI model (whose weights are kept), one seed, dropout 0.1."""
    from finetune.glue_files import write_glue
    from finetune.helpers import make_checkpoint

    from posattn.finetune.suite import run_suite, validate_config

    write_glue(root / "glue", n=24)
    checkpoint = make_checkpoint(root / "checkpoint", ["absolute"])
    suite = validate_config({"name": "pinned", "checkpoints": [str(checkpoint)], "tasks": ["mnli", "rte"], "seeds": 1,
                             "glue_dir": str(root / "glue"), "training": {"batch_size": 8, "epochs": 2,
                                                                          "evals_per_epoch": 2}})
    out = root / "finetune"
    results = run_suite(suite, out, progress=False)
    keep = ("steps", "total_steps", "stopped_early", "best_step", "valid_score", "history", "scores", "baseline")
    values = {r["task"]: {k: r.get(k) for k in keep} for r in results}
    mnli = next(r for r in results if r["task"] == "mnli")
    values["mnli"]["weights"] = folder_digest(out / "cells" / mnli["id"] / "model")
    return values


def machine() -> str:
    """The kind of CPU and the instruction set PyTorch's CPU kernels dispatch to (``AMD EPYC, AVX512``):
    the results store's name for the hardware but for the core count, plus
    ``torch.backends.cpu.get_cpu_capability()``, since one name covers CPU generations whose kernels
    round differently (an AVX2-only EPYC's fine-tuning losses differ from an AVX-512 EPYC's in the
    last bit)."""
    from posattn.experiments.store import hardware

    return f"{hardware('cpu').rsplit(',', 1)[0]}, {torch.backends.cpu.get_cpu_capability()}"


def pinned_values(root: Path) -> dict[str, Any]:
    """Every pinned value, computed in ``root`` (an empty scratch folder)."""
    return {"compare": compare_values(root), "pretrain": pretrain_values(root), "finetune": finetune_values(root)}


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        values = {**pinned_values(Path(tmp)), "machine": machine()}
    GOLDEN.write_text(json.dumps(values, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))   # the test helpers (finetune.helpers, train.conftest), as pytest imports them
    main()
