"""The sweep runner itself (:mod:`posattn.experiments.sweep`), on a toy recipe whose cells write a
small JSON file: resume, waves, the time budget's partial summary and note, report-only, a
failing cell, ``only`` and the atomic ``config.yaml``."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from posattn.errors import CellError, PositionError
from posattn.experiments import sweep
from posattn.experiments.config import ConfigError
from posattn.experiments.executors import LocalExecutor
from posattn.runtime import files

Job = tuple[str, str, str | None, bool]     # (out, cell id, id of a cell that must be finished first, fail)


def toy_run(job: Job, in_worker: bool) -> dict:
    """Write ``cells/<id>.json``; log the call (in a file: workers are other processes); a cell with a
    source refuses to run before its source has finished."""
    out, cell_id, source, fail = job
    with open(Path(out) / "calls.txt", "a") as log:
        log.write(cell_id + "\n")
    if fail:
        raise ValueError("boom")
    if source is not None and toy_read((out, source, None, False)) is None:
        raise AssertionError(f"{cell_id} started before {source} finished")
    record = {"id": cell_id, "value": len(cell_id)}
    files.write_json_atomic(Path(out) / "cells" / f"{cell_id}.json", record)
    return record


def toy_read(job: Job) -> dict | None:
    path = Path(job[0]) / "cells" / f"{job[1]}.json"
    return json.loads(path.read_text()) if path.exists() else None


def calls(out: Path) -> list[str]:
    path = out / "calls.txt"
    return path.read_text().split() if path.exists() else []


def toy(out: Path, ids: list[str], waves: dict[str, int] | None = None, sources: dict[str, str] | None = None,
        fail: str | None = None, **kw) -> tuple[sweep.Recipe, list[tuple[list[str], int]]]:
    """A recipe of cells ``ids`` and the list its summary writer appends (ids, total) to."""
    (out / "cells").mkdir(parents=True, exist_ok=True)
    summaries: list[tuple[list[str], int]] = []

    def write_summary(results: list[dict], total: int, folder: Path) -> None:
        summaries.append(([r["id"] for r in results], total))
        files.write_json_atomic(folder / "results.json", {"total": total, "cells": results})

    cells = [sweep.Cell(i, f"cell {i}", (str(out), i, (sources or {}).get(i), i == fail), (waves or {}).get(i, 0))
             for i in ids]
    return sweep.Recipe("toy 'sweep'", cells, toy_run, toy_read, write_summary, **kw), summaries


def test_a_rerun_reads_finished_cells_back_and_runs_only_the_missing_ones(tmp_path):
    recipe, summaries = toy(tmp_path, ["a", "bb", "ccc"], config={"name": "toy", "cells": 3})
    first = sweep.run(recipe, tmp_path, progress=False)
    assert calls(tmp_path) == ["a", "bb", "ccc"] and [r["value"] for r in first] == [1, 2, 3]
    assert summaries == [(["a", "bb", "ccc"], 3)]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"name": "toy", "cells": 3}
    (tmp_path / "cells" / "bb.json").unlink()
    again = sweep.run(recipe, tmp_path, progress=False)
    assert calls(tmp_path) == ["a", "bb", "ccc", "bb"] and again == first


def test_cells_that_check_themselves_are_handed_over_even_when_finished(tmp_path):
    recipe, _ = toy(tmp_path, ["a", "bb"], skip_finished=False)
    sweep.run(recipe, tmp_path, progress=False)
    sweep.run(recipe, tmp_path, progress=False)
    assert calls(tmp_path) == ["a", "bb", "a", "bb"]


def test_a_wave_starts_after_every_cell_of_the_one_before(tmp_path):
    """Cells listed wave 1 first still run after wave 0; results come wave by wave."""
    recipe, summaries = toy(tmp_path, ["late", "early", "later", "first"], waves={"late": 1, "later": 1},
                            sources={"late": "early", "later": "first"})
    results = sweep.run(recipe, tmp_path, progress=False)
    assert calls(tmp_path) == ["early", "first", "late", "later"]
    assert [r["id"] for r in results] == ["early", "first", "late", "later"] == summaries[-1][0]


def test_waves_hold_in_worker_processes(tmp_path):
    recipe, _ = toy(tmp_path, ["b1", "a1", "a2", "b2"], waves={"b1": 1, "b2": 1}, sources={"b1": "a1", "b2": "a2"})
    results = sweep.run(recipe, tmp_path, LocalExecutor(2, threads=1), progress=False)
    assert [r["id"] for r in results] == ["a1", "a2", "b1", "b2"]
    assert set(calls(tmp_path)[:2]) == {"a1", "a2"}


def test_report_only_summarises_the_finished_cells_and_refuses_when_there_are_none(tmp_path):
    recipe, summaries = toy(tmp_path, ["a", "bb", "ccc"])
    with pytest.raises(ConfigError, match=r"no finished cells of toy 'sweep' to report yet"):
        sweep.run(recipe, tmp_path / "report", progress=False, report_only=True)
    toy_run((str(tmp_path), "ccc", None, False), False)
    results = sweep.run(recipe, tmp_path / "report", progress=False, report_only=True)
    assert [r["id"] for r in results] == ["ccc"] and summaries == [(["ccc"], 3)]
    assert calls(tmp_path) == ["ccc"] and not (tmp_path / "report" / "config.yaml").exists()


def test_the_time_budget_leaves_cells_for_the_next_run_and_says_how_many(tmp_path, capsys):
    recipe, summaries = toy(tmp_path, ["a", "bb", "ccc"])
    toy_run((str(tmp_path), "bb", None, False), False)
    results = sweep.run(recipe, tmp_path, LocalExecutor(deadline=time.time()), progress=False)
    assert [r["id"] for r in results] == ["bb"] and calls(tmp_path) == ["bb"]
    assert summaries == [(["bb"], 3)]      # a partial summary: 1 of 3
    assert "time limit: 1 of 3 cells finished, 2 remain; rerun the same command to resume" in capsys.readouterr().out
    sweep.run(recipe, tmp_path, progress=False)
    assert calls(tmp_path) == ["bb", "a", "ccc"] and "time limit" not in capsys.readouterr().out


def test_a_failing_cell_raises_its_error_once_and_keeps_the_finished_cells(tmp_path):
    """In this process the cell's own error comes through; nothing after it starts, no summary is
    written over the last one, and the next run resumes after the finished cells."""
    recipe, summaries = toy(tmp_path, ["a", "bb", "ccc"], fail="bb")
    with pytest.raises(ValueError, match="boom"):
        sweep.run(recipe, tmp_path, progress=False)
    assert calls(tmp_path) == ["a", "bb"] and summaries == [] and not (tmp_path / "results.json").exists()
    recipe, _ = toy(tmp_path, ["a", "bb", "ccc"])
    sweep.run(recipe, tmp_path, progress=False)
    assert calls(tmp_path) == ["a", "bb", "bb", "ccc"]


def test_a_cell_failing_in_a_worker_is_one_cell_error_naming_it(tmp_path):
    recipe, summaries = toy(tmp_path, ["a", "bb"], fail="bb")
    with pytest.raises(CellError) as raised:
        sweep.run(recipe, tmp_path, LocalExecutor(2, threads=1), progress=False)
    message = str(raised.value)
    assert message.startswith("cell bb failed") and message.count("cell bb failed") == 1 and "boom" in message
    assert summaries == []


def test_only_runs_the_cells_named_and_summarises_every_finished_one(tmp_path, capsys):
    recipe, summaries = toy(tmp_path, ["a", "bb", "ccc"], unit="runs")
    toy_run((str(tmp_path), "a", None, False), False)
    results = sweep.run(recipe, tmp_path, LocalExecutor(deadline=time.time()), progress=False, only=["ccc"])
    assert calls(tmp_path) == ["a"] and [r["id"] for r in results] == ["a"]
    assert "time limit: 0 of 1 runs finished, 1 remain" in capsys.readouterr().out
    results = sweep.run(recipe, tmp_path, progress=False, only=["ccc"])
    assert calls(tmp_path) == ["a", "ccc"] and summaries[-1] == (["a", "ccc"], 3)
    with pytest.raises(PositionError, match="toy 'sweep' has no cell dd"):
        sweep.run(recipe, tmp_path, progress=False, only=["dd"])


def test_config_yaml_is_replaced_atomically(tmp_path, monkeypatch):
    """A write that fails half way leaves the previous config.yaml whole and no temporary file."""
    recipe, _ = toy(tmp_path, ["a"], config={"name": "toy", "cells": 2})
    (tmp_path / "config.yaml").write_text("name: toy\ncells: 1\n")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        sweep.run(recipe, tmp_path, progress=False)
    assert (tmp_path / "config.yaml").read_text() == "name: toy\ncells: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cells", "config.yaml"]


def test_a_folder_holding_another_sweeps_run_is_refused(tmp_path):
    """Run into the folder of another sweep, a sweep would overwrite its config and summary and mix
    their cells: one error naming both, nothing written, nothing run."""
    recipe, summaries = toy(tmp_path, ["a"], config={"name": "toy"})
    (tmp_path / "config.yaml").write_text("name: older\n")
    with pytest.raises(PositionError, match=f"{tmp_path / 'config.yaml'} was written with a different config "
                                            r"\(name: 'older' -> 'toy'\); use another output folder"):
        sweep.run(recipe, tmp_path, progress=False)
    assert (tmp_path / "config.yaml").read_text() == "name: older\n"
    assert calls(tmp_path) == [] and summaries == []


def test_cells_finished_elsewhere_are_not_run_and_each_new_cell_is_handed_on(tmp_path: Path) -> None:
    recipe, summaries = toy(tmp_path, ["a", "b", "c"])
    elsewhere = {"b": {"id": "b", "value": 99}}
    handed: list[tuple[str, dict]] = []
    results = sweep.run(recipe, tmp_path, progress=False, stored=elsewhere,
                        on_cell=lambda cell_id, record: handed.append((cell_id, record)))
    assert calls(tmp_path) == ["a", "c"]                        # b was finished elsewhere
    assert [r["value"] for r in results] == [1, 99, 1] and summaries[-1] == (["a", "b", "c"], 3)
    assert handed == [("a", {"id": "a", "value": 1}), ("c", {"id": "c", "value": 1})]
    # the run folder's own record of a cell wins over the stored one; report-only counts stored cells
    files.write_json_atomic(tmp_path / "cells" / "b.json", {"id": "b", "value": 1})
    recipe, summaries = toy(tmp_path, ["a", "b", "c", "d"])
    sweep.run(recipe, tmp_path, progress=False, report_only=True, stored={"b": {"id": "b", "value": 99},
                                                                         "d": {"id": "d", "value": 7}})
    assert summaries[-1] == (["a", "b", "c", "d"], 4)
    assert json.loads((tmp_path / "results.json").read_text())["cells"][1]["value"] == 1
