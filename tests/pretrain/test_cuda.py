"""Pretraining on CUDA: bf16 autocast trains, and an interrupted run resumes to the same weights."""
from __future__ import annotations

import pytest
import torch

from posattn.pretrain.config import parse
from posattn.pretrain.run import pretrain

from .conftest import read_weights, tiny
from .test_pretrain import Interrupt, stop_at

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_bf16_run_on_cuda_resumes_exactly(corpus, tmp_path):
    cfg = parse(tiny(corpus, objective="clm", mechanisms=["cat", "rope"], precision="bf16", dropout=0.1))
    whole = pretrain(cfg, tmp_path / "whole", device="cuda", progress=False)
    assert whole["device"].startswith("cuda")

    with pytest.raises(Interrupt):
        pretrain(cfg, tmp_path / "cut", device="cuda", progress=False, on_step=stop_at(3))
    pretrain(cfg, tmp_path / "cut", device="cuda", progress=False)
    a, b = read_weights(tmp_path / "whole"), read_weights(tmp_path / "cut")
    # CUDA kernels may be non-deterministic (atomics in backward): equal up to float noise
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)
