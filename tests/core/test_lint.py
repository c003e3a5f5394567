"""ruff (pyflakes, pycodestyle, import order, bugbear, pyupgrade; settings in pyproject.toml) finds
nothing in the package and the tests: CI lints through this test."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.fail("ruff is not installed: it is part of the test extra (scripts/install.sh test)")
    proc = subprocess.run([ruff, "check", "--no-cache", "posattn", "tests"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
