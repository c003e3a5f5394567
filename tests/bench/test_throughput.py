"""``posattn bench-throughput`` on the CPU at tiny size: every (workers, compile) setting of a
cell becomes one store record keyed by what determines it, its ratio is to the baseline (one
eager worker) of the same run, a bad option is one error, and a failing worker is said once."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posattn.bench import throughput
from posattn.bench.throughput import RECIPE, Setting, bench, pick_cells, settings
from posattn.cli import main
from posattn.errors import PositionError, RunError
from posattn.experiments import report, store
from posattn.synthetic.compare import load_config, validate_config

TINY = ("name: tiny_mqar\ntask: mqar\ntask_params: {num_kv_pairs: 2}\nvocab_size: 16\n"
        "train_length: [16, 32]\ntest_multipliers: [1]\nexamples: {train: 200, valid: 20, test: 20}\n"
        "d_model: [8, 16]\nn_heads: 2\nd_ff: 0\nmodels:\n  - {mechanisms: [cat], layers: 1}\n"
        "  - {mechanisms: [rope], layers: 1}\ntraining: {steps: 600, batch_size: 4, lr: 0.003, eval_every: 100}\n")


@pytest.fixture(autouse=True)
def no_native_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spawned workers use the reference kernels: they test the measuring, not the fused
    kernels, and need not wait for their first build."""
    monkeypatch.setenv("POSATTN_NATIVE", "0")


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


def test_cells_are_picked_by_shape_or_id(config: str) -> None:
    sweep = validate_config(load_config(config))
    smallest, middle, largest = pick_cells(sweep, ["smallest", "middle", "largest"])
    assert throughput.shape(smallest) == (16, 8) and throughput.shape(largest) == (32, 16)
    assert throughput.shape(middle) == (32, 8)  # the shapes ordered by length, then width
    assert smallest.label == "cat (1L)"  # a shape's first cell in the sweep's order
    assert pick_cells(sweep, [sweep.cells[3].id, "smallest", "smallest"]) == [sweep.cells[3], smallest]
    with pytest.raises(PositionError, match=r"'nowhere', 'x' is not a cell of tiny_mqar .*smallest, middle, largest"):
        pick_cells(sweep, ["nowhere", "largest", "x"])


def test_the_baseline_comes_first() -> None:
    assert settings([2, 1], ["default", "none"]) == [Setting(1), Setting(2, "default"), Setting(1, "default"),
                                                      Setting(2)]


def test_tiny_run_stores_one_record_per_setting(config: str, tmp_path: Path) -> None:
    root = tmp_path / "results"
    wanted = settings([1, 2], ["none", "dynamo"])
    rows = bench(config, ["smallest"], wanted, steps=3, warmup=1, device="cpu", root=root)
    assert [(r["workers"], r["mode"]) for r in rows] == [(1, "eager"), (2, "eager"), (1, "compile dynamo"),
                                                         (2, "compile dynamo")]
    base = rows[0]
    for r in rows:
        assert r["cells_per_hour"] == pytest.approx(r["aggregate_steps_per_s"] * 3600 / 600)
        assert r["vs_baseline"] == pytest.approx(r["cells_per_hour"] / base["cells_per_hour"])
        assert 0 < r["eval_share"] < 1 and r["cells_per_hour_with_eval"] < r["cells_per_hour"]
        assert r["warmup_s"] > 0 and r["steps"] == 3 and r["cell_steps"] == 600
        # the same aggregate rate less each cell's start-up: below the column beside it, however
        # unevenly the workers shared the cores
        assert r["cells_per_hour_started"] < r["cells_per_hour_with_eval"]
        per_cell_s = r["cell_steps"] / (r["aggregate_steps_per_s"] / r["workers"] * (1 - r["eval_share"]))
        assert r["cells_per_hour_started"] == pytest.approx(r["workers"] * 3600 / (per_cell_s + r["warmup_s"]))
    assert base["vs_baseline"] == 1.0 and base["steps_per_s"] == pytest.approx(base["aggregate_steps_per_s"])

    records = store.load(RECIPE, root, kind="cell")
    assert len(records) == 4
    hw = store.hardware("cpu")
    for rec in records:
        key = {k: v for k, v in rec["result"].items() if k != "row"}
        assert set(key) == {"bench", "recipe", "cell", "workers", "mode", "steps", "warmup", "threads", "hardware"}
        assert rec["id"] == store.content_id(key) and key["hardware"] == hw and key["recipe"] == "tiny_mqar"
        assert rec["provenance"]["command"].startswith("posattn bench-throughput ") and rec["provenance"]["date"]
        assert "--worker-counts 1 2 --compile-modes none dynamo" in rec["provenance"]["command"]

    _, text = report.build(RECIPE, root)
    assert "before (1 worker, eager)" in text and "compile dynamo" in text and "Provenance:" in text
    assert "start-up counted, at the full budget" in text

    # the GPU command's way: what the store holds is not measured again
    assert bench(config, ["smallest"], wanted, steps=3, warmup=1, device="cpu", root=root, skip_stored=True) == []


def test_start_up_decides_the_winner_by_cell_length() -> None:
    """With each cell's start-up counted, many eager workers win short cells and fewer compiled
    workers long ones; they tie at the break-even length (the H100's rows of 2026-11-27)."""
    eager = {"workers": 8, "aggregate_steps_per_s": 289.6, "eval_share": 0.01, "warmup_s": 6.8, "cell_steps": 6000}
    comp = {"workers": 4, "aggregate_steps_per_s": 434.4, "eval_share": 0.13, "warmup_s": 13.1, "cell_steps": 6000}
    at = throughput.break_even_steps(eager, comp)
    assert at is not None and 2000 < at < 4000
    started = throughput.cells_per_hour_started
    assert started(eager, round(at)) == pytest.approx(started(comp, round(at)), rel=1e-3)
    assert started(eager, 600) > started(comp, 600) and started(eager) < started(comp)
    # quicker and started sooner: the compiled step wins at every length
    assert throughput.break_even_steps(eager, {**comp, "warmup_s": 1.0}) is None
    one = {"workers": 1, "aggregate_steps_per_s": 100.0, "eval_share": 0.0, "warmup_s": 10.0, "cell_steps": 1000}
    assert started(one) == pytest.approx(3600 / 20)
    # a straggler lowers the aggregate, and with it every worker's share: two workers whose steps
    # over the whole span came to 150 steps/s are credited 75 steps/s each, not 100
    two = {**one, "workers": 2, "aggregate_steps_per_s": 150.0}
    assert started(two) == pytest.approx(2 * 3600 / (1000 / 75 + 10))


def test_bad_options_are_one_error(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench-throughput", config, "--compile-modes", "fast"])
    assert exit_.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err
    assert main(["bench-throughput", config, "--cells", "huge", "--no-store"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("posattn: error: bench-throughput --cells: 'huge'")
    with pytest.raises(PositionError, match="--steps and --warmup must be >= 1"):
        bench(config, ["smallest"], [Setting(1)], steps=0, warmup=1, device="cpu", store_rows=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA: the workers' device fails")
def test_a_failing_worker_is_said_once(config: str, tmp_path: Path) -> None:
    with pytest.raises(RunError) as error:
        bench(config, ["smallest"], [Setting(2)], steps=2, warmup=1, device="cuda", root=tmp_path)
    message = str(error.value)
    assert message.startswith("bench-throughput: cat (1L) (cell ") and "1 worker(s), eager: worker " in message
    assert message.count("failed:") == 1 and "CUDA" in message
    assert not (tmp_path / RECIPE).exists()  # nothing stored
    cell = pick_cells(validate_config(load_config(config)), ["smallest"])[0]
    with pytest.raises(RunError) as error:
        throughput.measure(cell, Setting(2), 2, 1, "cuda", 1)
    message = str(error.value)
    assert "2 worker(s), eager: worker 1 of 2 failed: " in message and message.endswith("(2 of 2 workers failed)")
    assert message.count("failed:") == 1


def test_the_timed_evaluation_is_not_the_first(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell's first evaluation pays once-only costs (lazily loaded kernels; the eager path's
    first use after a compiled step): the worker pays them in its warm-up, so the evaluation it
    times (which stands for each of the cell's evaluations) is a later one."""
    import importlib
    import queue
    import threading
    import time

    train_module = importlib.import_module("posattn.synthetic.train")  # the package exports train()

    real, calls = train_module.evaluate, []

    def first_is_slow(*args: object, **kwargs: object) -> float:
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", first_is_slow)
    cell = pick_cells(validate_config(load_config(config)), ["smallest"])[0]
    results: queue.Queue = queue.Queue()
    throughput.work(throughput.Job(cell, 0, None, 2, 1, "cpu", 1), threading.Barrier(1), results)
    report_ = results.get_nowait()
    assert "error" not in report_, report_
    assert len(calls) == 2 and report_["eval_s"] < 0.5 <= report_["warmup_s"]
    assert calls[0] < report_["start"] < report_["end"] < calls[1]
