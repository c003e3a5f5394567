"""The positional score profile F̂_P of a posattn model: what position alone contributes to each
head's attention scores (TISA §3.2), and how Toeplitz it is (R² = 1: it depends on j − i only).

:func:`posattn.analysis.native.posattn_profiles` feeds a sequence whose every token is the mean word
embedding through the model and reads each layer's pre-softmax scores. An encoder with learned
absolute positions gives a profile that depends on i and j separately; adding a relative bias
(here T5's) gives one that depends on the offset. With ``--out`` the figures of ``posattn analyze
profiles`` are written too.

    python examples/positional_profile.py
    python examples/positional_profile.py --tiny
    python examples/positional_profile.py --out /tmp/profile      # also PNG figures and JSON
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from posattn import Encoder, ModelConfig
from posattn.analysis.native import posattn_profiles
from posattn.analysis.reports import profiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--out", type=Path, help="also write posattn analyze profiles' figures and JSON here")
    args = parser.parse_args()

    width, layers, n = (16, 1, 8) if args.tiny else (64, 2, 32)
    for mechanisms in (["absolute"], ["absolute", "t5"], ["t5"]):
        torch.manual_seed(0)
        model = Encoder(ModelConfig(vocab_size=100, d_model=width, n_layers=layers, n_heads=2, max_len=64,
                                    mechanisms=mechanisms)).eval()
        prof = posattn_profiles(model, n)            # F̂_P [layers, heads, n, n]
        r2 = prof.r2()                                # Toeplitz R² [layers, heads]
        offsets = prof.offset_profiles()[0, 0]        # layer 0, head 0: mean score at each offset j − i
        near = offsets[n - 1 - 3: n + 3]
        print(f"{' + '.join(mechanisms):14s} Toeplitz R² per head (layer 0): "
              f"{np.array2string(r2[0], precision=3)}; layer 0 head 0 at offsets −3..3: "
              f"{np.array2string(near, precision=3, suppress_small=True)}")
        if args.out is not None:
            profiles(model, args.out / "-".join(mechanisms), positions=n)
    if args.out is not None:
        print(f"figures and profiles.json in {args.out}/")


if __name__ == "__main__":
    main()
