"""The prepared GPU command's parts on the CPU: benchmark rows become store records keyed by their
setup, a setup in the store is not measured again, stages are killed at their time box, the
archive holds exactly the new and changed store files, stored CAT cells are counted, and the
throughput stage shrinks with GPU_CHECK_TINY and stores each setting once."""
from __future__ import annotations

import importlib
import json
import sys
import tarfile
from pathlib import Path

import pytest

from posattn.bench import gpu_check
from posattn.bench.cases import Sizes
from posattn.bench.gpu_check import (
    Driver,
    Settings,
    fill_boxes,
    gpu_cells,
    layer_plan,
    layer_stage,
    stored,
    throughput_left,
    throughput_stage,
)
from posattn.bench.models import model_name
from posattn.bench.store import AB_RECIPE, LAYER_RECIPE, publish_rows, setup
from posattn.errors import PositionError
from posattn.experiments import store
from posattn.synthetic.compare import Sweep, load_config, validate_config

bench_run = importlib.import_module("posattn.bench.run")  # the module (the package exports its run())


def tiny(tmp_path: Path, **kw: object) -> Settings:
    s = Settings(out=tmp_path, device="cpu", tiny=True, shapes=[(16, 2)], mechanisms=["t5", "rope"], repeats=1,
                 results=tmp_path / "results", work=tmp_path / "work")
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def tiny_cat(tmp_path: Path, train_length: str = "16", d_model: str = "16", train: int = 64, held: int = 16,
             steps: int = 3) -> Path:
    """A two-model MQAR recipe small enough to train in seconds (the CAT stage's tests)."""
    config = tmp_path / "tiny.yaml"
    config.write_text(f"name: tiny_cat\ntask: mqar\ntask_params: {{num_kv_pairs: 2}}\nvocab_size: 16\n"
                      f"train_length: {train_length}\ntest_multipliers: [1]\n"
                      f"examples: {{train: {train}, valid: {held}, test: {held}}}\n"
                      f"d_model: {d_model}\nn_heads: 2\nd_ff: 0\nmodels:\n  - {{mechanisms: [cat], layers: 1}}\n"
                      f"  - {{mechanisms: [rope], layers: 1}}\n"
                      f"training: {{steps: {steps}, batch_size: 8, lr: 0.003}}\n")
    return config


def store_cells(sweep: Sweep, root: Path, *ids: str) -> None:
    """The store at ``root`` as a run of ``sweep`` leaves it: the recipe's record (once) and a
    result for each cell of ``ids``."""
    from posattn.experiments.publish import recipe_result
    from posattn.experiments.runs import Run

    prov = store.provenance("posattn compare", "cpu")
    recipe = recipe_result(Run(root.parent, "compare", sweep.name, sweep.config, {}, len(sweep.cells),
                               "posattn compare"))
    store.publish(sweep.name, store.RECIPE_ID, recipe, prov, kind="recipe", root=root)
    length = {cell.id: cell.train_length for cell in sweep.cells}
    for cell_id in ids:
        store.publish(sweep.name, cell_id, {"id": cell_id, "accuracy": {str(length[cell_id]): 0.5}}, prov, root=root)


def test_layer_stage_stores_each_setup_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = tiny(tmp_path, mechanisms=["absolute", "rope"])  # no mechanism of the layer target: no target run
    layer_stage(s, "eager", tmp_path / "rows.json")
    records = store.load(LAYER_RECIPE, s.results, kind="cell")
    assert sorted(r["result"]["case"] for r in records) == ["absolute", "rope", "sdpa"]
    hw = store.hardware("cpu")
    for r in records:
        key = {k: r["result"][k] for k in r["result"] if k != "row"}
        assert r["id"] == store.content_id(key) and key["hardware"] == hw and key["n"] == 16 and key["batch"] == 2
        assert key["mode"] == "eager" and r["result"]["row"]["train_ms"] > 0
        assert "--kinds layer" in r["provenance"]["command"] and r["provenance"]["date"]
    base = next(r for r in records if r["result"]["case"] == "sdpa")
    assert base["result"]["row"]["train_ratio"] == 1.0
    assert len(json.loads((tmp_path / "rows.json").read_text())) == 3

    measured: list[list[list[str]]] = []
    real = bench_run.run
    monkeypatch.setattr(bench_run, "run", lambda opts, **kw: measured.append(opts.mechanisms) or real(opts, **kw))
    layer_stage(s, "eager", tmp_path / "rows.json")
    assert measured == []  # everything is in the store: nothing measured again
    s.mechanisms = ["absolute", "rope", "sinusoidal"]
    layer_stage(s, "eager", tmp_path / "rows.json")
    assert measured == [[["sinusoidal"]]]  # only the missing setup (its baseline comes with it)
    assert len(store.load(LAYER_RECIPE, s.results, kind="cell")) == 4  # the first sdpa record stands


def test_the_layer_target_runs_first_against_flash_backed_sdpa(tmp_path: Path) -> None:
    """The GPU layer target compares with FlashAttention-backed SDPA: the eager stage first times
    the target's mechanisms with every SDPA call on the flash kernel (the baseline's too); those
    records carry the Policy in their setup (beside, not instead of, the grid's records of the same
    shape), the report shows them as a group of their own, and compiled runs have no such run."""
    from posattn import mechanisms as registry
    from posattn.bench.gpu_check import TARGET_POLICY, layer_todo
    from posattn.bench.records import LAYER_TARGETS, layer_groups, layer_missing

    s = tiny(tmp_path, mechanisms=["alibi", "rope"])
    first = layer_todo(s, "eager")
    assert [(t[0].max_len, t[1], t[2]) for t in first] == [(16, ["alibi"], TARGET_POLICY), (16, ["alibi", "rope"], {})]
    assert [(t[1], t[2]) for t in layer_todo(s, "default")] == [(["alibi"], {}), (["rope"], {})]  # one per run
    assert gpu_check.target_runs(Settings(out=tmp_path, shapes=[(512, 16)]), ["alibi"]) == []  # not asked: no run
    runs = gpu_check.target_runs(Settings(out=tmp_path), registry.names())  # the issue's own names first
    assert runs[0] == (4096, 16, ["alibi", "t5"], TARGET_POLICY) and runs[1][2] == ["tisa", "fixed_conv"]
    assert sum(len(g) for _, _, g, _ in runs) == len(LAYER_TARGETS)
    assert max(len(g) for _, _, g, _ in runs) == gpu_check.TARGET_GROUP
    layer_stage(s, "eager", tmp_path / "rows.json")
    assert layer_todo(s, "eager") == []
    records = store.load(LAYER_RECIPE, s.results, kind="cell")
    flash = sorted(r["result"]["case"] for r in records if r["result"].get("policy") == TARGET_POLICY)
    assert flash == ["alibi", "sdpa"]
    assert sorted(r["result"]["case"] for r in records if "policy" not in r["result"]) == ["alibi", "rope", "sdpa"]
    target = next(r for r in records if r["result"].get("policy") and r["result"]["case"] == "sdpa")
    assert "--policy sdpa_backend=flash" in target["provenance"]["command"]
    titles = [title for title, _ in layer_groups(records)]
    assert len(titles) == 2 and titles[1].endswith("fast path under sdpa_backend=flash")
    assert f"(and {len(LAYER_TARGETS)} of the target run" in " ".join(layer_missing(records, s.results))


def test_rows_with_errors_are_not_stored(tmp_path: Path) -> None:
    prov = store.provenance("posattn bench", "cpu")
    rows = [{"mechanism": "t5", "n": 8, "batch": 1, "train_ms": 1.0},
            {"mechanism": "rope", "n": 8, "batch": 1, "train_ms": None, "error": "OutOfMemoryError: ..."}]
    assert publish_rows(LAYER_RECIPE, "layer", rows, Sizes(), "eager", prov, tmp_path) == (1, 0)
    assert publish_rows(LAYER_RECIPE, "layer", rows, Sizes(), "eager", prov, tmp_path) == (0, 1)
    key = setup("layer", "t5", 8, 1, Sizes(), "default", prov["hardware"])  # another mode: another setup
    assert not store.record_path(LAYER_RECIPE, store.content_id(key), tmp_path).exists()


def test_compiled_runs_put_the_target_mechanisms_at_n_4096_first() -> None:
    names = ["none", "absolute", "rope", "alibi", "t5", "cat", "tisa", "segment", "fixed_conv", "dynamic_conv"]
    plan = layer_plan(names, [(4096, 16), (512, 16)], 4)
    assert plan[0] == (4096, 16, ["alibi", "t5", "tisa", "fixed_conv"])
    assert plan[1] == (4096, 16, ["dynamic_conv", "rope", "absolute", "cat"])
    assert plan[2] == (4096, 16, ["none", "segment"]) and plan[3][:2] == (512, 16)
    assert [g for _, _, g in layer_plan(names, [(128, 64)], None)] == [[*plan[0][2], *plan[1][2], "none", "segment"]]


def test_settings_refuse_bad_values(tmp_path: Path) -> None:
    assert Settings.from_env(tmp_path, {"GPU_CHECK_SHAPES": "4096x16 128x64"}).shapes == [(4096, 16), (128, 64)]
    assert Settings.from_env(tmp_path, {}).cat_compile == "reduce-overhead"
    assert Settings.from_env(tmp_path, {"GPU_CHECK_CAT_COMPILE": "none"}).cat_compile is None
    for env in ({"GPU_CHECK_BOXES": "layers=10"}, {"GPU_CHECK_SECONDS": "ten"}, {"GPU_CHECK_WORKERS": "0"},
                {"GPU_CHECK_EAGER_GROUP": "0"}, {"GPU_CHECK_SHAPES": "4096"}, {"GPU_CHECK_CAT_COMPILE": "fast"}):
        with pytest.raises(PositionError, match="gpu check"):
            Settings.from_env(tmp_path, env)


def test_a_tiny_run_keeps_its_store_out_of_the_repository(tmp_path: Path) -> None:
    """A smoke test's numbers must not land in the committed ``results/``: a tiny run's store is
    ``$OUT/results`` unless POSATTN_RESULTS names one; a real run's is ``results/``."""
    assert Settings.from_env(tmp_path, {}).results == Path("results")
    assert Settings.from_env(tmp_path, {"GPU_CHECK_TINY": "1"}).results == tmp_path / "results"
    assert Settings.from_env(tmp_path, {"GPU_CHECK_TINY": "0"}).results == Path("results")
    named = tmp_path / "elsewhere"
    for tiny in ("0", "1"):
        s = Settings.from_env(tmp_path, {"GPU_CHECK_TINY": tiny, "POSATTN_RESULTS": str(named)})
        assert s.results == named


def test_default_boxes_leave_the_cat_stage_its_minutes(tmp_path: Path) -> None:
    """Every box spent, the default deadline still leaves the CAT cells CAT_SECONDS: a compare
    start-up, a minute of training and the publishing of what finished."""
    s = Settings.from_env(tmp_path, {})
    left = s.seconds - sum(s.boxes.values()) - gpu_check.RESERVE
    assert left >= gpu_check.CAT_SECONDS >= gpu_check.PUBLISH + 70 + 60


def test_a_stage_is_killed_at_its_box_and_the_archive_holds_new_files(tmp_path: Path) -> None:
    s = tiny(tmp_path, seconds=120.0)
    (s.results / "old").mkdir(parents=True)
    (s.results / "old" / "a.json").write_text("{}")
    (s.results / "old" / "b.json").write_text("{}")
    driver = Driver(s)
    rc, seconds = driver.child([sys.executable, "-c", "import time; time.sleep(60)"], 1.0)
    assert rc is None and seconds < 30
    (s.results / "old" / "b.json").write_text('{"changed": 1}')
    (s.results / "new").mkdir()
    (s.results / "new" / "c.json").write_text("{}")
    driver.results.append(gpu_check.StageResult("tests", "done", 1.0))
    driver.finish()
    with tarfile.open(tmp_path / gpu_check.ARCHIVE) as tar:
        assert sorted(tar.getnames()) == ["results/new/c.json", "results/old/b.json"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "tests" in summary and "layer_eager     not reached" in summary


def test_a_stage_may_use_what_the_stages_before_it_left_of_their_boxes(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Time a stage leaves of its box (done early, failed) goes to the next stage's box; a stage
    killed at its box leaves none; a box of 0 skips its stage and keeps what was left for the next;
    the deadline bounds every box."""
    s = tiny(tmp_path, seconds=300.0)
    s.boxes = {"tests": 20, "layer_eager": 20, "layer_compiled": 20, "models": 0, "profile": 20, "ab": 20}
    given: list[float] = []
    outcomes = iter([(0, 5.0), (1, 10.0), (None, 45.0), (0, 2.0), (None, 500.0)])  # tests, ..., ab

    def child(argv: list[str], limit: float, log: object = None) -> tuple[int | None, float]:
        given.append(limit)
        return next(outcomes)

    driver = Driver(s)
    monkeypatch.setattr(driver, "child", child)
    for name in ("tests", "layer_eager", "layer_compiled", "models", "profile", "ab"):
        driver.stage(name, ["true"])
    # tests left 15 s: layer_eager got 35 and left 25; layer_compiled got 45, was killed: profile 20 only
    assert given == [20, 35, 45, 20, 38]
    assert [r.status for r in driver.results] == ["done", "failed (exit 1)", "stopped at its time box",
                                                  "skipped: its box is 0 s", "done", "stopped at its time box"]
    late = Driver(tiny(tmp_path, seconds=gpu_check.RESERVE + 12.0))   # 12 s to the deadline: a box of 12 at most
    monkeypatch.setattr(late, "child", child)
    outcomes = iter([(0, 1.0)])
    late.stage("tests", ["true"])
    assert given[-1] <= 12.0


def test_cells_in_the_store_are_counted_for_the_cat_stage(tmp_path: Path) -> None:
    config = tiny_cat(tmp_path, train=100, held=20, steps=5)
    sweep = validate_config(load_config(str(config)))
    first, root = sweep.cells[0], tmp_path / "results"
    name, present, cells = stored(str(config), root)
    assert (name, len(present), len(cells)) == ("tiny_cat", 0, 2)
    store_cells(sweep, root, first.id)
    prov = store.provenance("posattn compare", "cpu")
    store.publish("tiny_cat", "0123456789ab", {"id": "0123456789ab"}, prov, root=root)   # not a cell of this config
    name, present, cells = stored(str(config), root)
    assert (name, present, len(cells)) == ("tiny_cat", {first.id}, 2)


def test_the_gpu_takes_the_costliest_panels_first(tmp_path: Path) -> None:
    """The CAT stage hands a GPU the unfinished cells of a recipe's costliest panels (d_model ×
    training length), enough for its workers; the small ones are left to CPUs."""
    config = tiny_cat(tmp_path, train_length="[16, 32]", d_model="[8, 16]", train=100, held=20, steps=5)
    sweep, root = validate_config(load_config(str(config))), tmp_path / "results"

    def panel(d: int, n: int) -> list[str]:
        return [c.id for c in sweep.cells if (c.d_model, c.train_length) == (d, n)]

    def picked(at_least: int) -> list[str]:
        _, present, cells = stored(str(config), root)
        return gpu_cells(cells, present, at_least)

    assert picked(1) == panel(16, 32)
    # d 8 at 32 and d 16 at 16 cost the same: the longer training length first
    assert picked(3) == panel(16, 32) + panel(8, 32)
    assert sorted(picked(100)) == sorted(c.id for c in sweep.cells)
    store_cells(sweep, root, panel(16, 32)[0])
    assert picked(1) == panel(16, 32)[1:]
    assert picked(2) == panel(16, 32)[1:] + panel(8, 32)


def test_cat_stage_trains_the_missing_cells_into_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSATTN_NATIVE", "0")  # the child compare need not wait for the fused kernels' build
    config = tiny_cat(tmp_path)
    s = tiny(tmp_path, seconds=400.0, recipes=[str(config)], workers=1, cat_compile="dynamo")
    driver = Driver(s)
    driver.cat()
    records = store.load("tiny_cat", s.results, kind="cell")
    ids = " ".join(cell.id for cell in validate_config(load_config(str(config))).cells)
    assert len(records) == 2 and {r["provenance"]["command"] for r in records} == \
        {f"posattn compare {config} --store --device cpu --compile dynamo --only {ids}"}
    assert "tiny_cat: 2 new cells, 2/2 in the store" in driver.results[-1].note
    driver.cat()   # nothing left: no compare starts
    assert "tiny_cat: complete in the store (2 cells)" in driver.results[-1].note


def test_with_every_cat_cell_stored_the_measurement_stages_get_the_cat_time(tmp_path: Path) -> None:
    config = tiny_cat(tmp_path)
    sweep = validate_config(load_config(str(config)))

    def settings(**kw: object) -> Settings:
        return tiny(tmp_path, **{"seconds": 480.0, "recipes": [str(config)], "boxes": dict(gpu_check.BOXES), **kw})

    s = settings()
    assert fill_boxes(s) == 1.0 and s.boxes == gpu_check.BOXES   # two cells to train: the CAT stage keeps its time
    store_cells(sweep, s.results, sweep.cells[0].id)
    assert fill_boxes(s) == 1.0 and s.boxes == gpu_check.BOXES   # one still missing
    store_cells(sweep, s.results, sweep.cells[1].id)
    factor = fill_boxes(s)
    others = sum(v for k, v in gpu_check.BOXES.items() if k != "tests")
    assert factor == pytest.approx(1 + (480 - gpu_check.RESERVE - sum(gpu_check.BOXES.values())) / others)
    assert sum(s.boxes.values()) == pytest.approx(480 - gpu_check.RESERVE)
    assert s.boxes["tests"] == gpu_check.BOXES["tests"]
    assert all(s.boxes[k] == pytest.approx(v * factor) for k, v in gpu_check.BOXES.items() if k != "tests")
    # a stage switched off stays off; a deadline the boxes already fill leaves them as they are
    s = settings(boxes={**gpu_check.BOXES, "ab": 0.0})
    assert fill_boxes(s) > 1.0 and s.boxes["ab"] == 0.0
    s = settings(seconds=200.0)
    assert fill_boxes(s) == 1.0 and s.boxes == gpu_check.BOXES
    # the summary says so
    s = settings()
    driver = Driver(s)
    driver.grown = fill_boxes(s)
    driver.finish()
    assert f"boxes grew {factor:.2f}x" in (tmp_path / "summary.txt").read_text()


def test_throughput_stage_is_tiny_and_stores_each_setting_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from posattn.bench.throughput import RECIPE

    monkeypatch.setenv("POSATTN_NATIVE", "0")  # the spawned workers need not wait for the fused kernels' build

    s = Settings.from_env(tmp_path, {"GPU_CHECK_TINY": "1", "GPU_CHECK_DEVICE": "cpu",
                                     "POSATTN_RESULTS": str(tmp_path / "results")})
    assert s.throughput_cells == ["smallest"] and s.throughput_settings == [(1, None), (2, None)]
    stages = list(gpu_check.STAGES)
    assert stages.index("models") < stages.index("throughput") == stages.index("cat") - 1
    # every box fits the deadline, and the CAT cells keep enough of it to start (a compare start-up,
    # a minute of training and the hand-over) even when every box is spent
    spare = Settings(out=tmp_path).seconds - gpu_check.RESERVE - sum(Settings(out=tmp_path).boxes.values())
    assert spare >= gpu_check.PUBLISH + 70 + 10
    assert throughput_left(s) == "2 settings left"
    throughput_stage(s, tmp_path / "throughput.json")
    records = store.load(RECIPE, s.results, kind="cell")
    assert sorted((r["result"]["workers"], r["result"]["mode"]) for r in records) == [(1, "eager"), (2, "eager")]
    assert all(r["result"]["recipe"] == "cat_fair_mqar" and r["result"]["steps"] == 3 for r in records)
    assert len(json.loads((tmp_path / "throughput.json").read_text())) == 2
    assert throughput_left(s) == "every setting in the store"


def test_profile_stage_stores_each_setup_once_and_reports_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from posattn.bench.records import report
    from posattn.bench.store import PROFILE_RECIPE

    pytest.importorskip("transformers")
    assert Settings.from_env(tmp_path, {"GPU_CHECK_TINY": "1"}).profile_shape == (64, 2)
    s = tiny(tmp_path, profile_shape=(64, 2))
    todo = gpu_check.profile_todo(s)
    # t5 is the only PROFILE_LAYER mechanism of tiny()'s two; the encoder and BERT, then the t5 encoder
    assert [(bench, names) for bench, _, names in todo] == [
        ("layer", ["t5"]), ("model", ["posattn_encoder", "hf_bert"]), ("model", ['["posattn_encoder", ["t5"]]'])]
    gpu_check.profile_stage(s)
    records = store.load(PROFILE_RECIPE, s.results, kind="cell")
    cases = sorted((r["result"]["bench"], r["result"]["case"]) for r in records)
    assert cases == [("layer", "sdpa"), ("layer", "t5"), ("model", "hf_bert"), ("model", "posattn_encoder"),
                     ("model", "posattn_encoder(t5)")]
    for r in records:
        prof = r["result"]["row"]["profile"]
        assert prof["clock"] == "cpu self time" and prof["total_ms"] > 0 and prof["kernels"] == []
        assert 0.99 <= sum(e["share"] for e in prof["ops"]) <= 1.01  # the top entries and "other"
        assert "--profile" in r["provenance"]["command"]
    assert gpu_check.profile_todo(s) == []

    measured: list[object] = []
    monkeypatch.setattr(bench_run, "run", lambda opts, **kw: measured.append(opts) or [])
    gpu_check.profile_stage(s)
    assert measured == []  # every setup is in the store
    text = report(PROFILE_RECIPE, {"bench": "profile"}, s.results, None)
    assert "one attention block, n 64, batch 2" in text and "whole models, 2 layers" in text
    assert "t5 [path dense, step" in text and "one training step" in text and "ops: " in text


def test_a_step_the_profiler_cannot_record_is_not_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from posattn.bench.store import PROFILE_RECIPE

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(bench_run, "step_profile", broken)
    s = tiny(tmp_path, profile_shape=(64, 2), mechanisms=["t5", "dynamic_conv"])
    monkeypatch.setattr(gpu_check, "PROFILE_MODELS", [])
    gpu_check.profile_stage(s)
    assert store.load(PROFILE_RECIPE, s.results, kind="cell") == []
    assert [names for _, _, names in gpu_check.profile_todo(s)] == [["t5"], ["dynamic_conv"]]  # tried again next time


def test_ab_stage_times_both_arms_in_one_run_and_stores_each_once(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    s = tiny(tmp_path, mechanisms=["dynamic_conv", "t5"])
    runs = gpu_check.ab_todo(s)
    assert [(z.max_len, z.batch, z.dropout, mechs, ab) for z, mechs, ab in runs] == [
        (32, 2, 0.0, ["t5"], {"flex_tma": True}),
        (32, 2, 0.1, ["dynamic_conv"], {"relative_bias": "gather"}),
        (32, 2, 0.0, ["dynamic_conv"], {"use_flex": False, "relative_bias": "skew"})]
    gpu_check.ab_stage(s, tmp_path / "rows.json")
    assert store.load(LAYER_RECIPE, s.results, kind="cell") == []   # its own recipe: both arms of a run together
    records = [r["result"] for r in store.load(AB_RECIPE, s.results, kind="cell")]
    assert sorted((r["case"], r["dropout"]) for r in records) == sorted([
        ("dynamic_conv", 0.0), ("dynamic_conv", 0.1), ("dynamic_conv [relative_bias=gather]", 0.1),
        ("dynamic_conv [use_flex=False,relative_bias=skew]", 0.0),
        ("sdpa", 0.0), ("sdpa", 0.1), ("t5", 0.0), ("t5 [flex_tma=True]", 0.0)])
    for res in records:
        assert res["row"]["train_ratio"] > 0
        if res["dropout"] and res["case"] != "sdpa":  # attention dropout: the dense bias, where skew applies
            assert res["row"]["path"].startswith("dense")
    assert gpu_check.ab_todo(s) == []
    from posattn.bench.records import report

    text = report(AB_RECIPE, {"bench": "layer"}, s.results, None)
    table = text.split("dropout 0.1)")[1].split("Provenance")[0]   # both arms of the run in one table
    assert "\ndynamic_conv " in table and "\ndynamic_conv [relative_bias=gather] " in table
    assert "Setups of the grid still missing" not in text
    measured: list[object] = []
    monkeypatch.setattr(bench_run, "run", lambda opts, **kw: measured.append(opts) or [])
    gpu_check.ab_stage(s, tmp_path / "rows.json")
    assert measured == []


def test_tests_stage_spreads_over_processes_where_xdist_is_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    for present in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, present=present: (object() if present else None) if name == "xdist"
                            else real(name, *a))
        cmd = gpu_check.pytest_command(["tests/core/test_cuda.py"])
        assert cmd[:4] == [sys.executable, "-m", "pytest", "tests/core/test_cuda.py"]
        assert ("-n" in cmd) == present


def test_tests_stage_log_ends_with_the_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest.log says how many CUDA tests passed, failed and skipped (the project's addopts are
    already quiet; one more -q dropped that line from the GPU windows' logs)."""
    import importlib.util
    import re
    import subprocess

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xdist" else real(name, *a))
    cmd = gpu_check.pytest_command(["tests/core/test_cuda.py"])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert re.search(r"\d+ (passed|skipped|failed)", out.stdout.strip().splitlines()[-1]), out.stdout[-500:]


def test_models_stage_runs_whole_model_ab_runs_into_their_own_recipe(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """After its grid the models stage times whole models under a fast-path alternative beside the
    default (``posattn bench --models --ab``), Hugging Face's models once: both arms and BERT in
    ``gpu_model_ab``, each ratio from that run; an arm that fails on this device (cuDNN's kernel on
    a CPU) stores nothing and stays in the ledger."""
    from posattn.bench import attempts
    from posattn.bench.records import report
    from posattn.bench.store import MODEL_AB_RECIPE, MODEL_RECIPE

    pytest.importorskip("transformers")
    monkeypatch.setattr(gpu_check, "model_todo", lambda s, hw=None: [])   # the grid: elsewhere
    # a run whose mechanisms are not all in GPU_CHECK_MECHANISMS is left out (the CAT encoder's)
    assert [ab for _, ab in gpu_check.model_ab_todo(tiny(tmp_path, mechanisms=["alibi"]))] == [{"split_qkv": True}]
    monkeypatch.setattr(gpu_check, "MODEL_AB_RUNS", [
        ([model_name("posattn_encoder"), "hf_bert"], {"split_qkv": True}),
        ([model_name("posattn_encoder"), model_name("posattn_encoder", ["alibi"])], {"sdpa_backend": "cudnn"})])
    s = tiny(tmp_path, mechanisms=["alibi"])
    assert [ab for _, ab in gpu_check.model_ab_todo(s)] == [{"split_qkv": True}, {"sdpa_backend": "cudnn"}]
    gpu_check.model_stage(s, tmp_path / "models.json")
    assert store.load(MODEL_RECIPE, s.results, kind="cell") == []
    rows = {r["result"]["case"]: r["result"]["row"] for r in store.load(MODEL_AB_RECIPE, s.results, kind="cell")}
    # the cuDNN run's A arm is stored, its B arm failed
    assert set(rows) == {"posattn_encoder", "hf_bert", "posattn_encoder [split_qkv=True]", "posattn_encoder(alibi)"}
    arm = rows["posattn_encoder [split_qkv=True]"]
    assert arm["speed_vs_hf_bert"] > 0 and arm["vs_posattn_encoder"] > 0
    assert [ab for _, ab in gpu_check.model_ab_todo(s)] == [{"sdpa_backend": "cudnn"}]   # tried again next time
    assert [key for key in attempts.load(s.results)] == [
        'models: n=32 batch=2: posattn_encoder, ["posattn_encoder", ["alibi"]] --ab sdpa_backend=cudnn']
    text = report(MODEL_AB_RECIPE, {"bench": "model"}, s.results, None)
    assert "posattn_encoder [split_qkv=True]" in text and "hf_bert" in text


def test_the_sources_key_follows_the_sources_and_the_tests_named(tmp_path: Path) -> None:
    (tmp_path / "posattn" / "__pycache__").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    source = tmp_path / "posattn" / "a.py"
    source.write_text("x = 1\n")
    (tmp_path / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    key = gpu_check.sources_key(["tests/test_a.py"], tmp_path)
    (tmp_path / "tests" / "run.log").write_text("not a source")
    (tmp_path / "posattn" / "__pycache__" / "a.py").write_text("a cache")
    assert gpu_check.sources_key(["tests/test_a.py"], tmp_path) == key
    assert gpu_check.sources_key(["tests/test_b.py"], tmp_path) != key
    source.write_text("x = 2\n")
    assert gpu_check.sources_key(["tests/test_a.py"], tmp_path) != key


def test_the_cuda_tests_run_again_only_when_the_sources_changed(tmp_path: Path) -> None:
    """A pass is kept per GPU with its sources' key; the next window at the same sources skips the
    tests stage and gives its box to the next stage; GPU_CHECK_RETEST runs them again; a failure
    keeps nothing."""
    passing, failing = tmp_path / "test_ok.py", tmp_path / "test_bad.py"
    passing.write_text("def test_ok():\n    assert True\n")
    failing.write_text("def test_bad():\n    assert False\n")
    s = tiny(tmp_path, tests=[str(passing)])
    first = Driver(s)
    first.tests()
    assert first.results[-1].status == "done" and first.spare > 0
    hw = store.hardware("cpu")
    assert gpu_check.passes(s.results)[hw]["sources"] == gpu_check.sources_key(s.tests)
    with tarfile.open(tmp_path / gpu_check.ARCHIVE) as tar:
        assert tar.getnames() == [f"results/{gpu_check.PASSES}"]    # travels back with the records

    again = Driver(s)
    again.tests()
    assert again.results[-1].status == "skipped: passed before" and again.spare == s.boxes["tests"]
    assert "GPU_CHECK_RETEST" in (tmp_path / "summary.txt").read_text()
    assert Settings.from_env(tmp_path, {"GPU_CHECK_RETEST": "1"}).retest
    s.retest = True
    forced = Driver(s)
    forced.tests()
    assert forced.results[-1].status == "done"

    kept = gpu_check.passes(s.results)
    bad = tiny(tmp_path, tests=[str(failing)])
    failed = Driver(bad)
    failed.tests()
    assert failed.results[-1].status == "failed (exit 1)" and gpu_check.passes(s.results) == kept
    (s.results / gpu_check.PASSES).write_text("[1, 2]")
    with pytest.raises(PositionError, match="not a record of CUDA test passes"):
        gpu_check.passes(s.results)
