"""Summary records: the README's measured tables regenerated from results/ as data, claims re-judged
where the per-seed scores are recorded, carried (and marked) where they are not."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from posattn import cli
from posattn.errors import PositionError
from posattn.experiments import store
from posattn.experiments.publish import add_run
from posattn.experiments.report import build
from posattn.experiments.summary import check

RESULTS = Path(__file__).resolve().parents[2] / "results"


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """A temporary copy of the repository's results/."""
    return Path(shutil.copytree(RESULTS, tmp_path / "results"))


def test_chang_table1_from_its_summary_data(results: Path, capsys) -> None:
    assert cli.main(["report", "chang_table1", "--results", str(results), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert ("| composite | 70.3 ± 0.3 | 73.0 ± 0.8 | 96.0 ± 0.2 | 86.8 ± 0.2 | 64.3 ± 0.4 | 50.1 ± 0.1 | 50.7 ± 0.4 "
            "| 50.0 ± 0.0 | 67.7 ± 0.1 (67.6) | 75.2 |") in out
    verdicts = [line.rsplit("|", 2)[1].strip() for line in out.splitlines() if line.startswith("| ") and "**" in line]
    assert verdicts == ["**not distinguishable at this scale**", "**reproduced**", "**reproduced**"]
    assert "fixed_conv − absolute = -0.482 ± 0.25: within noise" in out      # recomputed from the per-seed scores
    assert "Measured 2026-11-25 on" in out and "`posattn finetune --config chang_table1`" in out


def test_verdicts_follow_the_recorded_numbers(results: Path) -> None:
    path = results / "chang_table1" / "summary-cpu.json"
    record = json.loads(path.read_text())
    for row in record["result"]["rows"]:
        if row["label"] == "fixed_conv":
            row["seeds"] = [s + 2 for s in row["seeds"]]       # now clearly above absolute
    path.write_text(json.dumps(record))
    _, text = build("chang_table1", results)
    assert "fixed_conv − absolute = +1.52 ± 0.25: holds" in text
    assert "composite − fixed_conv = -1.38 ± 0.17: contradicted" in text
    assert "(recorded verdict: reproduced)" in text


def test_every_summary_recipe_renders_with_its_provenance(results: Path) -> None:
    names = store.recipes(results)
    assert {"chang_table1", "chang_table2", "chang_table3", "diet_tisa", "chang_mlm", "tisa_table3", "order_probe",
            "cat_fair_zoology_check", "cat_fair_ar_check"} <= set(names)
    for name in names:
        records = store.load(name, results, kind="summary")
        got, text = build(name, results)
        for r in records:
            check(r["result"], r["id"])
            assert r["result"]["title"] in text and r["provenance"]["command"] in text
        if not store.load(name, results, kind="cell") and not store.load(name, results, kind="recipe"):
            assert "no cells" in got.counts()                   # a recipe known only by its summaries
        elif not store.load(name, results, kind="cell"):        # a recipe whose cells are still to be trained
            assert f"0 of {got.total} cells present ({got.total} missing)" in got.counts()


def test_a_verdict_without_per_seed_scores_is_carried_and_marked(results: Path) -> None:
    _, text = build("tisa_table3", results)
    assert "(verdict as recorded: the per-seed scores it was judged on are not kept) | **not reproduced** |" in text
    assert "| as is | 80.0 (80.2 ± 0.3) |" in text       # median (mean ± s.e.), as the study reports it


def test_malformed_summary_data_is_refused_naming_the_file(results: Path) -> None:
    path = results / "chang_table1" / "summary-cpu.json"
    record = json.loads(path.read_text())
    record["result"]["rows"][0]["values"] = [1.0]
    path.write_text(json.dumps(record))
    with pytest.raises(PositionError, match=f"{path}: not valid summary data: rows"):
        build("chang_table1", results)



def test_summary_tables_stand_until_every_cell_is_rerun(swept: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    table = {"title": "tiny as measured before", "columns": ["8 (train)"], "digits": 3,
             "rows": [{"label": "rope (1L)", "values": [{"mean": 0.5, "sd": 0.1}]}]}
    store.publish("tiny", "summary-before", table, store.provenance("posattn compare tiny"), kind="summary",
                  root=results)
    assert "no cells" in build("tiny", results)[0].counts()
    add_run(swept, root=results)
    next(p for p in (results / "tiny").glob("*.json") if len(p.stem) == 12).unlink()
    got, text = build("tiny", results)
    assert got.counts() == "tiny: 3 of 4 cells present (1 missing)"
    assert "**Partial: 3 of 4 cells finished.**" in text and "## tiny as measured before" in text
    add_run(swept, root=results)
    got, text = build("tiny", results)
    assert got.counts() == "tiny: 4 of 4 cells present (0 missing)" and "as measured before" not in text
