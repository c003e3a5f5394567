"""A tiny compare sweep, run once for the tests of the results store and ``posattn report``."""
from __future__ import annotations

from pathlib import Path

import pytest

from posattn.synthetic.compare import run_sweep, validate_config

TINY = {"name": "tiny", "task": "mqar", "task_params": {"num_kv_pairs": 2}, "vocab_size": 16, "train_length": 8,
        "test_lengths": [8, 16], "examples": {"train": 64, "valid": 16, "test": 16}, "d_model": 8, "seeds": [0, 1],
        "models": [{"mechanisms": ["rope"], "layers": 1}, {"mechanisms": ["none"], "layers": 1}],
        "training": {"steps": 3, "batch_size": 8, "lr": 0.01, "eval_every": 3},
        "claims": [{"claim": "rope beats none", "paper": "-", "holds": ["rope (1L) > none (1L)"]}]}


@pytest.fixture(scope="session")
def tiny() -> dict:
    """The tiny sweep's config (a copy: tests may change it)."""
    return {**TINY}


@pytest.fixture(scope="session")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny sweep (two models × two seeds = four cells) run for real; tests copy it before changing it."""
    out = tmp_path_factory.mktemp("compare") / "run"
    run_sweep(validate_config(TINY), out, progress=False)
    return out
