"""`posattn finetune` end to end on tiny checkpoints and GLUE files: report, resume, intermediate
tasks, and one error listing every problem of a bad config."""
import argparse
import json

import pytest

from posattn import cli
from posattn.experiments.config import ConfigError
from posattn.finetune import run as run_mod
from posattn.finetune import suite as suite_mod
from posattn.finetune.cli import register
from posattn.finetune.suite import load_config, validate_config
from posattn.finetune.tasks import TaskError

from .glue_files import write_glue
from .helpers import make_checkpoint


def finetune(*argv):
    parser = argparse.ArgumentParser(prog="posattn")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["finetune", *argv])
    args.func(args)


def test_registered_in_the_main_cli():
    assert "posattn.finetune.cli" in cli.AREAS


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    write_glue(root / "glue", n=24)
    a = make_checkpoint(root / "pretrain-abs", ["absolute"])
    b = make_checkpoint(root / "pretrain-rel", ["fixed_conv"], seed=1)
    return root, a, b


def test_glue_sweep_with_intermediate_tasks_report_and_resume(setup, monkeypatch):
    root, a, b = setup
    out = root / "out"
    finetune(str(a), str(b / "model"), "--tasks", "mnli", "rte", "stsb", "--seeds", "2", "--glue-dir",
             str(root / "glue"), "--out", str(out), "--no-progress", "--workers", "1")
    results = json.loads((out / "results.json").read_text())
    cells = results["cells"]
    assert len(cells) == 2 * 3 * 2 and {c["label"] for c in cells} == {"absolute", "fixed_conv"}
    by_id = {c["id"]: c for c in cells}
    for c in cells:
        if c["task"] in ("rte", "stsb"):     # initialised from the MNLI model of the same checkpoint and seed
            src = by_id[c["init_from"]]
            assert (src["task"], src["seed"], src["label"]) == ("mnli", c["seed"], c["label"])
        else:
            assert c["init_from"] is None
        assert c["sizes"]["train"] + c["sizes"]["valid"] == 24
    assert set(cells[0]["scores"]) in ({"m", "mm"}, {"test"})
    report = (out / "report.md").read_text()
    for text in ("| model | params | MNLI-m | MNLI-mm | RTE | STS-B | Avg |", "Median over seeds", "± ",
                 "initialised from the mnli model", "majority class", "sorted by length"):
        assert text in report
    assert (out / "scores.png").stat().st_size > 0 and (out / "suite_score.png").stat().st_size > 0

    def never(*args, **kwargs):
        raise AssertionError("a finished cell was trained again")

    monkeypatch.setattr("posattn.finetune.run.finetune", never)
    finetune(str(a), str(b), "--tasks", "mnli", "rte", "stsb", "--seeds", "2", "--glue-dir", str(root / "glue"),
             "--out", str(out), "--no-progress", "--workers", "1")
    assert json.loads((out / "results.json").read_text())["cells"] == cells

    gone = [c for c in cells if c["task"] == "stsb" or (c["task"] == "mnli" and c["seed"] == 1)]
    for c in gone:
        (out / "cells" / c["id"] / "result.json").unlink()
    finetune(str(a), str(b), "--tasks", "mnli", "rte", "stsb", "--seeds", "2", "--glue-dir", str(root / "glue"),
             "--out", str(out), "--report")
    partial = json.loads((out / "results.json").read_text())
    assert partial["cells_total"] == 12 and len(partial["cells"]) == 12 - len(gone) == 6
    report = (out / "report.md").read_text()
    assert "**Partial: 6 of 12 cells finished.**" in report and "(`stsb`): no finished cell yet" in report
    assert "| – | – |" in report          # STS-B's column, and Avg without a seed that has every column


def test_every_problem_of_a_config_in_one_error(setup, tmp_path):
    root, a, _ = setup
    dec = make_checkpoint(tmp_path / "dec", kind="decoder")
    raw = {"checkpoints": [str(a), str(dec), str(tmp_path / "missing")], "tasks": ["rte", "nope"], "seeds": -1,
           "training": {"lr": -1, "momentum": 0.9, "warmup": -5}, "task_training": {"rte": {"patience": 0}},
           "max_seq_len": 2, "colour": "red", "cell_store": 3, "intermediate": 3,
           "claims": [{"claim": "x", "paper": "y", "holds": ["absolute >> none"]}], "executor": {"gpus": 1}}
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    msg = str(err.value)
    for text in ("unknown key(s) colour; valid keys: name, checkpoints,", "tasks: unknown task 'nope'",
                 "seeds: must be a positive integer", "training: unknown key(s) momentum; valid keys: lr,",
                 "training.lr: must be greater than 0, got -1", "training.warmup: must be greater than or equal to 0",
                 "task_training.rte.patience: must be greater than or equal to 1, got 0",
                 "checkpoints[1]: ", "'decoder' checkpoint is not classification-capable",
                 "checkpoints[2]: ", "missing: not a posattn checkpoint", "max_seq_len: must be greater than or equal "
                 "to 4, got 2", "cell_store: must be a valid string, got 3",
                 "claims[0].holds: 'absolute >> none' is not 'A > B'", "executor: unknown key(s) gpus"):
        assert text in msg, text
    assert "Traceback" not in msg and "pydantic" not in msg


def test_problems_of_keys_together_in_one_error(setup):
    """Checks that read several keys run once those keys are valid, and are listed together."""
    root, a, b = setup
    raw = {"checkpoints": [str(a), {"path": str(b), "label": "fixed"}], "tasks": ["rte", "mnli"], "max_seq_len": 512,
           "intermediate": {"rte": "sst2"}, "task_training": {"qqqp": {"lr": 1e-4}}}
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    msg = str(err.value)
    for text in ("glue_dir: GLUE task(s) rte, mnli need glue_dir", "absolute cannot go beyond them (not inductive)",
                 "intermediate: rte <- sst2 needs both tasks in the suite", "task_training: unknown task 'qqqp'"):
        assert text in msg, text
    assert "fixed" not in msg          # fixed_conv is inductive: it may read longer inputs
    with pytest.raises(ConfigError, match="checkpoints: duplicate label"):
        validate_config({"checkpoints": [str(a), {"path": str(b), "label": "absolute"}], "tasks": ["sst2"],
                         "glue_dir": str(root / "glue")})
    with pytest.raises(ConfigError, match="checkpoints: no checkpoint: give CHECKPOINT folder"):
        validate_config({})


def test_inductive_models_may_read_longer_inputs(setup):
    root, _, b = setup
    suite = validate_config({"checkpoints": [str(b)], "tasks": ["rte"], "glue_dir": str(root / "glue"),
                             "max_seq_len": 256, "seeds": 1})
    assert [c.max_seq_len for c in suite.cells] == [256]


def test_default_config_is_the_offline_suite():
    raw = load_config(None)
    assert raw["name"] == "offline" and raw["tasks"] == ["offline"]
    assert set(suite_mod.builtin_configs()) >= {"offline", "glue"}


@pytest.mark.parametrize("name", suite_mod.builtin_configs())
def test_builtin_configs_are_valid(setup, name):
    root, a, _ = setup
    raw = load_config(name)
    raw.update(checkpoints=[str(a)], glue_dir=str(root / "glue"))
    suite = validate_config(raw)
    assert suite.cells and len({c.id for c in suite.cells}) == len(suite.cells)
    seeds = [c.seed for c in suite.cells]      # seed by seed: a stopped sweep has every row on its first seeds
    assert seeds == sorted(seeds) and len({(c.label, c.task) for c in suite.cells if c.seed == 0}) == \
        len({(c.label, c.task) for c in suite.cells})


def test_bad_task_file_fails_before_anything_is_written(setup, tmp_path):
    root, a, _ = setup
    glue = tmp_path / "glue"
    write_glue(glue, n=12)
    path = glue / "RTE" / "dev.tsv"
    path.write_text(path.read_text() + "99\tonly\tthree\n")
    with pytest.raises(TaskError, match=f"{path}:14: 3 tab-separated columns, expected 4"):
        finetune(str(a), "--tasks", "sst2", "rte", "--glue-dir", str(glue), "--out", str(tmp_path / "out"),
                 "--no-progress", "--workers", "1")
    assert not (tmp_path / "out").exists()


def test_sweeps_naming_one_cell_store_share_finished_cells(setup, tmp_path, monkeypatch):
    root, a, b = setup
    trained = []
    real = run_mod.finetune

    def counting(model, task, *args, **kwargs):
        trained.append(kwargs["description"])
        return real(model, task, *args, **kwargs)

    monkeypatch.setattr("posattn.finetune.run.finetune", counting)
    base = {"tasks": ["sst2"], "seeds": 1, "glue_dir": str(root / "glue"), "cell_store": str(tmp_path / "store")}
    for name, checkpoints in [("first", [a]), ("second", [a, b])]:
        config = tmp_path / f"{name}.yaml"
        config.write_text(json.dumps({**base, "name": name, "checkpoints": [str(c) for c in checkpoints]}))
        finetune("--config", str(config), "--out", str(tmp_path / name), "--no-progress", "--workers", "1")
    assert trained == ["absolute sst2 seed 0", "fixed_conv sst2 seed 0"]     # the second sweep reused a's cell
    second = json.loads((tmp_path / "second" / "results.json").read_text())["cells"]
    assert [c["label"] for c in second] == ["absolute", "fixed_conv"] and not (tmp_path / "second" / "cells").exists()
    # a report of the shared cells into a folder no sweep has written yet
    finetune("--config", str(tmp_path / "second.yaml"), "--out", str(tmp_path / "report"), "--report")
    assert json.loads((tmp_path / "report" / "results.json").read_text())["cells"] == second


def test_report_judges_the_configs_claims(setup, tmp_path):
    root, a, b = setup
    config = tmp_path / "claims.yaml"
    config.write_text(json.dumps({
        "name": "claims", "tasks": ["sst2"], "seeds": 2, "glue_dir": str(root / "glue"),
        "checkpoints": [str(a), str(b)],
        "claims": [{"claim": "relative beats absolute", "paper": "74.5 vs 71.1", "holds": ["fixed_conv > absolute"]},
                   {"claim": "a missing row", "paper": "-", "holds": ["tisa > absolute"]}]}))
    finetune("--config", str(config), "--out", str(tmp_path / "out"), "--no-progress", "--workers", "1")
    report = (tmp_path / "out" / "report.md").read_text()
    section = report.split("## The papers' claims")[1].split("##")[0]
    rows = [line for line in section.splitlines() if line.startswith("| relative") or line.startswith("| a missing")]
    assert len(rows) == 2 and "fixed_conv − absolute = " in rows[0]
    assert any(v in rows[0] for v in ("**reproduced**", "**not reproduced**", "**not distinguishable at this scale**"))
    assert "**not measured**" in rows[1] and "no row 'tisa'" in rows[1]
