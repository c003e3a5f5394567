"""``posattn bench-decode``: a tiny run writes its report with identical cached and recomputed tokens;
bad values are one-line errors."""
from __future__ import annotations

import json

import pytest

from posattn.cli import main


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench-decode", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: posattn bench-decode ")
    assert all(o in text for o in ["-n", "-m", "--new", "--d-model", "--layers", "--heads", "--device", "--out"])


def test_tiny_run_writes_report(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench-decode", "-n", "40", "-m", "none", "rope", "--new", "4", "--d-model", "16", "--layers", "1",
                 "--heads", "2", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads((out / "decode.json").read_text())
    assert [(r["mechanism"], r["n"]) for r in report["rows"]] == [("none", 40), ("rope", 40)]
    assert all(r["same_tokens"] for r in report["rows"]) and (out / "decode.png").exists()
    assert "rope" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [(["-n", "8", "--new", "16"], "--new"), (["-m", "nope"], "nope")])
def test_bad_values_are_one_line_exit_2(args, says, tmp_path, capsys):
    assert main(["bench-decode", *args, "--device", "cpu", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posattn: error: ") and says in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
