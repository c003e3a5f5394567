"""The ledger of the GPU command's unfinished units: a unit killed at its box (or failed) stays in
``results/gpu_attempts.json`` and runs after the units that never failed in the next window; a unit
that ends leaves no entry."""
from __future__ import annotations

import importlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posattn.bench import attempts, gpu_check
from posattn.bench.gpu_check import Driver, Settings
from posattn.errors import PositionError

bench_run = importlib.import_module("posattn.bench.run")


def test_a_unit_that_ends_leaves_no_entry_and_one_that_raises_stays(tmp_path: Path) -> None:
    with attempts.running("ab: x", tmp_path):
        assert attempts.tries("ab: x", tmp_path) == 1   # entered while it runs
    assert attempts.load(tmp_path) == {}
    for expected in (1, 2):
        with pytest.raises(RuntimeError), attempts.running("ab: x", tmp_path):
            raise RuntimeError("out of memory")
        assert attempts.tries("ab: x", tmp_path) == expected
    with attempts.running("ab: x", tmp_path):
        pass
    assert attempts.load(tmp_path) == {}   # it finished at last


def test_a_killed_unit_stays_in_the_ledger(tmp_path: Path) -> None:
    code = ("import sys, time\nfrom posattn.bench import attempts\n"
            "with attempts.running('layer_eager: t5', sys.argv[1]):\n    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while attempts.tries("layer_eager: t5", tmp_path) == 0:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)   # what the driver sends at a stage's box
        proc.wait(timeout=30)
    ledger = json.loads((tmp_path / attempts.LEDGER).read_text())
    assert ledger["layer_eager: t5"]["tries"] == 1 and ledger["layer_eager: t5"]["date"]


def test_units_that_failed_run_after_the_others_fewest_failures_first(tmp_path: Path) -> None:
    for key, n in (("s: b", 2), ("s: c", 1)):
        for _ in range(n):
            with pytest.raises(KeyboardInterrupt), attempts.running(key, tmp_path):
                raise KeyboardInterrupt
    assert attempts.in_order(["a", "b", "c", "d"], lambda u: f"s: {u}", tmp_path) == ["a", "d", "c", "b"]
    done = []
    for unit, _ in attempts.in_turn("s", ["a", "b", "c", "d"], str, tmp_path):
        assert attempts.tries(f"s: {unit}", tmp_path) >= 1   # in the ledger while the loop body runs
        done.append(unit)
    assert done == ["a", "d", "c", "b"] and attempts.load(tmp_path) == {}


def test_a_unit_whose_rows_failed_stays_in_the_ledger(tmp_path: Path) -> None:
    for unit, attempt in attempts.in_turn("ab", ["x", "y"], str, tmp_path):
        if unit == "x":
            attempt.fail()   # e.g. its B arm errored on this device: nothing stored for it
    ledger = attempts.load(tmp_path)
    assert list(ledger) == ["ab: x"] and ledger["ab: x"]["tries"] == 1
    assert attempts.in_order(["x", "y"], lambda u: f"ab: {u}", tmp_path) == ["y", "x"]


def test_a_file_that_is_not_a_ledger_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / attempts.LEDGER).write_text('{"ab: x": 3}')
    with pytest.raises(PositionError, match="not a ledger"):
        attempts.load(tmp_path)
    (tmp_path / attempts.LEDGER).write_text("{")
    with pytest.raises(PositionError, match="not a readable JSON file"):
        attempts.load(tmp_path)


def test_the_ab_stage_runs_a_unit_killed_in_an_earlier_window_last(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings(out=tmp_path, device="cpu", tiny=True, shapes=[(16, 2)], mechanisms=["dynamic_conv"], repeats=1,
                 results=tmp_path / "results", work=tmp_path / "work")
    units = gpu_check.ab_todo(s)
    keys = _ab_keys(s, monkeypatch)   # the keys the stage enters, in its order
    assert len(units) == len(keys) >= 2 and all(k.startswith("ab: ") for k in keys)
    (s.results / attempts.LEDGER).write_text(json.dumps({keys[0]: {"tries": 1, "date": "2026-11-27"}}))
    order: list[dict] = []
    monkeypatch.setattr(bench_run, "run", lambda opts, **kw: order.append(opts.ab) or [])
    gpu_check.ab_stage(s, tmp_path / "rows.json")
    assert order == [ab for _, _, ab in units[1:]] + [units[0][2]]
    assert attempts.load(s.results) == {}   # every unit ended (their rows, none here, would be stored)

    failing = {"mechanism": "dynamic_conv", "error": "RuntimeError: no kernel"}   # a row that failed
    monkeypatch.setattr(bench_run, "run", lambda opts, **kw: [failing] if opts.ab == units[1][2] else [])
    gpu_check.ab_stage(s, tmp_path / "rows.json")
    assert list(attempts.load(s.results)) == [keys[1]]   # it stays, and runs last next time

    (s.results / attempts.LEDGER).write_text(json.dumps({keys[1]: {"tries": 2, "date": "2026-11-27"}}))
    driver = Driver(s)
    monkeypatch.setattr(driver, "child", lambda argv, limit, log=None: (None, limit))
    driver.stage("ab", ["true"])
    assert "1 unit(s) unfinished in some window, run after the others" in driver.results[-1].note


def _ab_keys(s: Settings, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ledger keys of the ab stage's units, in order, as the stage enters them."""
    keys: list[str] = []
    real = attempts.running

    def spy(key: str, root: object = None):  # type: ignore[no-untyped-def]
        keys.append(key)
        return real(key, root)

    monkeypatch.setattr(attempts, "running", spy)
    monkeypatch.setattr(bench_run, "run", lambda opts, **kw: [])
    gpu_check.ab_stage(s, s.out / "probe.json")
    monkeypatch.setattr(attempts, "running", real)
    return keys
