"""Test configuration for the whole suite.

Tiny models run fastest single-threaded: on a shared 2-core machine, intra-op threads contend
and a 16-channel conv1d takes 0.25 s instead of 0.1 ms.
"""
import torch

torch.set_num_threads(1)
