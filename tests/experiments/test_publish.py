"""``posattn results add``: finished cells of every kind of run folder into the store, merged by id,
with provenance; unfinished cells counted; malformed files refused by name; histories dropped to fit."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

# tests/ is on sys.path (pytest's rootdir layout)
from finetune.helpers import make_checkpoint

from posattn import cli
from posattn.errors import PositionError
from posattn.experiments import publish, store
from posattn.experiments.publish import add_run
from posattn.finetune.suite import validate_config as finetune_config
from posattn.synthetic.compare import validate_config


def test_compare_cells_with_provenance_and_merge_by_id(swept: Path, tiny: dict, tmp_path: Path, capsys) -> None:
    results = tmp_path / "results"
    assert cli.main(["results", "add", str(swept), "--results", str(results)]) == 0
    assert "tiny: 4 cell(s) added, 0 already present, 0 unfinished" in capsys.readouterr().out
    ids = sorted(c.id for c in validate_config(tiny).cells)
    records = store.load("tiny", results, kind="cell")
    assert [r["id"] for r in records] == ids
    for r in records:
        assert r["result"] == json.loads((swept / "cells" / r["id"] / "result.json").read_text())
        assert r["provenance"]["command"] == f"posattn compare tiny.yaml --out {swept}"
        assert r["provenance"]["hardware"] == store.hardware() and len(r["provenance"]["date"]) == 10
    recipe = store.load("tiny", results, kind="recipe")[0]["result"]
    assert recipe["sweep"] == "compare" and recipe["cells_total"] == 4
    assert recipe["config"] == validate_config(tiny).config

    # two machines, each with one finished cell: both land, by id; the one already there is kept
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(swept, a)
    shutil.copytree(swept, b)
    shutil.rmtree(a / "cells" / ids[0])
    (b / "cells" / ids[1] / "result.json").unlink()
    merged = tmp_path / "merged"
    assert str(add_run(a, root=merged)) == "tiny: 3 cell(s) added, 0 already present, 1 unfinished"
    assert str(add_run(b, root=merged, hardware="another machine")) == \
        "tiny: 1 cell(s) added, 2 already present, 1 unfinished"
    assert str(add_run(swept, root=merged)) == "tiny: 0 cell(s) added, 4 already present, 0 unfinished"
    by_id = {r["id"]: r for r in store.load("tiny", merged, kind="cell")}
    assert sorted(by_id) == ids
    assert by_id[ids[0]]["provenance"]["hardware"] == "another machine"
    assert by_id[ids[1]]["provenance"]["hardware"] == store.hardware()


def test_a_cell_missing_a_test_length_is_unfinished(swept: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(swept, run)
    path = next((run / "cells").glob("*/result.json"))
    result = json.loads(path.read_text())
    del result["accuracy"]["16"]
    path.write_text(json.dumps(result))
    assert str(add_run(run, root=tmp_path / "results")) == "tiny: 3 cell(s) added, 0 already present, 1 unfinished"


def test_malformed_files_are_refused_naming_them(swept: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(swept, run)
    path = next((run / "cells").glob("*/result.json"))
    path.write_text("{not json")
    assert cli.main(["results", "add", str(run), "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not a readable JSON file" in err and "Traceback" not in err
    path.write_text(json.dumps({"id": path.parent.name}))
    with pytest.raises(PositionError, match=f"{path}: not a result record"):
        add_run(run, root=tmp_path / "results")
    with pytest.raises(PositionError, match="is not a run folder"):
        add_run(tmp_path, root=tmp_path / "results")
    assert not (tmp_path / "results" / "tiny").exists() or not list((tmp_path / "results" / "tiny").glob("[0-9a-f]*"))


def test_another_config_under_the_same_name_is_refused(swept: Path, tiny: dict, tmp_path: Path) -> None:
    results = tmp_path / "results"
    add_run(swept, root=results)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.yaml").write_text(yaml.safe_dump(validate_config({**tiny, "seeds": [5]}).config))
    with pytest.raises(PositionError, match="another compare config named 'tiny'.*--recipe"):
        add_run(other, root=results)
    assert str(add_run(other, "tiny_seed5", root=results)) == \
        "tiny_seed5: 0 cell(s) added, 0 already present, 2 unfinished"


def test_cells_of_another_config_left_in_the_folder_are_not_stored(swept: Path, tiny: dict, tmp_path: Path) -> None:
    """A folder whose config.yaml now holds another sweep keeps the old sweep's finished cells in
    cells/: they are none of the new config's cells, so none of them is stored under its name."""
    run = tmp_path / "run"
    shutil.copytree(swept, run)
    old = sorted(p.name for p in (run / "cells").iterdir())
    (run / "config.yaml").write_text(yaml.safe_dump(validate_config({**tiny, "name": "other", "seeds": [5]}).config))
    results = tmp_path / "results"
    assert str(add_run(run, root=results)) == (
        f"other: 0 cell(s) added, 0 already present, 2 unfinished; 4 finished cell(s) of another config than "
        f"the folder's config.yaml left out: {', '.join(old)}")
    assert store.load("other", results, kind="cell") == []


def test_history_is_dropped_when_a_record_would_be_too_big(swept: Path, tmp_path: Path, monkeypatch) -> None:
    cell = json.loads(next((swept / "cells").glob("*/result.json")).read_text())
    monkeypatch.setattr(store, "MAX_BYTES", len(json.dumps(cell)) + publish.HEADROOM + 1000)
    run = tmp_path / "run"
    shutil.copytree(swept, run)
    path = next((run / "cells").glob("*/result.json"))
    path.write_text(json.dumps({**cell, "history": cell["history"] * 1000}))
    added = add_run(run, root=tmp_path / "results")
    assert added.trimmed == [cell["id"]] and "per-step history dropped from 1 record(s)" in str(added)
    kept = store.load("tiny", tmp_path / "results", kind="cell")
    dropped = next(r["result"] for r in kept if r["id"] == cell["id"])
    assert "history" not in dropped and "history entries left out" in dropped["history_dropped"]
    assert dropped["accuracy"] == cell["accuracy"]


def test_finetune_suite_with_a_shared_cell_store(tmp_path: Path) -> None:
    """A suite folder whose cells live in a shared cell store: only this suite's finished cells are added,
    under the suite's labels; the rest count as unfinished."""
    ckpt = make_checkpoint(tmp_path / "pretrain-abs", ["absolute"])
    shared = tmp_path / "finetune-cells"
    suite = finetune_config({"name": "suite", "checkpoints": [{"path": str(ckpt), "label": "abs"}],
                             "tasks": ["word_order"], "seeds": 3, "cell_store": str(shared)})
    run = tmp_path / "finetune-suite"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(suite.config))
    for cell in suite.cells[:2]:      # two of three seeds finished; a cell of another suite beside them
        (shared / cell.id).mkdir(parents=True)
        (shared / cell.id / "result.json").write_text(json.dumps({"id": cell.id, "task": cell.task, "seed": cell.seed,
                                                                  "label": "old", "scores": {"test": {"score": 0.5}}}))
    (shared / "0123456789ab").mkdir()
    (shared / "0123456789ab" / "result.json").write_text(json.dumps({"id": "0123456789ab"}))
    added = add_run(run, root=tmp_path / "results")
    assert str(added) == "suite: 2 cell(s) added, 0 already present, 1 unfinished"
    records = store.load("suite", tmp_path / "results", kind="cell")
    assert sorted(r["id"] for r in records) == sorted(c.id for c in suite.cells[:2])
    assert {r["result"]["label"] for r in records} == {"abs"}
    assert records[0]["provenance"]["command"] == f"posattn finetune --config {run / 'config.yaml'} --out {run}"


def _pretrain_run(folder: Path, name: str, finished: bool, date: str | None = None) -> None:
    folder.mkdir(parents=True)
    (folder / "pretrain.json").write_text(json.dumps({"name": name, "steps": 10, "corpus_folder": "/x"}))
    (folder / "metrics.jsonl").write_text('{"step": 5, "loss": 3.0}\n{"step": 10, "valid_loss": 2.5}\n')
    if finished:
        result = {"name": name, "steps": 10, "valid_loss": 2.5, "device": "cpu", **({"finished": date} if date else {})}
        (folder / "result.json").write_text(json.dumps(result))


def test_pretraining_recipe_runs_are_cells(tmp_path: Path) -> None:
    recipe = tmp_path / "pretrain-mine"
    _pretrain_run(recipe / "abs", "mine/abs", True, date="2026-01-02T10:00:00")
    _pretrain_run(recipe / "rope", "mine/rope", False)
    assert str(add_run(recipe, root=tmp_path / "results")) == "mine: 1 cell(s) added, 0 already present, 1 unfinished"
    [record] = store.load("mine", tmp_path / "results", kind="cell")
    assert record["id"] == "abs" and record["provenance"]["date"] == "2026-01-02"
    assert record["result"]["history"][-1] == {"step": 10, "valid_loss": 2.5}
    assert record["result"]["config"]["name"] == "mine/abs"
    assert record["provenance"]["command"] == "posattn pretrain mine.yaml"


def test_table3_cells(tmp_path: Path) -> None:
    run = tmp_path / "table3"
    (run / "cells").mkdir(parents=True)
    protocol = "2 tasks (word_order, sst2), 1 seeds, ≤ 800 training ..."
    (run / "results.json").write_text(json.dumps({"model": "/models/minilm", "protocol": protocol, "cells": []}))
    cell = {"variant": "baseline", "task": "word_order", "seed": 0, "score": 0.6, "test": {"score": 0.6},
            "majority_baseline": 0.5, "training": {"lr": 1e-4, "epochs": 2}}
    (run / "cells" / "baseline-word_order-0.json").write_text(json.dumps(cell))
    added = add_run(run, root=tmp_path / "results")
    assert str(added) == "tisa_table3: 1 cell(s) added, 0 already present, 9 unfinished"   # 5 variants x 2 tasks
    [record] = store.load("tisa_table3", tmp_path / "results", kind="cell")
    assert record["id"] == "baseline-word_order-0" and record["result"] == cell
    assert record["provenance"]["command"] == ("posattn study table3 --tasks word_order sst2 --seeds 1 "
                                               f"--lr 0.0001 --epochs 2 --out {run}")


def test_results_list(swept: Path, tmp_path: Path, capsys) -> None:
    results = tmp_path / "results"
    assert cli.main(["results", "list", "--results", str(results)]) == 0
    assert "no recipe" in capsys.readouterr().out
    add_run(swept, root=results)
    assert cli.main(["results", "list", "--results", str(results)]) == 0
    assert "tiny" in (out := capsys.readouterr().out) and "compare" in out and "4/4 cells" in out


def _store_with(swept: Path, root: Path, keep: int) -> list[str]:
    """The store holding ``keep`` of the tiny sweep's four cells; returns the ids of the others."""
    add_run(swept, root=root)
    ids = sorted(p.stem for p in (root / "tiny").glob("*.json") if p.stem != store.RECIPE_ID)
    for cell_id in ids[keep:]:
        (root / "tiny" / f"{cell_id}.json").unlink()
    return ids[keep:]


def test_compare_store_trains_only_missing_cells_and_publishes_them(swept: Path, tiny: dict, tmp_path: Path,
                                                                    monkeypatch, capsys) -> None:
    from posattn.synthetic import compare

    root = tmp_path / "results"
    missing = _store_with(swept, root, keep=2)
    monkeypatch.setenv(store.ROOT_ENV, str(root))
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny))
    trained = []
    real = compare.train
    monkeypatch.setattr(compare, "train", lambda model, *a, **k: trained.append(model) or real(model, *a, **k))
    out = tmp_path / "run"
    assert cli.main(["compare", str(config), "--store", "--out", str(out), "--no-progress"]) == 0
    assert len(trained) == 2                               # the two cells the store lacked
    assert sorted(p.name for p in (out / "cells").iterdir()) == missing
    records = {r["id"]: r for r in store.load("tiny", root, kind="cell")}
    assert len(records) == 4 and "Partial" not in (out / "report.md").read_text()
    for cell_id in missing:                                # published with how they were made
        assert records[cell_id]["provenance"]["command"] == f"posattn compare {config} --store"
        assert records[cell_id]["result"] == json.loads((out / "cells" / cell_id / "result.json").read_text())
    assert f"results store: 2 cell(s) of this run added to {root}/tiny/, 4 of 4 cells there" in capsys.readouterr().out


def test_compare_store_publishes_each_cell_before_a_later_one_fails(swept: Path, tiny: dict, tmp_path: Path,
                                                                      monkeypatch) -> None:
    from posattn.synthetic import compare

    root = tmp_path / "results"
    _store_with(swept, root, keep=1)
    monkeypatch.setenv(store.ROOT_ENV, str(root))
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny))
    real, calls, seen = compare.train, [], []

    def train(model, *a, **k):
        calls.append(1)
        if len(calls) == 2:   # the first cell trained here is in the store by now
            seen.append(len(store.load("tiny", root, kind="cell")))
            raise RuntimeError("the machine went away")
        return real(model, *a, **k)

    monkeypatch.setattr(compare, "train", train)
    assert cli.main(["compare", str(config), "--store", "--out", str(tmp_path / "run"), "--no-progress"]) == 1
    assert seen == [2] and len(store.load("tiny", root, kind="cell")) == 2


def test_compare_store_refuses_another_config_under_the_name_before_training(swept: Path, tiny: dict,
                                                                             tmp_path: Path, monkeypatch,
                                                                             capsys) -> None:
    from posattn.synthetic import compare

    root = tmp_path / "results"
    add_run(swept, root=root)
    monkeypatch.setenv(store.ROOT_ENV, str(root))
    monkeypatch.setattr(compare, "train", lambda *a, **k: pytest.fail("trained despite the refusal"))
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({**tiny, "seeds": [5]}))
    assert cli.main(["compare", str(config), "--store", "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "another compare config named 'tiny'" in err and "without --store" in err
    assert len(store.load("tiny", root, kind="cell")) == 4
