"""torchrun: 2 CPU processes (gloo) with global batch 2B follow the 1-process trajectory."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from .conftest import read_weights, tiny


def run(args: list[str], cwd) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def losses(folder) -> list[float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_two_processes_match_one(corpus, tmp_path, objective):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny(corpus, objective=objective, mechanisms=["t5"], steps=4, batch_size=8)))
    cli = [sys.executable, "-m", "posattn.cli", "pretrain", str(cfg), "--no-progress", "--device", "cpu"]
    run(cli + ["--out", str(tmp_path / "one")], tmp_path)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *cli[1:],
         "--out", str(tmp_path / "two")], tmp_path)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    a, b = read_weights(tmp_path / "one"), read_weights(tmp_path / "two")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    result = json.loads((tmp_path / "two" / "result.json").read_text())
    assert result["processes"] == 2
