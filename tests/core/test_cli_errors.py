"""Every bad input to every command ends in one ``posattn: error:`` line, exit status 2 (bad input) or 1
(the work failed), no traceback, and nothing written: out-of-range numbers, unknown or unavailable
devices, unusable output folders, truncated or foreign files, bad text encodings, malformed specs.
Each case runs in-process through :func:`posattn.cli.main` and fails before any training."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import posattn
from posattn import cli
from posattn.errors import CellError, cell_failure
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


def test_a_worker_failure_is_one_line_and_debug_shows_its_traceback(tmp_path, capsys, monkeypatch):
    """A cell that failed in a worker: one line naming the cell and the exception (its traceback, once,
    only with --debug), exit 1."""
    def fails(*args, **kwargs):
        try:
            raise ZeroDivisionError("the cell divided by zero")
        except ZeroDivisionError:
            raise cell_failure("cell 3 (tisa, seed 0)") from None

    monkeypatch.setattr("posattn.synthetic.cli.run_sweep", fails)
    argv = ["compare", "--out", str(tmp_path / "out"), "--no-progress"]
    says = "cell 3 (tisa, seed 0) failed (ZeroDivisionError: the cell divided by zero)"
    assert_one_error(*run(argv, capsys), 1, says)
    with pytest.raises(CellError, match="Worker traceback:(.|\n)*ZeroDivisionError"):
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
