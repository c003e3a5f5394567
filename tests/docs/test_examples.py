"""Every script in ``examples/`` runs at tiny size (``--tiny``) in a fresh process, as a user would
run it, and documents itself: a module docstring (the generated Examples page shows it) and a
``--tiny`` option."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posattn import docs_gen

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NEEDS = {"retrofit_bert.py": "transformers"}   # an example that needs an extra
# what each example must print at tiny size (its checks, not its scores)
PRINTS = {"retrofit_bert.py": ["outputs unchanged by the added mechanism: True",
                               "saved and reloaded with the mechanism: True"],
          "synthetic_recall.py": ["validation accuracy by step: 1: ", "accuracy at length 32 (trained)",
                                  "accuracy at length 64 (longer)"],
          "positional_profile.py": ["t5             Toeplitz R² per head (layer 0): [1. 1.]"]}


def test_there_are_examples_and_each_is_on_the_examples_page() -> None:
    assert len(EXAMPLES) >= 3 and {p.name for p in EXAMPLES} == set(PRINTS)
    page = docs_gen.examples_page(ROOT)
    for path in EXAMPLES:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and "--tiny" in doc, f"{path.name}: needs a module docstring that shows --tiny"
        assert f"## `examples/{path.name}`" in page


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_at_tiny_size(path: Path, tmp_path: Path) -> None:
    if path.name in NEEDS:
        pytest.importorskip(NEEDS[path.name])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(path), "--tiny"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in PRINTS.get(path.name, []):
        assert line in proc.stdout, f"{path.name}: {line!r} not in its output:\n{proc.stdout[-2000:]}"
    assert list(tmp_path.iterdir()) == [], f"{path.name} wrote into the working directory"
