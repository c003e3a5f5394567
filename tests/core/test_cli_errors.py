"""Every bad input to every command ends in one ``posattn: error:`` line, exit status 2 (bad input) or 1
(the work failed), no traceback, and nothing written: out-of-range numbers, unknown or unavailable
devices, unusable output folders, truncated or foreign files, bad text encodings, malformed specs,
config files with a YAML syntax error (exactly one line: file, line, column, reason), and bad input
that a worker process finds (exit 2 like the same input found in the command's own process).
Each case runs in-process through :func:`posattn.cli.main` and fails before any training."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import posattn
from posattn import cli
from posattn.errors import CellError, CellInputError, PositionError, cell_failure
from posattn.models import from_yaml
from posattn.runtime.checkpoint import save_checkpoint
from posattn.text.tokenizer import train_tokenizer

NO_GPU = "cuda:99"   # a device index no machine has


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``posattn ARGV`` (argparse's errors exit through SystemExit)."""
    try:
        status = cli.main(argv)
    except SystemExit as e:
        status = e.code
    got = capsys.readouterr()
    return status, got.out, got.err


def assert_one_error(status: int, out: str, err: str, want: int, says: str) -> None:
    """One ``posattn: error:`` line, first on stderr (a config's list of problems continues below it,
    one per line), saying ``says``; no traceback."""
    assert status == want, err
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert lines and lines[0].startswith("posattn: error: "), err
    assert err.count("posattn: error:") == 1 and says in err, err


# config files with a YAML syntax error -> what the one line says: where the parser stopped and why
BROKEN_YAML = {
    "unclosed.yaml": ("name: x\ntask: [mqar\n", "not valid YAML: line 3, column 1: expected ',' or ']', but got "
                      "'<stream end>' (while parsing a flow sequence from line 2, column 7)"),
    "indented.yaml": ("name: x\n  task: mqar\n",
                      "not valid YAML: line 2, column 7: mapping values are not allowed here"),
    "quote.yaml": ('name: "x\n', "not valid YAML: line 2, column 1: found unexpected end of stream (while scanning "
                   "a quoted scalar from line 1, column 7)"),
    "tab.yaml": ("name: x\n\ttask: mqar\n", "not valid YAML: line 2, column 1: found character '\\t' that cannot "
                 "start any token"),
    "control.yaml": ("name: x\x07\n", "not valid YAML: line 1, column 8: character #x0007: special characters are "
                     "not allowed"),
    "alias.yaml": ("name: x\ntask: *mqar\n", "not valid YAML: line 2, column 7: found undefined alias 'mqar'"),
    "python-tag.yaml": ("name: !!python/object/apply:os.system [ls]\n", "not valid YAML: line 1, column 7: could not "
                        "determine a constructor for the tag"),
    "latin1.yaml": ("name: café\n".encode("latin-1"), "not a readable file ('utf-8' codec can't decode"),
}
# every command that reads a config file, with {f} for the file
YAML_COMMANDS = [["compare", "{f}"], ["pretrain", "{f}"], ["finetune", "{f}"], ["finetune", "--config", "{f}"],
                 ["bench-throughput", "{f}", "--no-store"]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A file where a folder belongs, a good tiny checkpoint, truncated and foreign weights, GLUE files
    that are not UTF-8 or hold a huge field."""
    root = tmp_path_factory.mktemp("bad")
    (root / "a-file").write_text("not a folder")
    torch.manual_seed(0)
    cfg = posattn.ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=16,
                              mechanisms=["absolute"])
    good = posattn.save(posattn.Encoder(cfg), root / "good" / "model")
    train_tokenizer(["the dog chased the cat", "a man saw a woman"], vocab_size=64).save(str(good / "tokenizer.json"))
    for name, damage in [("truncated", lambda b: b[: len(b) // 2]), ("foreign", lambda b: b"PK\x03\x04" + b[4:]),
                         ("empty", lambda b: b"")]:
        folder = root / name / "model"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text((good / "config.json").read_text())
        (folder / "model.safetensors").write_bytes(damage((good / "model.safetensors").read_bytes()))
    for name, weights in [("hf-truncated", "model.safetensors"), ("hf-bin", "pytorch_model.bin")]:
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 16}))
        (root / name / weights).write_bytes((good / "model.safetensors").read_bytes()[:100])
    (root / "badjson" / "model").mkdir(parents=True)
    (root / "badjson" / "model" / "config.json").write_text('{"format": "posattn", ')
    header = "index\tsentence1\tsentence2\tlabel\n"
    rows = "".join(f"{i}\tthe dog ran\tthe cat sat\t{'entailment' if i % 2 else 'not_entailment'}\n"
                   for i in range(20))
    for name, train in [("latin1", (header + rows).encode() + "5\tcafé\tthé\tentailment\n".encode("latin-1")),
                        ("hugefield", (header + rows + f"7\t{'x' * 200_000}\tb\tentailment\n").encode())]:
        (root / name / "RTE").mkdir(parents=True)
        (root / name / "RTE" / "train.tsv").write_bytes(train)
        (root / name / "RTE" / "dev.tsv").write_text(header + rows)
    (root / "bad.yaml").write_text("task: [unclosed\n")
    for name, (text, _) in BROKEN_YAML.items():
        (root / name).write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    (root / "run-bad-yaml").mkdir()
    (root / "run-bad-yaml" / "config.yaml").write_text(BROKEN_YAML["unclosed.yaml"][0])
    return {"root": root}


# (argv, exit status, text the one line must hold); {root} is the fixture's folder, {out} a fresh one
CASES = [
    # out-of-range and malformed numbers, refused where they are read
    (["mechanisms", "--heads", "0"], 2, "--heads: must be >= 1, got 0"),
    (["mechanisms", "--d-model", "0"], 2, "--d-model: must be >= 1"),
    (["mechanisms", "--layers", "-2"], 2, "--layers: must be >= 1"),
    (["mechanisms", "--max-len", "ten"], 2, "expected an integer"),
    (["mechanisms", "--d-model", "30", "--heads", "4"], 2, "not a multiple of --heads 4"),
    (["bench", "--threads", "0", "--out", "{out}"], 2, "--threads: must be >= 1"),
    (["bench", "--heads", "0", "--out", "{out}"], 2, "--heads: must be >= 1"),
    (["bench", "--head-dim", "-1", "--out", "{out}"], 2, "--head-dim: must be >= 1"),
    (["bench", "-n", "1", "--out", "{out}"], 2, "--lengths: must be >= 2"),
    (["bench", "--batch", "0", "--out", "{out}"], 2, "--batch: must be >= 1"),
    (["bench", "--repeats", "0", "--out", "{out}"], 2, "--repeats: must be >= 1"),
    (["bench", "--warmup", "-1", "--out", "{out}"], 2, "--warmup: must be >= 0"),
    (["bench", "--dropout", "1.5", "--out", "{out}"], 2, "probability in [0, 1)"),
    (["bench", "--dropout", "nan", "--out", "{out}"], 2, "probability in [0, 1)"),
    (["bench", "--policy", "nonsense", "--out", "{out}"], 2, "bad item(s) nonsense"),
    (["bench", "--policy", "force=nonsense", "--out", "{out}"], 2, "force=nonsense (expects sdpa or dense"),
    (["bench", "--ab", "native=1", "--out", "{out}"], 2, "native=1 (expects bool)"),
    (["bench", "--policy", "grad_chunk=1.5", "--out", "{out}"], 2, "grad_chunk=1.5 (expects int)"),
    (["bench-decode", "-n", "1", "--out", "{out}"], 2, "-n: must be >= 2"),
    (["bench-decode", "--new", "0", "--out", "{out}"], 2, "--new: must be >= 1"),
    (["bench-decode", "--layers", "0", "--out", "{out}"], 2, "--layers: must be >= 1"),
    (["eval-lm", "--lengths", "0", "--out", "{out}"], 2, "--lengths: must be >= 2, got 0"),
    (["eval-lm", "--tokens", "0", "--out", "{out}"], 2, "--tokens: must be >= 1, got 0"),
    (["eval-lm", "--multipliers", "0", "--out", "{out}"], 2, "--multipliers: must be a finite number > 0"),
    (["eval-lm", "--factor", "-1", "--out", "{out}"], 2, "--factor: must be a finite number > 0"),
    (["eval-lm", "--threads", "0", "--out", "{out}"], 2, "--threads: must be >= 1"),
    (["pretrain", "--steps", "0", "--out", "{out}"], 2, "--steps: must be >= 1"),
    (["pretrain", "--batch-size", "-4", "--out", "{out}"], 2, "--batch-size: must be >= 1"),
    (["pretrain", "--grad-accum", "0", "--out", "{out}"], 2, "--grad-accum: must be >= 1"),
    (["pretrain", "--lr", "0", "--out", "{out}"], 2, "--lr: must be a finite number > 0"),
    (["pretrain", "--lr", "inf", "--out", "{out}"], 2, "--lr: must be a finite number > 0"),
    (["pretrain", "--seed", "-1", "--out", "{out}"], 2, "--seed: must be >= 0"),
    (["pretrain", "--threads", "0", "--out", "{out}"], 2, "--threads: must be >= 1"),
    (["pretrain", "--objective", "xlm", "--out", "{out}"], 2, "invalid choice: 'xlm'"),
    (["compare", "--threads", "0", "--out", "{out}"], 2, "--threads: must be >= 1"),
    (["compare", "--workers", "0", "--out", "{out}"], 2, "--workers and --threads must be >= 1"),
    (["compare", "--time-limit", "-5", "--out", "{out}"], 2, "--time-limit must be a number of seconds >= 0"),
    (["finetune", "--seeds", "0", "--out", "{out}"], 2, "--seeds: must be >= 1"),
    (["finetune", "--max-train", "-1", "--out", "{out}"], 2, "--max-train: must be >= 0"),
    (["finetune", "--max-eval", "x", "--out", "{out}"], 2, "--max-eval: expected an integer"),
    (["analyze", "toeplitz", "minilm", "--positions", "0", "--out", "{out}"], 2, "--positions: must be >= 1"),
    (["analyze", "kernels", "minilm", "--half-width", "0", "--out", "{out}"], 2, "--half-width: must be >= 1"),
    (["analyze", "rank", "--random-pair", "--batch", "0", "--out", "{out}"], 2, "--batch: must be >= 1"),
    (["analyze", "rank", "--random-pair", "--rtol", "-1", "--out", "{out}"], 2, "--rtol: must be a finite"),
    (["analyze", "fit-tisa", "minilm", "--kernels", "0", "--out", "{out}"], 2, "--kernels: must be >= 1"),
    (["analyze", "order-probe", "x", "--max-pairs", "0", "--out", "{out}"], 2, "--max-pairs: must be >= 1"),
    (["study", "table3", "--seeds", "0", "--out", "{out}"], 2, "--seeds: must be >= 1"),
    (["study", "table3", "--lr", "-1", "--out", "{out}"], 2, "--lr: must be a finite number > 0"),
    (["study", "closeness", "--texts", "0", "--out", "{out}"], 2, "--texts: must be >= 1"),
    (["corpus", "--vocab-size", "0", "--out", "{out}"], 2, "--vocab-size: must be >= 1"),
    # malformed specs and missing pieces of the command line
    (["bench", "-m", '[{"name": "tisa", ', "--out", "{out}"], 2, "is not valid JSON"),
    (["bench", "-m", "[1, 2]", "--out", "{out}"], 2, 'must be a name or an object with a "name"'),
    (["bench", "-m", '{"n_kernels": 3}', "--out", "{out}"], 2, 'must be a name or an object with a "name"'),
    (["bench", "-m", "[]", "--out", "{out}"], 2, "got nothing"),
    (["bench", "-m", "nosuchmechanism", "--out", "{out}"], 2, "nosuchmechanism"),
    (["bench-decode", "-m", "nosuchmechanism", "--out", "{out}"], 2, "nosuchmechanism"),
    (["study"], 2, "(one of table3, closeness)"),
    (["analyze"], 2, "(one of toeplitz"),
    (["results"], 2, "(one of add, list)"),
    (["nosuchcommand"], 2, "invalid choice: 'nosuchcommand'"),
    (["compare", "--no-such-option"], 2, "unrecognized arguments: --no-such-option"),
    (["analyze", "rank", "--out", "{out}"], 2, "give at least one MODEL, or --random-pair"),
    # unknown devices, refused while parsing, in every command that computes
    *[([command, *extra, "--device", bad, "--out", "{out}"], 2, "unknown device")
      for command, extra in [("compare", []), ("pretrain", []), ("finetune", []), ("eval-lm", []), ("bench", []),
                             ("bench-decode", [])]
      for bad in ["tpu", "cuda:x", "gpu"]],
    # unavailable devices, refused before anything runs
    *[([command, *extra, "--device", NO_GPU, "--out", "{out}"], 2, f"--device {NO_GPU} is not available")
      for command, extra in [("compare", []), ("pretrain", []), ("finetune", []), ("eval-lm", []), ("bench", []),
                             ("bench-decode", [])]],
    # output folders that are files
    *[([*command, "--out", "{root}/a-file"], 2, "a-file: exists and is not a folder")
      for command in [["compare"], ["pretrain"], ["finetune"], ["eval-lm"], ["bench"], ["bench-decode"],
                      ["corpus"], ["analyze", "toeplitz", "minilm"], ["analyze", "kernels", "minilm"],
                      ["study", "closeness"], ["study", "table3"], ["report", "somerecipe"]]],
    (["compare", "--out", "{root}/a-file/below"], 2, "a-file is not a folder"),
    (["results", "list", "--results", "{root}/a-file"], 2, "--results {root}/a-file: exists and is not a folder"),
    (["results", "add", "{root}/good", "--results", "{root}/a-file"], 2, "exists and is not a folder"),
    # configs: missing, malformed, two at once
    (["compare", "no-such-config", "--out", "{out}"], 2, "no-such-config"),
    (["compare", "{root}/bad.yaml", "--out", "{out}"], 2, "bad.yaml"),
    (["pretrain", "no-such-recipe", "--out", "{out}"], 2, "no-such-recipe"),
    (["pretrain", "{root}/bad.yaml", "--out", "{out}"], 2, "bad.yaml"),
    (["finetune", "{root}/missing.yaml", "--out", "{out}"], 2, "missing.yaml"),
    (["finetune", "{root}/bad.yaml", "--out", "{out}"], 2, "bad.yaml"),
    (["finetune", "offline", "--config", "glue", "--out", "{out}"], 2, "two configs, offline and --config glue"),
    # truncated, foreign or missing model files
    *[(["analyze", command, "{root}/" + damaged, "--out", "{out}"], 2, "unreadable weights")
      for command in ["toeplitz", "kernels"] for damaged in ["truncated", "foreign", "empty"]],
    *[(["analyze", command, "{root}/" + damaged, "--out", "{out}"], 2, "unreadable weights")
      for command in ["toeplitz", "profiles"] for damaged in ["hf-truncated", "hf-bin"]],
    (["analyze", "toeplitz", "{root}/badjson", "--out", "{out}"], 2, "not valid JSON"),
    (["analyze", "toeplitz", "{root}/nowhere", "--out", "{out}"], 2, "no such folder"),
    (["analyze", "toeplitz", "{root}/a-file", "--out", "{out}"], 2, "is a file"),
    (["eval-lm", "{root}/truncated", "--out", "{out}", "--no-progress"], 2, "truncated"),
    (["eval-lm", "{root}/nowhere", "--out", "{out}", "--no-progress"], 2, "nowhere"),
    (["finetune", "{root}/nowhere", "--out", "{out}", "--no-progress"], 2, "nowhere"),
    # GLUE files that are not UTF-8 or hold a field beyond the csv module's limit
    (["finetune", "glue", "{root}/good", "--tasks", "rte", "--glue-dir", "{root}/latin1", "--seeds", "1",
      "--out", "{out}", "--no-progress"], 2, "RTE/train.tsv:22: not UTF-8 text"),
    (["finetune", "glue", "{root}/good", "--tasks", "rte", "--glue-dir", "{root}/hugefield", "--seeds", "1",
      "--out", "{out}", "--no-progress"], 2, "RTE/train.tsv:22: field larger than field limit"),
    (["finetune", "glue", "{root}/good", "--tasks", "rte", "--glue-dir", "{root}/nowhere", "--seeds", "1",
      "--out", "{out}", "--no-progress"], 2, "glue_dir: {root}/nowhere: no such folder"),
]


@pytest.mark.parametrize("argv, status, says", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_input_is_one_line(argv, status, says, files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)   # defaults such as runs/... land in the test's folder
    out = tmp_path / "out"
    argv = [a.replace("{root}", str(files["root"])).replace("{out}", str(out)) for a in argv]
    says = says.replace("{root}", str(files["root"]))
    assert_one_error(*run(argv, capsys), status, says)
    assert not out.exists(), "a refused command wrote its output folder"


@pytest.mark.parametrize("name", BROKEN_YAML)
@pytest.mark.parametrize("command", YAML_COMMANDS, ids=lambda v: " ".join(v))
def test_a_yaml_syntax_error_is_one_line(command, name, files, tmp_path, capsys, monkeypatch):
    """PyYAML's own message spans several lines (the text quoted, a caret below it): the command ends
    in exactly one line naming the file, the line and column where the parser stopped and its reason."""
    monkeypatch.chdir(tmp_path)
    path = files["root"] / name
    argv = [a.replace("{f}", str(path)) for a in command] + ["--out", str(tmp_path / "out")]
    if command[0] == "bench-throughput":
        argv = argv[:-2]   # it has no output folder: it writes nothing with --no-store
    status, out, err = run(argv, capsys)
    assert_one_error(status, out, err, 2, f"{path}: {BROKEN_YAML[name][1]}")
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [], "a refused command wrote something"


def test_a_run_folder_whose_config_is_broken_yaml_is_one_line(files, tmp_path, capsys):
    folder = files["root"] / "run-bad-yaml"
    says = f"{folder / 'config.yaml'}: {BROKEN_YAML['unclosed.yaml'][1]}"
    for argv in (["results", "add", str(folder), "--results", str(tmp_path / "results")],
                 ["report", "somerecipe", "--runs", str(folder), "--results", str(tmp_path / "results"),
                  "--out", str(tmp_path / "report")]):
        status, out, err = run(argv, capsys)
        assert_one_error(status, out, err, 2, says)
        assert len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_model_yaml_syntax_error_is_one_line(files):
    with pytest.raises(PositionError) as raised:
        from_yaml(files["root"] / "unclosed.yaml")
    assert str(raised.value) == f"{files['root'] / 'unclosed.yaml'}: {BROKEN_YAML['unclosed.yaml'][1]}"


@pytest.mark.parametrize("damaged", ["truncated", "foreign", "empty"])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_finetune_refuses_a_damaged_checkpoint_before_it_writes(damaged, workers, files, tmp_path, capsys):
    """A damaged model.safetensors is refused while the config is read (its header against the file's
    size), with any number of workers: exit 2, one line, no output folder."""
    argv = ["finetune", str(files["root"] / damaged), "--seeds", "1", "--workers", workers,
            "--out", str(tmp_path / "out"), "--no-progress"]
    assert_one_error(*run(argv, capsys), 2, f"{files['root'] / damaged / 'model' / 'model.safetensors'}: unreadable "
                     f"weights")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_truncated_resume_checkpoint_is_exit_2_in_or_out_of_process(workers, tmp_path, capsys):
    """compare with a truncated checkpoint.pt in its cells' folders (so also finetune, pretrain recipes and
    table3, which run their cells through the same executor): exit 2 and one line, whether the cell runs in
    this process or in a worker."""
    from posattn.synthetic.compare import load_config, validate_config

    config = tmp_path / "tiny.yaml"
    config.write_text("name: tiny\ntask: mqar\ntask_params: {num_kv_pairs: 2}\nvocab_size: 16\ntrain_length: 16\n"
                      "test_multipliers: [1]\nmax_len: 32\nexamples: {train: 32, valid: 8, test: 8}\nd_model: 16\n"
                      "models: [{mechanisms: [cat], layers: 1}, {mechanisms: [absolute], layers: 1}]\n"
                      "training: {steps: 2, batch_size: 8, lr: 0.01, eval_every: 1}\n")
    out = tmp_path / "out"
    for cell in validate_config(load_config(str(config))).cells:
        path = out / "cells" / cell.id / "checkpoint.pt"
        save_checkpoint(path, {"config": {}, "weights": torch.zeros(256)})
        path.write_bytes(path.read_bytes()[:300])
    argv = ["compare", str(config), "--out", str(out), "--workers", workers, "--threads", "1", "--no-progress"]
    status, stdout, err = run(argv, capsys)
    assert_one_error(status, stdout, err, 2, "checkpoint.pt is unreadable")
    assert len(err.splitlines()) == 1 and "rerun" not in err


def test_a_read_only_output_folder_is_refused(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):   # root ignores permissions: let the check see what a user would
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real(p, mode))
    try:
        for argv in (["compare"], ["bench"], ["analyze", "toeplitz", "minilm"]):
            assert_one_error(*run([*argv, "--out", str(locked / "run")], capsys), 2, "permission denied")
            assert_one_error(*run([*argv, "--out", str(locked)], capsys), 2, "permission denied")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("error, status, says, raised", [
    (ZeroDivisionError("the cell divided by zero"), 1,
     "cell 3 (tisa, seed 0) failed (ZeroDivisionError: the cell divided by zero); rerun the command", CellError),
    (PositionError("checkpoint cells/3/checkpoint.pt is unreadable (truncated)"), 2,
     "cell 3 (tisa, seed 0): checkpoint cells/3/checkpoint.pt is unreadable (truncated); --debug", CellInputError),
])
def test_a_worker_failure_is_one_line_and_debug_shows_its_traceback(error, status, says, raised, tmp_path, capsys,
                                                                     monkeypatch):
    """A cell that failed in a worker: one line naming the cell and the exception (its traceback, once,
    only with --debug), exit 1; bad input the worker found (a damaged file the cell reads) stays bad
    input across the process boundary: exit 2, and no advice to rerun."""
    def fails(*args, **kwargs):
        try:
            raise error
        except Exception:
            raise cell_failure("cell 3 (tisa, seed 0)") from None

    monkeypatch.setattr("posattn.synthetic.cli.run_sweep", fails)
    argv = ["compare", "--out", str(tmp_path / "out"), "--no-progress"]
    got = run(argv, capsys)
    assert_one_error(*got, status, says)
    assert len(got[2].splitlines()) == 1 and ("rerun" in got[2]) == (status == 1)
    with pytest.raises(raised, match=f"Worker traceback:(.|\n)*{type(error).__name__}"):
        cli.main(["--debug", *argv])


def test_an_os_error_while_running_is_one_line(tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "out" / "results.json"))

    monkeypatch.setattr("posattn.synthetic.cli.run_sweep", full)
    status, out, err = run(["compare", "--out", str(tmp_path / "out")], capsys)
    assert_one_error(status, out, err, 1, "results.json: No space left on device")


def test_bench_fails_when_every_case_failed(tmp_path, capsys):
    """Every mechanism case failing to build is exit 1 with one line naming the first failure
    (the rows, errors included, are still written)."""
    argv = ["bench", "--quick", "--threads", "1", "--repeats", "1", "--warmup", "0", "--no-memory", "--kinds",
            "layer", "-n", "16", "-m", '[{"name": "tisa", "n_kernels": 0}]', "--device", "cpu",
            "--out", str(tmp_path / "out")]
    status, out, err = run(argv, capsys)
    assert status == 1 and "Traceback" not in out + err
    last = err.splitlines()[-1]
    assert last.startswith("posattn: error: bench: every case failed (1)") and "tisa" in last
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert any("error" in r for r in rows)


@pytest.mark.parametrize("error, status, says", [
    (ValueError("a check nobody wrote\nsecond line"), 1, "ValueError: a check nobody wrote (unforeseen: "),
    (KeyboardInterrupt(), 130, "interrupted; rerun the same command to resume"),
])
def test_an_unforeseen_error_or_an_interrupt_is_one_line(error, status, says, tmp_path, capsys, monkeypatch):
    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr("posattn.synthetic.cli.run_sweep", fails)
    argv = ["compare", "--out", str(tmp_path / "out")]
    got, out, err = run(argv, capsys)
    assert got == status and "Traceback" not in out + err
    assert len(err.splitlines()) == 1 and err.startswith("posattn: ") and says in err
    with pytest.raises(type(error)):
        cli.main(["--debug", *argv])
