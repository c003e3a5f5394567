"""posattn.parallel.run_jobs: one rule for every sweep command's worker processes."""
import os
import pickle
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from posattn import parallel
from posattn.errors import CellError


def describe(job: int, in_worker: bool) -> tuple[int, bool, int]:
    return job * job, in_worker, torch.get_num_threads()


class Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("the compiler gave up")
        self.module = types.ModuleType("held")


def fail(job: int, in_worker: bool) -> None:
    raise Unpicklable()


def test_jobs_run_here_one_after_another():
    assert [r[:2] for r in parallel.run_jobs(describe, [1, 2, 3], ["a", "b", "c"])] == [(1, False), (4, False), (9, False)]
    assert list(parallel.run_jobs(describe, [5], ["a"], workers=4))[0][:2] == (25, False)  # one job: no pool


def test_jobs_run_in_spawned_workers_with_a_share_of_the_threads(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # this process's count, read before spawning
    out = list(parallel.run_jobs(describe, [1, 2, 3], ["a", "b", "c"], workers=2))
    assert out == [(1, True, 2), (4, True, 2), (9, True, 2)]
    out = parallel.run_jobs(describe, [1, 2, 3], ["a", "b", "c"], workers=2, threads=1, ordered=False)
    assert sorted(out) == [(1, True, 1), (4, True, 1), (9, True, 1)]


def test_a_failed_worker_job_reaches_the_parent_readably():
    """An exception that cannot be pickled (compiler errors hold modules) would reach the parent as
    'cannot pickle module'; the worker re-raises it as a CellError naming the job, with the
    traceback as text."""
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        pickle.dumps(Unpicklable())
    with pytest.raises(CellError) as caught:
        parallel._in_worker((fail, 3, "cell 7 (fixed_conv, trec6, seed 3)", 1))
    message = str(pickle.loads(pickle.dumps(caught.value)))
    assert "cell 7 (fixed_conv, trec6, seed 3) failed" in message and "the compiler gave up" in message
    with pytest.raises(CellError, match=r"job [ab] failed(.|\n)*the compiler gave up"):  # through a real pool
        list(parallel.run_jobs(fail, [1, 2], ["job a", "job b"], workers=2))


def test_labels_must_match_the_jobs():
    with pytest.raises(ValueError, match="2 jobs but 1 labels"):
        list(parallel.run_jobs(describe, [1, 2], ["a"]))


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
        list(parallel.run_jobs(die, [1, 2, 3], ["a", "b", "c"], workers=2))


FINISHING_SCRIPT = """
import multiprocessing
from posattn.parallel import run_jobs
KEEP = []
def lock(job, in_worker):
    KEEP.append(multiprocessing.Lock())  # as tqdm's write lock in a worker that shows a bar
    return job
if __name__ == "__main__":
    assert list(run_jobs(lock, [1, 2, 3], ["a", "b", "c"], workers=2)) == [1, 2, 3]
"""


def _run_script(tmp_path, script: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "jobs.py").write_text(script)
    return subprocess.run([sys.executable, str(tmp_path / "jobs.py"), *args], capture_output=True, text=True,
                          timeout=300)


def test_workers_of_a_finished_sweep_exit_cleanly(tmp_path):
    """Terminated workers skip their exit finalizers: their semaphores leaked, and every recipe
    ended with "resource_tracker: There appear to be N leaked semaphore objects"."""
    done = _run_script(tmp_path, FINISHING_SCRIPT)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr


ORPHAN_SCRIPT = """
import os, signal, sys, threading, time
from pathlib import Path
from posattn.parallel import run_jobs
def sleep(job, in_worker):
    (Path(sys.argv[1]) / str(os.getpid())).touch()
    time.sleep(120)
def die_when_both_started():
    while len(list(Path(sys.argv[1]).iterdir())) < 2:
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)   # as a scheduler's kill -9 or the OOM killer
if __name__ == "__main__":
    threading.Thread(target=die_when_both_started, daemon=True).start()
    list(run_jobs(sleep, [1, 2], ["a", "b"], workers=2))
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
        deadline = time.monotonic() + 10 * parallel.WATCH_SECONDS + 5
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, pids)), "workers outlived the killed sweep"
    finally:
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)
