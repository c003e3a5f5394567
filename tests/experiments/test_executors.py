"""posattn.experiments.executors: one interface for where every sweep command's cells run."""
import argparse
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
import yaml

from posattn.errors import CellError, PositionError
from posattn.experiments import executors
from posattn.experiments.executors import LocalExecutor, NotStarted


def describe(job: int, in_worker: bool) -> tuple[int, bool, int]:
    return job * job, in_worker, torch.get_num_threads()


class Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("the compiler gave up")
        self.module = types.ModuleType("held")


def fail(job: int, in_worker: bool) -> None:
    raise Unpicklable()


def test_jobs_run_here_one_after_another():
    assert [r[:2] for r in LocalExecutor().map(describe, [1, 2, 3], ["a", "b", "c"])] == [
        (1, False), (4, False), (9, False)]
    assert next(iter(LocalExecutor(4).map(describe, [5], ["a"])))[:2] == (25, False)  # one job: no pool


def test_jobs_run_in_spawned_workers_with_a_share_of_the_threads(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # this process's count, read before spawning
    out = list(LocalExecutor(2).map(describe, [1, 2, 3], ["a", "b", "c"]))
    assert out == [(1, True, 2), (4, True, 2), (9, True, 2)]
    out = LocalExecutor(2, threads=1).map(describe, [1, 2, 3], ["a", "b", "c"], ordered=False)
    assert sorted(out) == [(1, True, 1), (4, True, 1), (9, True, 1)]


def test_a_failed_worker_job_reaches_the_parent_readably():
    """An exception that cannot be pickled (compiler errors hold modules) would reach the parent as
    'cannot pickle module'; the worker re-raises it as a CellError naming the job, with the
    traceback as text."""
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        pickle.dumps(Unpicklable())
    with pytest.raises(CellError) as caught:
        executors._in_worker((fail, 3, "cell 7 (fixed_conv, trec6, seed 3)", 1, None))
    message = str(pickle.loads(pickle.dumps(caught.value)))
    assert "cell 7 (fixed_conv, trec6, seed 3) failed" in message and "the compiler gave up" in message
    with pytest.raises(CellError, match=r"job [ab] failed(.|\n)*the compiler gave up"):  # through a real pool
        list(LocalExecutor(2).map(fail, [1, 2], ["job a", "job b"]))


def test_labels_must_match_the_jobs():
    with pytest.raises(ValueError, match="2 jobs but 1 labels"):
        list(LocalExecutor().map(describe, [1, 2], ["a"]))


def die(job: int, in_worker: bool) -> int:
    import os
    import signal
    import time
    if job == 2:
        os.kill(os.getpid(), signal.SIGKILL)   # as the OOM killer does
    time.sleep(0.5 * job)
    return job


def test_a_killed_worker_raises_instead_of_hanging():
    with pytest.raises(CellError, match=r"worker process died .* unfinished: .*b"):
        list(LocalExecutor(2).map(die, [1, 2, 3], ["a", "b", "c"]))


def slow(job: int, in_worker: bool) -> int:
    time.sleep(0.3)
    return job


def test_no_job_starts_after_the_deadline_and_finished_ones_are_read_back():
    """The job started before the deadline finishes; later ones are NotStarted unless their result
    is already on file (``read``), so a resumed sweep counts its finished cells."""
    on_file = {4: 40}
    out = list(LocalExecutor(deadline=time.time() + 0.2).map(slow, [1, 2, 3, 4], list("abcd"), read=on_file.get))
    assert out == [1, NotStarted("b"), NotStarted("c"), 40]


def test_workers_start_no_job_after_the_deadline():
    """Each worker checks the deadline as it takes a job (the same rule runs in Slurm array tasks)."""
    assert executors._in_worker((describe, 3, "c", 1, time.time() - 1)) == NotStarted("c")
    assert executors._in_worker((describe, 3, "c", 1, time.time() + 60))[0] == 9
    past = LocalExecutor(2, threads=1, deadline=time.time() - 1)
    assert list(past.map(slow, [1, 2, 3], list("abc"), read={2: 20}.get)) == [NotStarted("a"), 20, NotStarted("c")]


def test_time_budget_and_worker_counts_are_checked():
    with pytest.raises(PositionError, match="--time-limit must be a number of seconds >= 0"):
        executors.deadline_after(-5)
    with pytest.raises(PositionError, match="--workers and --threads must be >= 1"):
        LocalExecutor(0)
    assert executors.budget_note(3, 3) is None
    assert executors.budget_note(1, 3) == ("time limit: 1 of 3 cells finished, 2 remain; "
                                           "rerun the same command to resume")


FINISHING_SCRIPT = """
import multiprocessing
from posattn.experiments.executors import LocalExecutor
KEEP = []
def lock(job, in_worker):
    KEEP.append(multiprocessing.Lock())  # as tqdm's write lock in a worker that shows a bar
    return job
if __name__ == "__main__":
    assert list(LocalExecutor(2).map(lock, [1, 2, 3], ["a", "b", "c"])) == [1, 2, 3]
"""


def _run_script(tmp_path, script: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "jobs.py").write_text(script)
    return subprocess.run([sys.executable, str(tmp_path / "jobs.py"), *args], capture_output=True, text=True,
                          check=False, timeout=300)


def test_workers_of_a_finished_sweep_exit_cleanly(tmp_path):
    """Terminated workers skip their exit finalizers: their semaphores leaked, and every recipe
    ended with "resource_tracker: There appear to be N leaked semaphore objects"."""
    done = _run_script(tmp_path, FINISHING_SCRIPT)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr


ORPHAN_SCRIPT = """
import os, signal, sys, threading, time
from pathlib import Path
from posattn.experiments.executors import LocalExecutor
def sleep(job, in_worker):
    (Path(sys.argv[1]) / str(os.getpid())).touch()
    time.sleep(120)
def die_when_both_started():
    while len(list(Path(sys.argv[1]).iterdir())) < 2:
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)   # as a scheduler's kill -9 or the OOM killer
if __name__ == "__main__":
    threading.Thread(target=die_when_both_started, daemon=True).start()
    list(LocalExecutor(2).map(sleep, [1, 2], ["a", "b"]))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_workers_end_when_the_sweep_process_is_killed(tmp_path):
    (tmp_path / "pids").mkdir()
    done = _run_script(tmp_path, ORPHAN_SCRIPT, str(tmp_path / "pids"))
    assert done.returncode == -signal.SIGKILL, done.stderr
    pids = [int(p.name) for p in (tmp_path / "pids").iterdir()]
    try:
        deadline = time.monotonic() + 10 * executors.WATCH_SECONDS + 5
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, pids)), "workers outlived the killed sweep"
    finally:
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)


TINY_SWEEP = {
    "name": "tiny", "task": "mqar", "task_params": {"num_kv_pairs": 2}, "vocab_size": 16, "train_length": 16,
    "test_multipliers": [1, 2], "examples": {"train": 100, "valid": 20, "test": 20}, "d_model": 16,
    "models": [{"mechanisms": ["rope"], "layers": 1}],
    "training": {"steps": 6, "batch_size": 8, "lr": [3e-3, 1e-2], "eval_every": 3},
}


def test_a_time_limited_sweep_stops_cleanly_and_the_next_run_resumes(tmp_path, monkeypatch, capsys):
    """--time-limit: no cell starts after it, the running one finishes, the partial report is
    written, the command says what remains and exits 0; the same command then finishes the rest."""
    from posattn import cli
    from posattn.synthetic import compare

    config, out = tmp_path / "tiny.yaml", tmp_path / "out"
    config.write_text(yaml.safe_dump(TINY_SWEEP))
    command = ["compare", str(config), "--out", str(out), "--no-progress"]
    assert cli.main([*command, "--time-limit", "0"]) == 0
    assert "time limit: 0 of 2 cells finished, 2 remain; rerun the same command to resume" in capsys.readouterr().out
    assert not (out / "cells").exists() or not any((out / "cells").glob("*/result.json"))

    real_train, trained = compare.train, []

    def train_past_the_limit(*args, **kwargs):
        trained.append(1)
        outcome = real_train(*args, **kwargs)
        time.sleep(1.2)   # this cell runs past the 1-second budget: it finishes, the next one does not start
        return outcome

    monkeypatch.setattr(compare, "train", train_past_the_limit)
    assert cli.main([*command, "--time-limit", "1"]) == 0
    printed = capsys.readouterr().out
    assert "**Partial: 1 of 2 cells finished.**" in printed and len(trained) == 1
    assert "time limit: 1 of 2 cells finished, 1 remain" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["cells_total"] == 2 and len(results["cells"]) == 1

    monkeypatch.setattr(compare, "train", lambda *a, **k: trained.append(1) or real_train(*a, **k))
    assert cli.main(command) == 0
    printed = capsys.readouterr().out
    assert len(trained) == 2 and "Partial" not in printed and "time limit" not in printed
    assert len(json.loads((out / "results.json").read_text())["cells"]) == 2


# Slurm through submitit: without a cluster, submitit runs the array tasks as local processes.
needs_no_slurm = pytest.mark.skipif(shutil.which("sbatch") is not None,
                                    reason="sbatch exists: --executor slurm would submit to a real cluster")


@pytest.fixture
def importable_here(monkeypatch):
    """submitit's local array tasks are fresh interpreters: give them this process's import path."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    monkeypatch.setattr(executors.SlurmExecutor, "POLL_SECONDS", 0.2)


SAME = ("id", "label", "accuracy", "valid_accuracy", "steps", "history", "scores", "valid_score", "best_step")


def same_cells(a: list[dict], b: list[dict]) -> None:
    """The same cells in the same order with the same results (timings aside)."""
    assert [c["id"] for c in a] == [c["id"] for c in b]
    for x, y in zip(a, b):
        assert {k: x[k] for k in SAME if k in x} == {k: y[k] for k in SAME if k in y}


def untimed(report: str) -> str:
    """``report`` with the values of its tables' ``train s`` column (wall time) blanked."""
    lines, column = report.splitlines(), None
    for i, line in enumerate(lines):
        cells = line.split("|")
        if not line.startswith("|"):
            column = None
        elif "train s" in [c.strip() for c in cells]:
            column = [c.strip() for c in cells].index("train s")
        elif column is not None and not set(line) <= set("|-: "):
            lines[i] = "|".join(cells[:column] + [" - "] + cells[column + 1:])
    return "\n".join(lines)


@needs_no_slurm
def test_a_compare_sweep_on_slurm_gives_the_cells_of_the_local_pool(tmp_path, importable_here, capsys):
    from posattn import cli

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY_SWEEP))
    command = ["compare", str(config), "--no-progress"]
    assert cli.main([*command, "--out", str(tmp_path / "local")]) == 0
    assert cli.main([*command, "--out", str(tmp_path / "slurm"), "--executor", "slurm", "--array-parallelism", "2",
                     "--slurm-time", "5"]) == 0
    local, slurm = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("local", "slurm"))
    same_cells(local["cells"], slurm["cells"])
    local_report, slurm_report = ((tmp_path / name / "report.md").read_text() for name in ("local", "slurm"))
    assert "train s" in local_report and untimed(local_report) == untimed(slurm_report)
    assert list((tmp_path / "slurm" / "slurm").glob("*_0_log.out"))   # the array tasks' logs, under <out>/slurm
    capsys.readouterr()
    # a duplicated (or requeued) array finds every cell finished and skips it
    assert cli.main([*command, "--out", str(tmp_path / "slurm"), "--executor", "slurm"]) == 0
    assert json.loads((tmp_path / "slurm" / "results.json").read_text())["cells"] == slurm["cells"]


@needs_no_slurm
def test_a_finetune_suite_on_slurm_gives_the_cells_of_the_local_pool(tmp_path, importable_here):
    """Two waves (MNLI first: its model starts RTE's cell), each an array, as on one machine."""
    # tests/ is on sys.path (pytest's rootdir layout)
    from finetune.glue_files import write_glue
    from finetune.helpers import make_checkpoint

    from posattn import cli

    write_glue(tmp_path / "glue", n=24)
    checkpoint = make_checkpoint(tmp_path / "pretrain", ["absolute"])
    config = tmp_path / "suite.yaml"
    config.write_text(yaml.safe_dump({"checkpoints": [str(checkpoint)], "tasks": ["mnli", "rte"], "seeds": 1,
                                      "glue_dir": str(tmp_path / "glue"), "training": {"epochs": 1},
                                      "executor": {"executor": "slurm", "array_parallelism": 2}}))
    command = ["finetune", "--config", str(config), "--no-progress"]
    assert cli.main([*command, "--out", str(tmp_path / "local"), "--executor", "local", "--workers", "1"]) == 0
    assert cli.main([*command, "--out", str(tmp_path / "slurm")]) == 0   # the config's executor block
    local, slurm = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("local", "slurm"))
    assert len(slurm["cells"]) == 2 and slurm["cells"][1]["init_from"] == slurm["cells"][0]["id"]
    same_cells(local["cells"], slurm["cells"])


def fail_on_two(job: int, in_worker: bool) -> int:
    if job == 2:
        raise RuntimeError("the compiler gave up")
    return job


@needs_no_slurm
def test_a_failed_cell_on_slurm_names_the_cell(tmp_path, importable_here):
    slurm = executors.SlurmExecutor(tmp_path / "logs", array_parallelism=2, time_minutes=5)
    with pytest.raises(CellError, match=r"cell b failed in array task (.|\n)*the compiler gave up"):
        list(slurm.map(fail_on_two, [1, 2, 3], ["cell a", "cell b", "cell c"]))


def test_a_requeued_array_task_runs_its_whole_shard_again():
    """submitit requeues a task that hits its time limit when its callable has ``checkpoint``: the
    same shard runs again, and the sweep's resume skips the cells it finished."""
    shard = executors._Shard(describe, [1, 2], ["a", "b"], 1, None)
    again = shard.checkpoint()
    assert again.function is shard and again.args == () and [r[0] for r in again.function()] == [1, 4]


def test_a_bad_executor_block_is_one_of_the_config_problems():
    from posattn.experiments.config import ConfigError
    from posattn.synthetic.compare import validate_config

    with pytest.raises(ConfigError, match=r"(?s)unknown key\(s\) colour.*executor: unknown key\(s\) gpus"):
        validate_config({**TINY_SWEEP, "colour": "red", "executor": {"gpus": 1}})


def test_options_and_the_config_block_choose_the_executor(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter)
    executors.add_executor_options(parser, workers=2)
    assert "--executor slurm --slurm-partition gpu --gpus-per-task 1" in parser.format_help()

    def chosen(*argv, block=None):
        return executors.executor_from(parser.parse_args(argv), 1, block, tmp_path)

    assert chosen().workers == 2 and chosen(block={"workers": 3}).workers == 3
    assert chosen("--workers", "1", block={"workers": 3}).workers == 1      # the command line wins
    assert chosen("--executor", "local", block={"executor": "slurm", "slurm_partition": "gpu"}).workers == 2
    slurm = chosen("--slurm-partition", "gpu", "--gpus-per-task", "1", block={"executor": "slurm", "slurm_time": 30})
    assert isinstance(slurm, executors.SlurmExecutor)
    assert (slurm.partition, slurm.gpus_per_task, slurm.time_minutes, slurm.folder) == (
        "gpu", 1, 30, tmp_path / "slurm")
    with pytest.raises(PositionError, match="--slurm-partition apply only with --executor slurm"):
        chosen("--slurm-partition", "gpu")
    with pytest.raises(PositionError, match="--workers applies to --executor local"):
        chosen("--executor", "slurm", "--workers", "2")
    assert executors.block_problems({"executor": "pbs", "gpus": 1, "slurm_time": "1h"}) == [
        ("executor: unknown key(s) gpus; valid keys: executor, workers, time_limit, slurm_partition, gpus_per_task, "
         "slurm_time, array_parallelism, slurm_folder"),
        "executor: slurm_time must be an integer, got '1h'",
        "executor: executor must be one of local, slurm, got 'pbs'"]
    monkeypatch.setitem(sys.modules, "submitit", None)   # not installed
    with pytest.raises(PositionError, match=r"needs submitit, which is not installed: pip install 'posattn\[slurm\]'"):
        chosen("--executor", "slurm")


def test_a_time_limited_pretraining_recipe_stops_between_runs(tmp_path, capsys):
    """A recipe's runs are its cells: past the limit no run starts, the summary says it is partial."""
    # tests/ is on sys.path (pytest's rootdir layout)
    from pretrain.conftest import make_documents, tiny

    from posattn import cli
    from posattn.text.corpus import build_corpus

    corpus = build_corpus(make_documents(), tmp_path / "corpus", vocab_size=64)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**tiny(corpus), "name": "r",
                                      "runs": [{"label": "abs"}, {"label": "rope", "mechanisms": ["rope"]}]}))
    command = ["pretrain", str(recipe), "--out", str(tmp_path / "out"), "--no-progress"]
    assert cli.main([*command, "--runs", "abs"]) == 0
    capsys.readouterr()
    assert cli.main([*command, "--time-limit", "0"]) == 0
    printed = capsys.readouterr().out
    assert "**Partial: 1 of 2 runs finished.**" in printed and "| abs | absolute |" in printed
    assert "time limit: 1 of 2 runs finished, 1 remain; rerun the same command to resume" in printed
    assert not (tmp_path / "out" / "rope").exists()
