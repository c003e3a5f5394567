"""``posattn bench``: speed and memory of every mechanism against plain SDPA, in one process.

Training step (forward + backward) and inference time of each mechanism in a one-block model
and in the bare attention op, as ratios to plain ``scaled_dot_product_attention`` without
position measured in the same process (interleaved rounds, medians), and the peak extra
memory of a step (:mod:`.measure`). Optional peers: Hugging Face BERT relative_key_query and
x-transformers T5 bias / ALiBi (:mod:`.peers`).
"""
from .cases import CaseSpec, Sizes
from .run import BenchOptions, run

__all__ = ["BenchOptions", "CaseSpec", "Sizes", "run"]
