"""``posattn study table3`` and ``posattn study closeness``: their options and their one-line errors."""
from __future__ import annotations

import pytest

from posattn.cli import main


@pytest.mark.parametrize("study, options", [
    ("table3", ["--model", "--tasks", "--seeds", "--max-train", "--max-eval", "--lr", "--epochs", "--out",
                "--workers"]),
    ("closeness", ["--model", "--kernels", "--positions", "--max-tokens", "--texts", "--out"]),
])
def test_help_lists_every_option(study, options, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["study", study, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: posattn study {study} ")
    assert all(o in text for o in options)


def test_study_needs_a_study(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["study"])
    assert exit_.value.code == 2 and "table3" in capsys.readouterr().err


@pytest.mark.parametrize("study", ["table3", "closeness"])
def test_a_missing_model_is_one_line_exit_2(study, tmp_path, capsys):
    pytest.importorskip("transformers")
    assert main(["study", study, "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posattn: error: ") and "nope" in err and err.count("\n") == 1
    assert not (tmp_path / "out" / "closeness.json").exists()
