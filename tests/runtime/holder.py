"""Another process holding a run folder's lock, for tests of what a second writer sees."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import posattn

SCRIPT = """
import sys, time
from pathlib import Path
from posattn.runtime.lock import run_lock
folder, ready, go = map(Path, sys.argv[1:4])
with run_lock(folder):
    ready.touch()
    while not go.exists():
        time.sleep(0.02)
"""


def python_env() -> dict[str, str]:
    """The environment for a child Python that imports this checkout's posattn."""
    root = str(Path(posattn.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 60) -> None:
    """Wait until ``path`` exists (the child reached its point), failing if the child died first."""
    end = time.monotonic() + seconds
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the child process ended ({process.returncode}): {process.stderr.read()}")
        if time.monotonic() > end:
            raise AssertionError(f"the child process did not reach {path.name} in {seconds} s")
        time.sleep(0.02)


class Holder:
    """``with Holder(folder) as pid:``: a child process holds ``folder``'s lock until the block ends."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.ready = self.folder.parent / f"{self.folder.name}.ready"
        self.go = self.folder.parent / f"{self.folder.name}.go"

    def __enter__(self) -> int:
        self.process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(self.folder), str(self.ready), str(self.go)],
                                        env=python_env(), stderr=subprocess.PIPE, text=True)
        wait_for(self.ready, self.process)
        return self.process.pid

    def __exit__(self, *exc: object) -> None:
        self.go.touch()
        assert self.process.wait(60) == 0, self.process.stderr.read()
