"""Zero-shot order probe: does a pretrained masked-LM encoder prefer the true order, before fine-tuning?

The position tasks of ``posattn finetune`` pair two inputs that hold the same words: a held-out
sentence and the same sentence with a window of words permuted (``word_order``); two adjacent
sentences in their order and swapped (``sentence_order``); a sentence with itself and with its
permutation (``same_order``). Fine-tuning may fail to extract order from an encoder that has it;
this probe asks the pretrained MLM head directly. For each input W it computes the
pseudo-log-likelihood (Salazar et al. 2020, "Masked Language Model Scoring", Eq 2)

    PLL(W) = Σ_t log P_MLM(w_t | W with w_t replaced by [MASK]),

masking one token at a time (every token but [CLS] and [SEP]). Pairs longer than the model's
``max_len`` are left out: truncation would cut different words from the two inputs. The probe's accuracy is the share
of pairs whose true input (original, in order, copied) has the higher PLL; ties count one half.
A model without positions (``none``; segment ids reach a model only through the ``segment``
mechanism) is permutation-equivariant, and both inputs of a pair hold the same tokens, so their
PLLs agree up to float rounding: differences below :data:`TIE` nats are ties, and ``none`` scores
exactly 0.5.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from ..errors import PositionError
from ..finetune.batches import Encoded, encode_examples
from ..finetune.offline import load_offline
from ..finetune.run import MODEL_DIR, check_encoder, find_checkpoint, tokenizer_path
from ..finetune.tasks import POSITION, Example, Task, cap
from ..models import Encoder
from ..models.io import load
from ..text.tokenizer import load_tokenizer, special_ids
from . import plots

TIE = 1e-3
TRUE_LABEL = {"word_order": "original", "sentence_order": "after", "same_order": "same"}


@torch.no_grad()
def pseudo_log_likelihoods(model: Encoder, data: Encoded, mask_id: int, skip: set[int],
                           batch_tokens: int = 16384, progress: bool = False) -> np.ndarray:
    """PLL of every input of ``data`` (float64 sums of float32 log-probabilities): one masked copy per
    scored token, batched by length, the MLM head applied at the masked row only."""
    rows = sorted(((i, t) for i, ids in enumerate(data.ids) for t, tok in enumerate(ids) if tok not in skip),
                  key=lambda r: len(data.ids[r[0]]))
    out = np.zeros(len(data), dtype=np.float64)
    model.eval()
    with tqdm(total=len(rows), desc="masked copies", unit="row", disable=not progress, leave=False) as bar:
        start = 0
        while start < len(rows):
            stop = start + max(1, batch_tokens // len(data.ids[rows[start][0]]))
            chunk = rows[start:stop]
            ids, seg, mask, _ = data.batch([i for i, _ in chunk])
            at = torch.arange(len(chunk)), torch.tensor([t for _, t in chunk])
            target = ids[at].clone()
            ids[at] = mask_id
            scored = torch.zeros_like(mask)
            scored[at] = True
            logp = torch.log_softmax(model.mlm_logits(model(ids, seg, mask, scored=scored)).float(), -1)
            np.add.at(out, np.array([i for i, _ in chunk]), logp.gather(-1, target[:, None])[:, 0].double().numpy())
            bar.update(len(chunk))
            start = stop
    return out


def probe(model: Encoder, tok: Tokenizer, task: Task, examples: list[Example], max_len: int,
          batch_tokens: int = 16384, progress: bool = False) -> dict[str, Any]:
    """Accuracy of PLL(true) > PLL(other) over the pairs (examples 2k, 2k+1) of a position task."""
    if task.name not in TRUE_LABEL:
        raise PositionError(f"order probe: {task.name!r} is not a position task ({', '.join(TRUE_LABEL)})")
    pairs = list(zip(examples[::2], examples[1::2]))
    if not pairs or len(examples) % 2 or any(x.group != y.group or x.label == y.label for x, y in pairs):
        raise PositionError(f"order probe: {task.name} examples must come in pairs of one source, both labels")
    sp = special_ids(tok)
    lengths = encode_examples(tok, task, examples, 1 << 30, sp).lengths()
    fits = [x for k, pair in enumerate(pairs) if max(lengths[2 * k], lengths[2 * k + 1]) <= max_len for x in pair]
    if not fits:
        raise PositionError(f"order probe: no {task.name} pair fits in {max_len} tokens")
    data = encode_examples(tok, task, fits, max_len, sp)
    pll = pseudo_log_likelihoods(model, data, sp.mask, {sp.cls, sp.sep}, batch_tokens, progress)
    true = task.labels.index(TRUE_LABEL[task.name])
    first_true = np.array([x.label == true for x in fits[0::2]])
    delta = np.where(first_true, pll[0::2] - pll[1::2], pll[1::2] - pll[0::2])   # PLL(true) − PLL(other)
    wins = np.where(np.abs(delta) <= TIE, 0.5, (delta > 0).astype(float))
    tokens = np.array([len(ids) - (3 if task.pair else 2) for ids in data.ids[0::2]])
    n = len(wins)
    return {"task": task.name, "pairs": n, "accuracy": float(wins.mean()),
            "stderr": float(wins.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
            "ties": int((np.abs(delta) <= TIE).sum()), "mean_delta_per_token": float((delta / tokens).mean()),
            "dropped_too_long": len(pairs) - n}


def default_label(checkpoint: str | Path) -> str:
    """A checkpoint's name: its run folder's (``runs/pretrain-x/composite/model`` -> ``composite``)."""
    folder = Path(checkpoint)
    return folder.parent.name if folder.name == MODEL_DIR else folder.name


def order_probe(checkpoints: list[str | Path], out: Path, tasks: list[str] | None = None, max_pairs: int = 500,
                labels: list[str] | None = None, progress: bool = True) -> dict[str, Any]:
    """Probe each checkpoint on the test split of each position task, capped to ``max_pairs`` pairs as
    fine-tuning caps it (500 pairs: the test sets of the paper recipes); write ``order_probe.json`` and
    ``order_probe.png`` to ``out``. ``labels``: one per checkpoint (default: the run folder's name)."""
    tasks = list(tasks or TRUE_LABEL)
    unknown = [t for t in tasks if t not in POSITION]
    if unknown:
        raise PositionError(f"order probe: unknown task(s) {', '.join(unknown)}; position tasks: {', '.join(POSITION)}")
    if max_pairs < 1:
        raise PositionError(f"order probe: --max-pairs must be >= 1, got {max_pairs}")
    folders = [find_checkpoint(c) for c in checkpoints]
    for folder in folders:
        check_encoder(folder)
    labels = labels or [default_label(f) for f in folders]
    if len(set(labels)) != len(labels):
        raise PositionError(f"order probe: two checkpoints share a label ({', '.join(labels)}); give one folder each")
    splits = {t: cap(t, load_offline(t).test["test"], 2 * max_pairs) for t in tasks}
    empty = [t for t, examples in splits.items() if not examples]
    if empty:
        raise PositionError(f"order probe: --max-pairs {max_pairs} keeps no whole document of {', '.join(empty)} "
                            f"(pairs of one document are kept together); raise it")
    results: dict[str, Any] = {}
    for label, folder in zip(labels, folders):
        model, tok = load(folder), load_tokenizer(tokenizer_path(folder))
        results[label] = {"checkpoint": str(folder), "mechanisms": model.cfg.mechanisms, "tasks": {}}
        for t in tqdm(tasks, desc=f"probe {label}", disable=not progress):
            results[label]["tasks"][t] = probe(model, tok, POSITION[t], splits[t], model.cfg.max_len,
                                               progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    report = {"method": "pseudo-log-likelihood, one masked token at a time (Salazar et al. 2020)",
              "tie_nats": TIE, "models": results,
              "figures": [plots.order_probe_figure(results, tasks, out / "order_probe.png").name]}
    (out / "order_probe.json").write_text(json.dumps(report, indent=1))
    return report
