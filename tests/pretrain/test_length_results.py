"""eval-lm rows in the results store: ``posattn results add`` keeps them as ``lengths`` records of the
pretraining recipe they evaluate, with the command that reproduces them; ``posattn report`` rebuilds
the perplexity-against-length table, its plots and the papers' claims from the store alone; the
documentation's results page shows those plots."""
from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest

from posattn import docs_gen
from posattn.cli import main
from posattn.experiments import store
from posattn.experiments.report import build
from posattn.pretrain.recipe import run_recipe
from posattn.pretrain.report import LENGTH_CLAIMS, length_claim_rows, length_rows

from .test_extrapolation_recipe import tiny_recipe


@pytest.fixture(scope="module")
def evaluated(corpus, tmp_path_factory) -> Path:
    """A tiny length_extrapolation recipe (rope, alibi) with eval-lm plain and with YaRN, all in a store."""
    root = tmp_path_factory.mktemp("lengths")
    run_recipe("length_extrapolation", tiny_recipe(corpus, ["rope", "alibi"]), root / "recipe", progress=False)
    for out, extra in (("eval", []), ("eval-yarn", ["--rope-scaling", "yarn"])):
        models = [str(root / "recipe")] if not extra else [str(root / "recipe" / "rope")]
        assert main(["eval-lm", *models, "--multipliers", "1", "2", "4", "--tokens", "256", "--out",
                     str(root / out), "--no-progress", *extra]) == 0
    return root


def test_rows_enter_the_store_once_each_with_a_command_that_reproduces_them(evaluated, tmp_path, capsys):
    results = tmp_path / "results"
    assert main(["results", "add", str(evaluated / "recipe"), "--results", str(results)]) == 0
    assert main(["results", "add", str(evaluated / "eval"), "--results", str(results)]) == 0
    assert "length_extrapolation: 2 cell(s) added, 0 already present, 0 unfinished" in capsys.readouterr().out
    # the YaRN folder repeats the plain rope row: the same settings, the same record
    assert main(["results", "add", str(evaluated / "eval-yarn"), "--results", str(results)]) == 0
    assert "length_extrapolation: 1 cell(s) added, 1 already present, 0 unfinished" in capsys.readouterr().out
    records = store.load("length_extrapolation", results, kind="lengths")
    assert sorted(r["result"]["label"] for r in records) == ["alibi", "rope", "rope + yarn"]
    recipe = store.load("length_extrapolation", results, kind="recipe")[0]["result"]
    assert recipe["sweep"] == "pretrain" and recipe["cells_total"] == 9   # eval-lm rows leave it as it is
    yarn = next(r for r in records if r["result"]["label"] == "rope + yarn")
    command = yarn["provenance"]["command"]
    assert command.startswith("posattn eval-lm ") and "--rope-scaling yarn" in command
    assert yarn["provenance"]["hardware"] == store.hardware("cpu")
    # the recorded command, run again, gives the same numbers
    again = tmp_path / "again"
    argv = shlex.split(command)[1:]
    argv[argv.index("--out") + 1] = str(again)
    assert main([*argv, "--no-progress"]) == 0
    rerun = {r["label"]: r for r in json.loads((again / "lengths.json").read_text())}
    assert rerun["rope + yarn"]["valid_loss"] == pytest.approx(yarn["result"]["valid_loss"], rel=1e-6)


def test_report_rebuilds_table_plots_and_claims_from_the_store(evaluated, tmp_path):
    results = tmp_path / "results"
    for folder in ("recipe", "eval", "eval-yarn"):
        assert main(["results", "add", str(evaluated / folder), "--results", str(results)]) == 0
    got, text = build("length_extrapolation", results, out=tmp_path / "report")
    assert "**Partial: 2 of 9 runs finished.**" in text
    assert "## Held-out perplexity against evaluation length" in text
    assert "| model | 16 | 32 | 64 |" in text and "| rope + yarn |" in text
    section = text.split("## Held-out perplexity against evaluation length")[1]
    table = [line for line in section.splitlines() if line.startswith(("| rope |", "| alibi |", "| rope + yarn |"))]
    assert [line.split(" |")[0] for line in table] == ["| rope", "| rope + yarn", "| alibi"]  # recipe order
    for name in ("perplexity_vs_length.png", "perplexity_vs_length_rope_scaling.png"):
        assert f"]({name})" in text and (tmp_path / "report" / name).stat().st_size > 1000
    for claim in LENGTH_CLAIMS:
        assert claim["claim"] in text
    assert "- `posattn eval-lm " in text   # the commands that made the rows
    rows = json.loads((tmp_path / "report" / "lengths.json").read_text())
    assert all(math.isfinite(v) for r in rows for v in r["valid_perplexity"].values())
    # the documentation page carries the plots it links, under the recipe's name
    figures: dict[str, bytes] = {}
    page = docs_gen.results_pages(str(results), figures)["length_extrapolation"]
    assert "](length_extrapolation/perplexity_vs_length.png)" in page
    assert figures["results/length_extrapolation/perplexity_vs_length.png"].startswith(b"\x89PNG")


def test_block_losses_make_up_the_score(evaluated):
    for r in json.loads((evaluated / "eval" / "lengths.json").read_text()):
        for n, blocks in r["block_losses"].items():
            assert len(blocks) == min(8, 256 // int(n))
            assert sum(blocks) / len(blocks) == pytest.approx(r["valid_loss"][n], rel=1e-6)


def _row(label: str, losses: dict[str, list[float]], scaling: str | None = None) -> dict:
    return {"label": label, "kind": "decoder", "train_length": 64, "rope_scaling": scaling, "skipped": {},
            "valid_loss": {n: sum(v) / len(v) for n, v in losses.items()},
            "valid_perplexity": {n: math.exp(sum(v) / len(v)) for n, v in losses.items()},
            "block_losses": losses}


def test_claims_are_judged_on_paired_block_differences():
    """The blocks' own spread (text difficulty) is shared by every model and cancels: a constant
    0.1-nat advantage holds although the blocks differ by far more; the reverse contradicts it."""
    text = [3.0, 5.0, 4.0, 6.0, 3.5, 5.5, 4.5, 2.5]
    jitter = [0.01, -0.01, 0.02, -0.02, 0.0, 0.01, -0.01, 0.0]
    better = [t + j for t, j in zip(text, jitter)]
    worse = [t + 0.1 for t in text]
    verdicts = {r[0].split(" (")[0]: r[3] for r in length_claim_rows(
        [_row("alibi", {"64": better, "128": better}), _row("rope", {"64": worse, "128": worse})])}
    assert verdicts["ALiBi extrapolates beyond its training length where rotary does not"] == "**reproduced**"
    assert verdicts["FIRE generalizes to longer contexts better than RoPE, ALiBi and KERPLE"] == "**not measured**"
    verdicts = {r[0].split(" (")[0]: r[3] for r in length_claim_rows(
        [_row("alibi", {"128": worse}), _row("rope", {"128": better})])}
    assert verdicts["ALiBi extrapolates beyond its training length where rotary does not"] == "**not reproduced**"
    noisy = [t + (0.3 if i % 2 else -0.3) for i, t in enumerate(text)]
    verdicts = {r[0].split(" (")[0]: r[3] for r in length_claim_rows(
        [_row("alibi", {"128": noisy}), _row("rope", {"128": text})])}
    assert verdicts["ALiBi extrapolates beyond its training length where rotary does not"] == \
        "**not distinguishable at this scale**"


def test_rows_of_one_label_merge_and_follow_the_recipe_order():
    a = _row("rope", {"64": [1.0, 2.0]})
    b = _row("rope", {"64": [9.0, 9.0], "128": [3.0, 4.0]})
    c = _row("rope + yarn", {"128": [2.0, 2.0]}, "yarn")
    rows = length_rows([c, _row("alibi", {"64": [1.0, 1.0]}), b, a], ["none", "rope", "alibi"])
    assert [r["label"] for r in rows] == ["rope", "rope + yarn", "alibi"]
    assert rows[0]["block_losses"] == {"64": [9.0, 9.0], "128": [3.0, 4.0]}   # the first record of a length kept


def test_a_fixed_factor_row_is_labelled_apart_from_the_per_length_one(evaluated, tmp_path):
    """``--factor`` gives another row than the per-length factor, so its label differs and the two
    never merge in the report."""
    rope = str(evaluated / "recipe" / "rope")
    assert main(["eval-lm", rope, "--rope-scaling", "dynamic", "--factor", "2", "--lengths", "16", "32",
                 "--tokens", "256", "--out", str(tmp_path / "fixed"), "--no-progress"]) == 0
    rows = json.loads((tmp_path / "fixed" / "lengths.json").read_text())
    assert [r["label"] for r in rows] == ["rope", "rope + dynamic (factor 2)"]
    assert rows[1]["factor"] == {"16": 2.0, "32": 2.0} and rows[1]["fixed_factor"] == 2.0
