"""``posattn bench`` runs end to end at tiny sizes and writes what it promises. Timings are
never asserted (they belong to the benchmark itself), only the shape of the results."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from posattn.bench.cases import CaseSpec, Sizes, make_case, parse_mechanisms, spec_label
from posattn.bench.measure import measure_memory, memory_supported
from posattn.bench.report import targets
from posattn.cli import main

TINY = ["--quick", "--threads", "1", "--repeats", "1", "--warmup", "0"]


def run_cli(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "out"
    assert main(["bench", *TINY, "--out", str(out), "--json", str(tmp_path / "rows.json"), *args]) == 0
    return json.loads((tmp_path / "rows.json").read_text())


def test_bench_rows_table_plot_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_cli(tmp_path, "-m", "t5", "dynamic_conv", "cat+tisa", "absolute", "--no-memory")
    text = capsys.readouterr().out
    assert "train ×" in text and "t5" in text
    for name in ("bench.txt", "bench.json", "bench.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    keys = {(r["mechanism"], r["kind"], r["n"]) for r in rows}
    for n in (64, 128):
        for kind in ("layer", "op"):
            assert ("sdpa", kind, n) in keys and ("t5", kind, n) in keys and ("cat+tisa", kind, n) in keys
        assert ("absolute", "layer", n) in keys and ("absolute", "op", n) not in keys  # input only
    for r in rows:
        assert {"mechanism", "n", "train_ratio", "infer_ratio", "peak_mem_mb", "path"} <= r.keys()
        assert r["train_ratio"] > 0 and r["infer_ratio"] > 0
        if r["mechanism"] == "sdpa":
            assert r["train_ratio"] == 1.0
    assert {r["path"] for r in rows if r["mechanism"] == "t5"} == {"dense"}  # short inputs


@pytest.mark.skipif(not memory_supported(), reason="peak memory needs Linux /proc/self/clear_refs")
def test_peak_memory_child_process() -> None:
    sizes = Sizes(heads=2, head_dim=16, max_len=256)
    specs = [CaseSpec("op", "sdpa", 256), CaseSpec("op", json.dumps(["t5"]), 256),
             CaseSpec("layer", json.dumps(["nonexistent"]), 256)]
    mem = measure_memory(specs, sizes, threads=1, timeout=300)
    assert mem[specs[0]]["train_mb"] >= 0 and mem[specs[1]]["train_mb"] >= 0
    assert "error" in mem[specs[2]]


@pytest.mark.skipif(importlib.util.find_spec("x_transformers") is None, reason="x-transformers absent")
def test_peers_share_the_run(tmp_path: Path) -> None:
    rows = run_cli(tmp_path, "-m", "t5", "--peers", "--no-memory", "-n", "64", "--kinds", "layer")
    names = {r["mechanism"] for r in rows}
    assert {"xt_t5", "xt_alibi", "t5", "alibi"} <= names  # peers and the mechanisms they match
    assert all(r["train_ms"] > 0 for r in rows if r["kind"] == "peer")


def test_conv_timings(tmp_path: Path) -> None:
    assert main(["bench", "--conv", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "conv.json").read_text())
    assert [r["kernel"] for r in rows][:3] == [1, 2, 3]
    assert all(r["shift_ms"] > 0 and r["fft_ms"] > 0 and r["chosen"] for r in rows)


def test_targets_and_specs() -> None:
    rows = [{"mechanism": "t5", "kind": "layer", "n": 4096, "train_ratio": 1.7, "peak_mem_mb": 100.0},
            {"mechanism": "t5", "kind": "layer", "n": 16384, "train_ratio": None, "peak_mem_mb": 420.0},
            {"mechanism": "rope", "kind": "layer", "n": 4096, "train_ratio": 1.1, "peak_mem_mb": None},
            {"mechanism": "xt_t5", "kind": "peer", "n": 2048, "train_ms": 300.0},
            {"mechanism": "t5", "kind": "layer", "n": 2048, "train_ms": 100.0}]
    lines = targets(rows, {"xt_t5": "t5"})
    assert any("t5: MISSED" in x and "1.6" in x for x in lines)
    assert any("rope: met" in x for x in lines)
    assert any("16384" in x and "met" in x for x in lines)
    assert any("xt_t5" in x and "3.0" in x and "met" in x for x in lines)
    assert parse_mechanisms("cat+tisa") == ["cat", "tisa"]
    assert spec_label(parse_mechanisms('[{"name": "tisa", "n_kernels": 3}]')) == "tisa(n_kernels=3)"
    assert make_case(CaseSpec("op", json.dumps(["absolute"]), 8), Sizes(2, 4, max_len=8)) is None


def test_bad_mechanism_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *TINY, "-m", "nope"]) == 2
    assert "unknown mechanism 'nope'" in capsys.readouterr().err
