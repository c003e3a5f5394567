"""One grammar for every ``posattn`` command, checked by walking every parser: every option has help,
no help shows raw reST, options that several commands share are one definition (``--device``,
``--json``, ``--threads``, ``--workers``, ``--positions``), the config comes the same way in every
sweep command, and ``--version`` answers."""
from __future__ import annotations

import argparse
import re

import pytest

import posattn
from posattn import cli, options
from posattn.docs_gen import commands

REST = re.compile(r"``|:(mod|func|class|data|meth|attr):`")


ALL = commands(cli.parser())


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in parser._actions if flag in a.option_strings), None)


def test_the_walk_finds_every_command() -> None:
    names = {name for name, _ in ALL}
    for command in ("mechanisms", "compare", "pretrain", "finetune", "corpus", "eval-lm", "bench", "bench-decode",
                    "analyze toeplitz", "analyze kernels", "analyze order-probe", "results add", "report",
                    "study table3", "study closeness"):
        assert f"posattn {command}" in names


@pytest.mark.parametrize("name, parser", ALL, ids=[name for name, _ in ALL])
def test_every_option_has_help(name: str, parser: argparse.ArgumentParser) -> None:
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
               if not isinstance(a, argparse._SubParsersAction) and not a.help]
    assert not missing, f"{name}: options without help: {missing}"


@pytest.mark.parametrize("name, parser", ALL, ids=[name for name, _ in ALL])
def test_no_help_shows_raw_rest(name: str, parser: argparse.ArgumentParser) -> None:
    text = parser.format_help()
    assert not REST.search(text), f"{name} --help shows reST: {REST.search(text).group(0)!r}"


def test_shared_options_are_one_definition() -> None:
    devices = workers = jsons = threads = 0
    for name, parser in ALL:
        if (device := option(parser, "--device")) is not None:
            devices += 1
            assert device.type is options.device and device.default == "auto", name
            assert device.help == options.DEVICE_HELP, name
        if (flag := option(parser, "--json")) is not None:
            jsons += 1
            assert isinstance(flag, argparse._StoreTrueAction), f"{name}: --json prints JSON; files go to --out"
        if (count := option(parser, "--threads")) is not None:
            threads += 1
            assert count.type is options.positive_int, name
        if option(parser, "--workers") is not None:
            workers += 1
            assert parser.get_default("default_workers") == 1, f"{name}: --workers defaults to 1 everywhere"
    assert devices >= 6 and jsons >= 7 and threads >= 5 and workers >= 4


def test_positions_means_one_thing_in_every_analysis() -> None:
    helps = {name: option(parser, "--positions") for name, parser in ALL if name.startswith("posattn analyze ")}
    given = {name: a for name, a in helps.items() if a is not None}
    assert len(given) == 5
    for name, action in given.items():
        assert action.metavar == "N" and action.type is options.positive_int, name
        assert action.help.startswith("analyse positions 0..N-1, a sequence of length N"), name


@pytest.mark.parametrize("command", ["compare", "pretrain", "finetune"])
def test_the_config_is_the_first_positional_everywhere(command: str) -> None:
    parser = dict(ALL)[f"posattn {command}"]
    first = next(a for a in parser._actions if not a.option_strings and a.dest != "help")
    assert "config" in (first.help or "").lower() and first.nargs in ("?", "*")


def test_finetune_reads_its_config_positionally_and_keeps_the_old_spelling(tmp_path) -> None:
    from posattn.finetune.cli import split_inputs

    assert split_inputs(["glue", "runs/a", "runs/b"], None) == ("glue", ["runs/a", "runs/b"])
    assert split_inputs(["runs/a"], None) == (None, ["runs/a"])
    assert split_inputs(["runs/a"], "glue") == ("glue", ["runs/a"])          # --config, the deprecated spelling
    (tmp_path / "glue").mkdir()                                               # a folder is always a checkpoint
    assert split_inputs([str(tmp_path / "glue")], None) == (None, [str(tmp_path / "glue")])
    (tmp_path / "suite.yaml").write_text("tasks: [trec6]\n")
    assert split_inputs([str(tmp_path / "suite.yaml")], None) == (str(tmp_path / "suite.yaml"), [])


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"posattn {posattn.__version__}"


def test_devices_are_spelled_one_way() -> None:
    for good in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert options.device(good) == good
    for bad in ("gpu", "cuda:", "cuda:-1", "CPU", "mps", "cuda0"):
        with pytest.raises(argparse.ArgumentTypeError, match="unknown device"):
            options.device(bad)
