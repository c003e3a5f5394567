"""``posattn compare``: config validation, the sweep, its outputs, resuming, workers, the CLI."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from posattn import cli
from posattn.experiments.config import ConfigError
from posattn.experiments.executors import LocalExecutor
from posattn.synthetic import compare
from posattn.synthetic.compare import builtin_configs, load_config, run_sweep, validate_config

TINY = {
    "name": "tiny", "task": "mqar", "task_params": {"num_kv_pairs": 2}, "vocab_size": 16, "train_length": 16,
    "test_multipliers": [1, 2], "max_len": 64, "examples": {"train": 300, "valid": 40, "test": 40}, "d_model": [16, 32],
    "models": [{"mechanisms": ["cat"], "layers": 1},
               {"mechanisms": ["absolute"], "layers": 1, "max_len": 16}],
    "training": {"steps": 12, "batch_size": 16, "lr": [3e-3, 1e-2], "eval_every": 6},
}
REQUIRED = {"task", "mechanisms", "layers", "d_model", "train_length", "accuracy"}


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny sweep run once through the command line."""
    out = tmp_path_factory.mktemp("sweep")
    config = out / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    assert cli.main(["compare", str(config), "--out", str(out), "--no-progress"]) == 0
    return out


def test_results_json_has_every_cell(swept: Path) -> None:
    results = json.loads((swept / "results.json").read_text())
    cells = results["cells"]
    assert len(cells) == 2 * 2 * 2   # models x widths x learning rates
    for cell in cells:
        assert REQUIRED <= set(cell)
        assert cell["task"] == "mqar" and cell["train_length"] == 16
        assert set(cell["accuracy"]) == {"16", "32"}
        assert 0.0 <= cell["accuracy"]["16"] <= 1.0
    absolute = [c for c in cells if c["mechanisms"] == ["absolute"]]
    assert all(c["accuracy"]["32"] is None and "max_len" in c["not_applicable"]["32"] for c in absolute)
    selected = [c for c in cells if c["selected"]]
    assert len(selected) == 4   # one learning rate per (model, width)


def test_report_and_plots(swept: Path) -> None:
    report = (swept / "report.md").read_text()
    for d in (16, 32):
        assert f"## Accuracy vs test length (trained at 16, d_model {d})" in report
        assert (swept / f"accuracy_vs_length_L16_d{d}.png").stat().st_size > 1000
    assert "## Accuracy vs width (trained and tested at 16)" in report
    assert "| model | params | lr | steps | train s | 16 (train) | 32 |" in report
    assert "| cat (1L) |" in report and "| absolute (1L) |" in report
    assert "| n/a |" in report and "## Not applicable" in report
    assert "| model | d=16 | d=32 |" in report
    assert (swept / "accuracy_vs_width_L16.png").stat().st_size > 1000


def test_finished_cells_are_not_rerun(swept: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a finished cell was trained again")

    monkeypatch.setattr(compare, "train", refuse)
    before = json.loads((swept / "results.json").read_text())["cells"]
    # more test lengths: the saved models are only evaluated at the new one
    results = run_sweep(validate_config({**TINY, "test_multipliers": [1, 2, 3]}), swept, progress=False)
    assert [r["accuracy"]["16"] for r in results] == [r["accuracy"]["16"] for r in before]
    assert all("48" in r["accuracy"] for r in results)


def test_report_of_the_cells_finished_so_far(swept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("--report trained a cell")

    monkeypatch.setattr(compare, "train", refuse)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "out"
    assert cli.main(["compare", str(config), "--out", str(out), "--report"]) == 2
    assert "no finished cells" in capsys.readouterr().err
    sweep = validate_config(TINY)
    gone = next(c for c in sweep.cells if c.label == "cat (1L)" and c.d_model == 16 and c.training["lr"] == 1e-2)
    for cell in sweep.cells:
        if cell is not gone:
            (out / "cells" / cell.id).mkdir(parents=True)
            result = (swept / "cells" / cell.id / "result.json").read_text()
            (out / "cells" / cell.id / "result.json").write_text(result)
    assert cli.main(["compare", str(config), "--out", str(out), "--report", "--no-progress"]) == 0
    report = (out / "report.md").read_text()
    assert "**Partial: 7 of 8 cells finished.**" in report
    assert re.search(r"\| cat \(1L\) \| [0-9.]+ \| – \|", report)     # the lr grid marks the missing cell
    results = json.loads((out / "results.json").read_text())
    assert results["cells_total"] == 8 and len(results["cells"]) == 7
    assert "Partial" not in (swept / "report.md").read_text()


def test_interrupted_sweep_resumes_only_missing_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = {**TINY, "d_model": 16, "training": {**TINY["training"], "lr": 1e-2}}
    sweep = validate_config(config)
    run_sweep(sweep, tmp_path, progress=False)
    first = json.loads((tmp_path / "results.json").read_text())["cells"]
    (tmp_path / "cells" / sweep.cells[1].id / "result.json").unlink()
    trained = []
    real_train = compare.train
    monkeypatch.setattr(compare, "train", lambda model, *a, **k: trained.append(model) or real_train(model, *a, **k))
    again = run_sweep(sweep, tmp_path, progress=False)
    assert len(trained) == 1
    assert [r["accuracy"] for r in again] == [r["accuracy"] for r in first]   # deterministic retraining


def test_workers_give_the_same_results(swept: Path, tmp_path: Path) -> None:
    config = {**TINY, "d_model": 16, "training": {**TINY["training"], "lr": 1e-2}}
    results = run_sweep(validate_config(config), tmp_path, LocalExecutor(2, threads=1), progress=False)
    serial = {c["id"]: c["accuracy"] for c in json.loads((swept / "results.json").read_text())["cells"]}
    assert all(serial[r["id"]][n] == r["accuracy"][n] for r in results for n in ("16", "32"))


@pytest.mark.parametrize("change,messages", [
    ({"task": "recall"}, ["task: must be 'mqar', 'mqnar', 'ar', 'nar' or 'selective_copy', got 'recall'"]),
    ({"models": [{"mechanisms": ["rotary"]}]}, ["models[0].mechanisms[0]: unknown mechanism 'rotary'",
                                                "valid mechanisms:", "rope"]),
    ({"models": [{"mechanisms": [{"name": "tisa", "kernels": 3}]}]}, ["models[0]", "tisa", "valid options"]),
    ({"optimizer": "sgd", "training": {"epochs": 3}}, ["unknown key(s) optimizer; valid keys: name, task,",
                                                      "training: unknown key(s) epochs; valid keys: steps"]),
    ({"task_params": {"pairs": 3}}, ["task_params: the options of mqar are num_kv_pairs, power_a, random_filler, "
                                     "kv_density; got {'pairs': 3}"]),
    ({"task": "selective_copy"}, ["task_params: the options of selective_copy are num_tokens"]),
    ({"task_params": {"num_kv_pairs": 2, "kv_density": 0.1}}, ["give num_kv_pairs or kv_density, not both"]),
    ({"task_params": {"num_kv_pairs": 5}}, ["task mqar at length 16", "too short"]),
    ({"task_params": {"num_kv_pairs": 8}, "train_length": 64}, ["only 7 exist", "raise vocab_size",
                                                                "models[1]: max_len 16 is shorter than the training "
                                                                "length 64"]),
    ({"d_model": 30, "n_heads": 4}, ["not divisible"]),
    ({"test_lengths": [16], "test_multipliers": [1]}, ["not both"]),
    ({"models": []}, ["models: must not be empty"]),
    ({"models": [{"mechanisms": ["cat"]}, {"mechanisms": ["cat"], "layers": 2}]},
     ["models: duplicate row label(s) cat (2L)"]),
    ({"claims": [{"claim": "c", "paper": "p", "holds": ["cat (1L) >> x", "cat (1L) > absolute (1L)"],
                  "at": {"d_model": 48, "length": "max"}}]},
     ["'cat (1L) >> x' is not", "d_model 48 is not one of the sweep's [16, 32]", "length must be an integer"]),
    ({"training": {"warmup": -5}}, ["training.warmup: must be greater than or equal to 0, got -5"]),
    ({"training": {"steps": 2.0, "lr": [1e-3, 0], "target_accuracy": 2}},
     ["training.steps: must be a valid integer, got 2.0", "training.lr[1]: must be greater than 0, got 0",
      "training.target_accuracy: must be less than or equal to 1, got 2"]),
])
def test_bad_config_gives_one_clear_error(change: dict, messages: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({**TINY, **change})
    for message in messages:
        assert message in str(info.value)


def test_bad_config_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**TINY, "task": "sorting"}))
    assert cli.main(["compare", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "valid" not in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    assert cli.main(["compare", "no-such-config"]) == 2
    assert "built-in configs: " in capsys.readouterr().err


def test_help_documents_the_schema(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())        # wrapped lines joined
    for needle in ("Config schema", "task_params", "test_multipliers", "num_kv_pairs", "selective_copy",
                   "valid names: absolute,", "tisa", "target_accuracy", "warmup: number = 0.1", "--workers", "--out"):
        assert needle in text


def test_cells_run_seed_by_seed() -> None:
    cells = validate_config({**TINY, "seeds": [0, 1]}).cells
    first = cells[:len(cells) // 2]        # a sweep stopped half way has every model, width and lr on seed 0
    assert [c.training["seed"] for c in cells] == [0] * len(first) + [1] * len(first)
    assert {(c.label, c.d_model, c.training["lr"]) for c in first} == {(c.label, c.d_model, c.training["lr"])
                                                                        for c in cells}


def test_builtin_configs_are_valid() -> None:
    names = builtin_configs()
    assert "default" in names and len(names) >= 3
    for name in names:
        sweep = validate_config(load_config(name))
        assert sweep.cells and sweep.name == name
    default = validate_config(load_config(None))
    labels = {c.label for c in default.cells}
    assert "cat (1L)" in labels and {"rope (2L)", "alibi (2L)", "t5 (2L)", "tisa (2L)", "diet_rel (2L)"} <= labels


def test_selective_copy_sweep_validates() -> None:
    sweep = validate_config({**TINY, "task": "selective_copy", "task_params": {"num_tokens": 4}})
    assert {c.task_params["num_tokens"] for c in sweep.cells} == {4}


def test_dump_config_prints_yaml(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["compare", "--dump-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["task"] == "mqar"


def test_compile_option_reaches_every_cell(tmp_path: Path) -> None:
    """``posattn compare --compile dynamo``: each cell trains through the compiled step and ends with
    eager's history (the option is not part of a cell's id: the same cells, the same folders)."""
    config = {**TINY, "d_model": 16, "training": {**TINY["training"], "lr": 3e-3}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    eager = run_sweep(validate_config(dict(config)), tmp_path / "eager", progress=False)
    assert cli.main(["compare", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "fast"), "--compile", "dynamo",
                 "--no-progress"]) in (0, None)
    fast = json.loads((tmp_path / "fast" / "results.json").read_text())["cells"]
    assert sorted(c["id"] for c in fast) == sorted(c["id"] for c in eager)
    by_id = {c["id"]: c for c in eager}
    for cell in fast:
        want = by_id[cell["id"]]["history"]
        assert [r["valid_accuracy"] for r in cell["history"]] == [r["valid_accuracy"] for r in want]
        assert cell["history"][-1]["loss"] == pytest.approx(want[-1]["loss"], rel=1e-4)


def test_only_trains_the_named_models_and_the_rest_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    sweep = validate_config(TINY)
    labels = {cell.id: cell.label for cell in sweep.cells}
    assert sorted(set(labels.values())) == ["absolute (1L)", "cat (1L)"]
    trained: list[str] = []
    real = compare.train
    monkeypatch.setattr(compare, "train", lambda model, *a, **k: trained.append(1) or real(model, *a, **k))
    out = tmp_path / "run"
    assert cli.main(["compare", str(config), "--out", str(out), "--no-progress", "--only", "cat (1L)"]) == 0
    done = sorted(p.name for p in (out / "cells").iterdir())
    assert len(trained) == 4 and done == sorted(i for i, label in labels.items() if label == "cat (1L)")
    assert "Partial" in (out / "report.md").read_text()
    first = next(i for i, label in labels.items() if label == "absolute (1L)")
    assert cli.main(["compare", str(config), "--out", str(out), "--no-progress", "--only", first]) == 0
    assert len(trained) == 5   # one cell by its id; the finished ones are read back
    assert cli.main(["compare", str(config), "--out", str(out), "--no-progress"]) == 0
    assert len(trained) == 8 and "Partial" not in (out / "report.md").read_text()
    capsys.readouterr()
    assert cli.main(["compare", str(config), "--out", str(out), "--only", "rope (2L)"]) == 2
    err = capsys.readouterr().err
    assert "--only: no model or cell 'rope (2L)' in sweep 'tiny'" in err and "'cat (1L)', 'absolute (1L)'" in err


def test_the_store_records_the_only_option_in_the_command() -> None:
    from posattn.synthetic.cli import store_command

    args = cli.parser().parse_args(["compare", "cat_fair_ar_length", "--only", "cat (1L)", "--workers", "2"])
    assert store_command(args, "cat_fair_ar_length") == ("posattn compare cat_fair_ar_length --store --workers 2 "
                                                         "--only 'cat (1L)'")
