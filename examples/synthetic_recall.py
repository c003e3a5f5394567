"""Train a small decoder with ALiBi on multi-query associative recall (MQAR), then test it at twice
the length it was trained on.

The task comes from :mod:`posattn.synthetic` (the generators and training loop behind ``posattn
compare``): four key-value pairs, then queries whose answers are the values seen earlier. Accuracy
is measured over the answer positions only: chance is 0.06 (one of 16 values), 0.25 for a model that
only picks among the four values in its context. The sizes are those of ``posattn compare``'s
default sweep (Zoology's synthetic-task models: two attention layers, no MLP, GPT-2 initialisation;
length 32, vocabulary 32, learning rate 3e-3). The default run stops once validation accuracy
reaches 0.99 or after 1,000 steps. Measured on 2026-11-26 (2-core AMD EPYC VM, one torch thread, the
machine shared with other jobs): ALiBi ran all 1,000 steps in 39 s of training (63 s wall-clock in
all, 19 s of CPU time) and reached 0.986 accuracy at length 32 and 0.979 at length 64, climbing from
0.40 at step 100 to 0.94 at step 500; ``--mechanism rope`` reached 0.997 after 200 steps (6 s) and
0.986 at length 64.

    python examples/synthetic_recall.py
    python examples/synthetic_recall.py --tiny        # seconds: a smoke test
    python examples/synthetic_recall.py --mechanism rope
"""
from __future__ import annotations

import argparse

import torch

from posattn import Decoder, ModelConfig
from posattn.synthetic import TrainConfig, evaluate, generate, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mechanism", default="alibi", help="position mechanism (default alibi)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and a few steps (a smoke test)")
    args = parser.parse_args()

    vocab, length, pairs = 32, 32, 4
    steps, examples, width = (5, 64, 32) if args.tiny else (1000, 10_000, 64)
    data = generate("mqar", examples, length, vocab, seed=0, split="train", num_kv_pairs=pairs)
    valid = generate("mqar", 256, length, vocab, seed=0, split="valid", num_kv_pairs=pairs)
    longer = generate("mqar", 256, 2 * length, vocab, seed=0, split="test", num_kv_pairs=pairs)

    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=vocab, d_model=width, n_layers=2, n_heads=2, d_ff=0, init_std=0.02,
                                max_len=2 * length, mechanisms=[args.mechanism]))
    cfg = TrainConfig(steps=steps, batch_size=64, lr=3e-3, warmup=0.05, eval_every=max(steps // 10, 1),
                      target_accuracy=0.99)
    result = train(model, data, cfg, valid=valid, device="cpu", progress=not args.tiny)

    climb = ", ".join(f"{h['step']:.0f}: {h['valid_accuracy']:.2f}" for h in result.history)
    print(f"{args.mechanism}: {result.steps} steps in {result.seconds:.0f} s, loss {result.loss:.3f}")
    print(f"validation accuracy by step: {climb}")
    print(f"accuracy at length {length} (trained): {evaluate(model, valid):.3f}")
    print(f"accuracy at length {2 * length} (longer): {evaluate(model, longer):.3f}")


if __name__ == "__main__":
    main()
