"""One profiled training step (``posattn bench --profile``): the operators are ranked by the
time they take, the shares add up, a big matrix product outranks the small ops around it, and the
profile reaches the rows, bench.txt and the terminal."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posattn.bench.profile import profile_lines, profiles_text, step_profile
from posattn.cli import main
from posattn.errors import PositionError


def test_the_largest_operator_comes_first_and_the_shares_add_up() -> None:
    torch.manual_seed(0)
    # the products are sized so that their time (~6·10^9 flops, tens of ms) dwarfs a scheduler
    # time slice landing in a small op's own time on a loaded machine: at 384 × 384 (~10^8 flops)
    # such a slice once put MmBackward0's self time above aten::mm's
    big = torch.randn(1024, 1024, requires_grad=True)
    small = torch.randn(8, requires_grad=True)

    def step() -> None:
        (big @ big).sum().backward()   # one mm forward and its two backward mm
        for _ in range(3):
            (small * 2).sum().backward()

    step()
    prof = step_profile(step, "cpu", top=2)
    assert prof["clock"] == "cpu self time" and prof["kernels"] == [] and prof["total_ms"] > 0
    names = [e["name"] for e in prof["ops"]]
    assert names[0] == "aten::mm" and prof["ops"][0]["calls"] == 3 and names[-1] == "other"
    assert len(names) == 3 and prof["ops"][0]["share"] > 0.5
    assert sum(e["ms"] for e in prof["ops"]) == pytest.approx(prof["total_ms"], rel=1e-6)
    assert sum(e["share"] for e in prof["ops"]) == pytest.approx(1.0, rel=1e-6)
    lines = profile_lines("mm", prof)
    assert lines[0].startswith("mm: one training step,") and lines[1].startswith("  ops: aten::mm ")
    assert profile_lines("x", {"error": "RuntimeError: boom"}) == ["x: the profiled step failed (RuntimeError: boom)"]
    with pytest.raises(PositionError, match="must be >= 1"):
        step_profile(step, "cpu", top=0)


def test_bench_profile_reaches_rows_text_and_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["bench", "--quick", "--threads", "1", "--repeats", "1", "--warmup", "0", "-n", "64", "--kinds",
                 "layer", "-m", "t5", "--no-memory", "--profile", "4", "--out", str(out)]) == 0
    rows = json.loads((out / "bench.json").read_text())
    assert {r["mechanism"] for r in rows} == {"sdpa", "t5"}
    for r in rows:
        assert 1 <= len([e for e in r["profile"]["ops"] if e["name"] != "other"]) <= 4
    text = (out / "bench.txt").read_text()
    assert text == text.rstrip() + "\n" and profiles_text(rows) in text
    assert "t5 (layer, n=64, batch=1): one training step" in capsys.readouterr().out
    assert profiles_text([{"mechanism": "t5"}]) == ""   # rows without a profile: nothing
