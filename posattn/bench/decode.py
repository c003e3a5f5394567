"""Speed of cached (incremental) decoding against recomputing the prefix for every new token.

    posattn bench-decode [-n 512 2048] [-m none rope alibi tisa cat] [--new 16] [--out DIR]

For each mechanism and context length n, a decoder (``--d-model``, ``--layers``, ``--heads``)
gets a random prompt of n − new tokens and then produces ``--new`` tokens greedily, twice:
``cached`` (:meth:`Decoder.decode` with a :class:`KVCache`: the prompt once, then one row per
token) and ``recompute`` (the whole prefix through ``model(ids)`` per token). Both produce the
same tokens (checked). It reports new tokens per second of each and their ratio; the prompt's
prefill is timed separately. Writes ``decode.json`` and ``decode.png`` to ``--out``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..attention.decode import KVCache
from ..models import Decoder, ModelConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy(model: Decoder, prompt: torch.Tensor, new: int, cached: bool) -> tuple[torch.Tensor, float, float]:
    """(tokens, prefill seconds, seconds for the ``new`` tokens)."""
    dev = prompt.device
    t0 = time.perf_counter()
    cache = KVCache()
    logits = model.decode(prompt, cache) if cached else model(prompt)
    ids = torch.cat([prompt, logits[:, -1:].argmax(-1)], 1)
    _sync(dev)
    t1 = time.perf_counter()
    for _ in range(new - 1):
        logits = model.decode(ids[:, -1:], cache) if cached else model(ids)
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
    _sync(dev)
    return ids, t1 - t0, time.perf_counter() - t1


def decode_speed(mechanisms: list[str], lengths: list[int], new: int = 16, d_model: int = 256,
                 n_layers: int = 4, n_heads: int = 4, device: str = "cpu") -> list[dict[str, Any]]:
    dev = torch.device(device)
    rows = []
    for name in tqdm(mechanisms, desc="mechanisms"):
        for n in lengths:
            torch.manual_seed(0)
            model = Decoder(ModelConfig(vocab_size=1000, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                                        max_len=max(lengths), mechanisms=[name])).to(dev).eval()
            prompt = torch.randint(0, 1000, (1, n - new), device=dev)
            greedy(model, prompt[:, :32], 2, True)  # warm-up
            greedy(model, prompt[:, :32], 2, False)
            ids_c, pre_c, gen_c = greedy(model, prompt, new, True)
            ids_r, pre_r, gen_r = greedy(model, prompt, new, False)
            rows.append({"mechanism": name, "n": n, "new_tokens": new, "same_tokens": bool(torch.equal(ids_c, ids_r)),
                         "cached_tokens_per_s": round((new - 1) / gen_c, 2),
                         "recompute_tokens_per_s": round((new - 1) / gen_r, 2),
                         "speedup": round(gen_r / gen_c, 2),
                         "prefill_s_cached": round(pre_c, 4), "prefill_s_recompute": round(pre_r, 4)})
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["mechanism"] for r in rows}, key=[r["mechanism"] for r in rows].index)
    lengths = sorted({r["n"] for r in rows})
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(names), 3.2))
    width = 0.8 / len(lengths)
    for k, n in enumerate(lengths):
        ys = [next(r["speedup"] for r in rows if r["mechanism"] == m and r["n"] == n) for m in names]
        ax.bar([i + k * width for i in range(len(names))], ys, width, label=f"n = {n}")
    ax.set_xticks([i + width * (len(lengths) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("cached / recompute tokens/s")
    ax.axhline(1, color="gray", lw=0.8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
