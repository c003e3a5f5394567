"""``posattn report RECIPE``: the sweep's own report rebuilt from the store plus local runs, the count of
missing cells, the other kinds of sweep through their report code, and the Markdown printout."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from posattn import cli
from posattn.errors import PositionError
from posattn.experiments import report, store
from posattn.experiments.publish import add_run
from posattn.experiments.report import build
from posattn.synthetic.compare import validate_config


def test_compare_report_from_the_store_is_the_sweeps_own(swept: Path, tmp_path: Path, capsys) -> None:
    results = tmp_path / "results"
    add_run(swept, root=results)
    out = tmp_path / "report"
    assert cli.main(["report", "tiny", "--results", str(results), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tiny: 4 of 4 cells present (0 missing)" in printed
    own, provenance = (out / "report.md").read_text().split("\n\n## Where the cells come from\n")
    assert own == (swept / "report.md").read_text().rstrip()       # the sweep's own report, then where from
    assert (f"| 4 | {store.provenance('x')['date']} | {store.hardware()} | `posattn compare tiny.yaml --out {swept}` |"
            in provenance)
    assert "## The paper's claims" in printed and "rope beats none" in printed
    ours, theirs = (json.loads((f / "results.json").read_text()) for f in (out, swept))
    key = sorted(theirs["cells"], key=lambda r: r["id"])
    assert sorted(ours["cells"], key=lambda r: r["id"]) == key and ours["cells_total"] == 4
    assert {p.name for p in out.glob("*.png")} == {p.name for p in swept.glob("*.png")}


def test_cells_are_counted_by_where_they_come_from(swept: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    add_run(swept, root=results, command="posattn compare tiny --device cuda", hardware="NVIDIA H100 80GB HBM3")
    paths = sorted(p for p in (results / "tiny").glob("*.json") if p.stem != store.RECIPE_ID)
    for path in paths[:3]:
        path.unlink()
    add_run(swept, root=results, command="posattn compare tiny --store", hardware="AMD EPYC, 2 cores")
    data = json.loads(paths[0].read_text())
    data["provenance"]["date"] = "2026-01-02"   # one of the CPU cells is older
    paths[0].write_text(json.dumps(data))
    paths[3].unlink()                            # and one cell only in a local run folder
    _, text = build("tiny", results, runs=[swept])
    rows = [line for line in text.split("## Where the cells come from")[1].splitlines() if line.startswith("| ")]
    today = store.provenance("x")["date"]
    assert rows == ["| cells | date | hardware | command |",    # most cells first
                    f"| 3 | 2026-01-02 to {today} | AMD EPYC, 2 cores | `posattn compare tiny --store` |",
                    "| 1 | – | a local run folder (not in the store) | – |"]


def test_missing_cells_are_counted_and_local_runs_fill_them(swept: Path, tiny: dict, tmp_path: Path) -> None:
    results = tmp_path / "results"
    add_run(swept, root=results)
    gone = sorted(p for p in (results / "tiny").glob("*.json") if p.stem != store.RECIPE_ID)[:3]
    for path in gone:
        path.unlink()
    got, text = build("tiny", results)
    assert got.counts() == "tiny: 1 of 4 cells present (3 missing)"
    assert "**Partial: 1 of 4 cells finished.**" in text
    got, text = build("tiny", results, runs=[swept])
    assert got.counts() == "tiny: 4 of 4 cells present (0 missing)" and "Partial" not in text
    other = tmp_path / "other"
    shutil.copytree(swept, other)
    config = validate_config({**tiny, "seeds": [7]}).config
    (other / "config.yaml").write_text(json.dumps(config))
    with pytest.raises(PositionError, match="is not the one of recipe 'tiny'"):
        build("tiny", results, runs=[other])


def test_a_recipe_that_is_nowhere_is_one_clear_error(swept: Path, tmp_path: Path, capsys) -> None:
    add_run(swept, root=tmp_path / "results")
    assert cli.main(["report", "absent", "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert "no recipe 'absent'" in err and "recipes there: tiny" in err and "Traceback" not in err
    assert cli.main(["report", "../x", "--results", str(tmp_path / "results")]) == 2
    assert "cannot name" in capsys.readouterr().err


def test_markdown_prints_the_tables_and_writes_nothing(swept: Path, tmp_path: Path, capsys,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    add_run(swept, root=tmp_path / "results")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", "tiny", "--results", "results", "--markdown"]) == 0
    captured = capsys.readouterr()
    assert captured.out.split("\n\n## Where the cells come from")[0] == (swept / "report.md").read_text().strip()
    assert "4 of 4 cells present" in captured.err
    assert not (tmp_path / "runs").exists()


def _finetune_cell(label: str, task: str, seed: int, score: float) -> dict:
    return {"id": f"{label}-{task}-{seed}", "label": label, "task": task, "seed": seed, "parameters": 1_000_000,
            "scores": {"test": {"score": score, "accuracy": score}}, "baseline": {"test": {"score": 0.5}},
            "sizes": {"train": 10, "valid": 5, "test:test": 5}, "notes": [], "truncated": {}, "max_seq_len": 64,
            "training": {"lr": 3e-4, "batch_size": 32, "epochs": 3}, "train_seconds": 2.0, "cpu_seconds": 2.0}


def test_finetune_report_from_records_judges_the_claims(tmp_path: Path) -> None:
    config = {"name": "suite", "tasks": ["word_order"], "seeds": [0, 1, 2], "intermediate": {},
              "checkpoints": [{"label": "a", "path": "/x/a"}, {"label": "b", "path": "/x/b"}],
              "claims": [{"claim": "a beats b", "paper": "-", "holds": ["a > b"]}]}
    prov = store.provenance("posattn finetune --config suite")
    store.publish("suite", store.RECIPE_ID, {"sweep": "finetune", "config": config, "cells_total": 6}, prov,
                  kind="recipe", root=tmp_path)
    for seed, (a, b) in enumerate([(0.80, 0.60), (0.82, 0.61), (0.81, 0.59)]):
        for label, score in (("a", a), ("b", b)):
            cell = _finetune_cell(label, "word_order", seed, score)
            store.publish("suite", cell["id"], cell, prov, root=tmp_path)
    got, text = build("suite", tmp_path, out=tmp_path / "out")
    assert got.counts() == "suite: 6 of 6 cells present (0 missing)"
    assert "| a | 1.00M | 81.0 ± 0.6 | 81.0 ± 0.6 |" in text
    assert "| a beats b | - | a − b = +21 ± 0.82: holds | **reproduced** |" in text
    assert (tmp_path / "out" / "scores.png").stat().st_size > 0


def test_pretraining_report_from_records(tmp_path: Path) -> None:
    prov = store.provenance("posattn pretrain mine")
    store.publish("mine", store.RECIPE_ID, {"sweep": "pretrain", "config": {"name": "mine", "labels": ["a", "b"]},
                                            "cells_total": 2}, prov, kind="recipe", root=tmp_path)
    run = {"label": "a", "objective": "mlm", "mechanisms": ["absolute"], "parameters": 1000, "steps": 10,
           "tokens": 5000, "valid_loss": 2.5, "valid_accuracy": 0.3, "tokens_per_s": 100.0, "train_seconds": 60,
           "history": [{"step": 5, "valid_loss": 3.0}, {"step": 10, "valid_loss": 2.5}]}
    store.publish("mine", "a", run, prov, root=tmp_path)
    got, text = build("mine", tmp_path, out=tmp_path / "out")
    assert got.counts() == "mine: 1 of 2 cells present (1 missing)"
    assert "**Partial: 1 of 2 runs finished.**" in text
    assert "| a | absolute | 1,000 | 10 | 5,000 | 2.500 | 0.300 |" in text
    assert "history" not in json.loads((tmp_path / "out" / "results.json").read_text())[0]
    assert (tmp_path / "out" / "valid_loss.png").stat().st_size > 0


def test_a_malformed_record_in_the_store_is_refused_naming_it(swept: Path, tmp_path: Path, capsys) -> None:
    results = tmp_path / "results"
    add_run(swept, root=results)
    path = next(p for p in (results / "tiny").glob("*.json") if p.stem != store.RECIPE_ID)
    path.write_text(path.read_text()[:-20])
    assert cli.main(["report", "tiny", "--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not a readable JSON file" in err and "Traceback" not in err
    path.write_text(json.dumps({"recipe": "tiny", "id": "other", "kind": "cell", "provenance": {}, "result": {}}))
    with pytest.raises(PositionError, match=f"{path} is not a store record"):
        build("tiny", results)


def test_table3_report_from_records(tmp_path: Path) -> None:
    run = tmp_path / "table3"
    (run / "cells").mkdir(parents=True)
    protocol = "1 tasks (word_order), 2 seeds, ≤ 800 training and ≤ 500 validation/test examples"
    (run / "results.json").write_text(json.dumps({"model": "/models/minilm", "protocol": protocol, "cells": []}))
    variants = (("baseline", "baseline", (0.60, 0.62)), ("supplement S=1", "supplement_S1", (0.5, 0.52)))
    for variant, name, scores in variants:
        for seed, score in enumerate(scores):
            cell = {"variant": variant, "task": "word_order", "seed": seed, "score": score, "test": {"score": score},
                    "majority_baseline": 0.5, "training": {"lr": 1e-4, "epochs": 2}}
            (run / "cells" / f"{name}-word_order-{seed}.json").write_text(json.dumps(cell))
    add_run(run, root=tmp_path / "results")
    got, text = build("tisa_table3", tmp_path / "results", out=tmp_path / "out")
    assert got.counts() == "tisa_table3: 4 of 10 cells present (6 missing)"
    assert "# TISA Table 3 on minilm" in text and "| baseline | 61.0 (61.0 ± 1.0) | 61.0 (61.0 ± 1.0) |" in text
    assert "| the gains are stable regardless of S (Table 3a) |" in text
    assert (tmp_path / "out" / "scores.png").stat().st_size > 0


def test_runs_given_different_cells_count_as_one_way_of_training(swept: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    add_run(swept, root=results, command="posattn compare tiny --store --only 0a1b 2c3d --device cpu",
            hardware="AMD EPYC, 2 cores")
    sorted(p for p in (results / "tiny").glob("*.json") if p.stem != store.RECIPE_ID)[0].unlink()
    add_run(swept, root=results, command="posattn compare tiny --store --only 'rope (1L)' --device cpu",
            hardware="AMD EPYC, 2 cores")   # a later run given other cells retrains the one gone
    _, text = build("tiny", results)
    section = text.split("## Where the cells come from")[1]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows[1:] == [f"| 4 | {store.provenance('x')['date']} | AMD EPYC, 2 cores | "
                        f"`posattn compare tiny --store --only {report.ONE_CELL} --device cpu` |"]
    assert f"`--only {report.ONE_CELL}` stands for the cells a run was given" in section
    assert report.one_cell_command("posattn compare tiny --store") == "posattn compare tiny --store"
    assert report.one_cell_command("posattn compare tiny --only 'a") == "posattn compare tiny --only 'a"
