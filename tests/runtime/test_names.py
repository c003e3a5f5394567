"""Names from configs cannot leave the output folder: compare's and fine-tuning's ``name`` and a
pretraining recipe's ``name`` and run ``label``s (each names a folder) are checked like file names."""
from __future__ import annotations

import pytest
import yaml

from posattn import cli
from posattn.errors import PositionError
from posattn.finetune.suite import validate_config as finetune_config
from posattn.pretrain.config import load as pretrain_recipe
from posattn.synthetic.compare import validate_config as compare_config

ESCAPE = "../../x"
REFUSED = f"name '{ESCAPE}' cannot name a file or folder"


def files_under(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_compare_refuses_a_name_that_leaves_the_output_folder(tmp_path, monkeypatch, capsys):
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({"name": ESCAPE, "models": [{"mechanisms": ["rope"], "layers": 1}],
                                      "training": {"steps": 1}}))
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    before = files_under(tmp_path)
    assert cli.main(["compare", str(config), "--no-progress"]) == 2      # default output runs/compare-<name>
    assert REFUSED in capsys.readouterr().err
    assert files_under(tmp_path) == before
    with pytest.raises(PositionError, match="name 'a/b' cannot name"):
        compare_config({"name": "a/b", "models": [{"mechanisms": ["rope"]}]})


def test_pretraining_recipes_refuse_names_and_labels_that_leave_the_output_folder():
    with pytest.raises(PositionError, match=f"config: {REFUSED}"):
        pretrain_recipe({"name": ESCAPE})
    with pytest.raises(PositionError, match=f"config: run label '{ESCAPE}' cannot name a file or folder"):
        pretrain_recipe({"name": "r", "runs": [{"label": "abs"}, {"label": ESCAPE, "mechanisms": ["rope"]}]})
    assert [label for label, _ in pretrain_recipe({"name": "r", "runs": [{"label": "abs"}]})[1]] == ["abs"]


def test_finetuning_refuses_a_name_that_leaves_the_output_folder():
    with pytest.raises(PositionError, match=REFUSED):
        finetune_config({"name": ESCAPE})
