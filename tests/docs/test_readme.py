"""Every python and bash block of README.md runs, at tiny sizes, as a user would run it.

Each block runs in its own empty folder, in a fresh process, against this checkout: ``posattn`` and
``python`` on the PATH are this interpreter with the repository first on ``PYTHONPATH``. Comment
lines directly above a block's fence adjust it, visibly in the README's source:

- ``<!-- readme-test: skip: REASON -->``: the block is not run (it installs packages or runs for
  minutes); the reason is part of the test's name so that every skip is listed with it;
- ``<!-- readme-test: replace "OLD" "NEW" -->``: literal substitution before running (tiny sizes).
  ``$README_TESTS`` in NEW is this folder.

Blocks that read "your own text" (``my_texts/``) find a folder of generated documents there.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")
REPLACE = re.compile(r'^replace\s+"((?:[^"\\]|\\.)*)"\s+"((?:[^"\\]|\\.)*)"$')
RUN = ("python", "bash")
WORDS = ("the cat dog bird sees chases likes a small big red green house tree river near over under quickly "
         "slowly runs sleeps eats and but then").split()


@dataclass
class Block:
    line: int
    lang: str
    code: str
    skip: str | None = None
    replace: list[tuple[str, str]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"line{self.line}-{self.lang}" + (f"-skip({self.skip})" if self.skip else "")


def blocks(text: str) -> list[Block]:
    """The README's fenced blocks with the markers written directly above each."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, body = i, []
        i += 1
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        block = Block(start + 1, fence.group(1), "\n".join(body) + "\n")
        j = start - 1
        while j >= 0 and MARKER.search(lines[j]):
            directive = MARKER.search(lines[j]).group(1)
            if directive.startswith("skip:"):
                block.skip = directive[len("skip:"):].strip()
            elif m := REPLACE.match(directive):
                block.replace.insert(0, (m.group(1), m.group(2)))
            else:
                raise AssertionError(f"README line {j + 1}: unknown readme-test marker {directive!r}")
            j -= 1
        out.append(block)
        i += 1
    return out


README_BLOCKS = [b for b in blocks((ROOT / "README.md").read_text()) if b.lang in RUN]


def test_markers_parse_and_apply() -> None:
    """The marker grammar: a skip with its reason, replacements in order, markers bound to the next fence only."""
    text = ('<!-- readme-test: replace "a b" "c" -->\n<!-- readme-test: replace "c" "d" -->\n```bash\na b\n```\n'
            'prose\n<!-- readme-test: skip: too long -->\n```python\nx\n```\n```bash\ny\n```\n')
    first, second, third = blocks(text)
    assert first.replace == [("a b", "c"), ("c", "d")] and first.skip is None
    assert second.skip == "too long" and not second.replace
    assert third.skip is None and not third.replace
    assert _substituted(first) == "d\n"


def _substituted(block: Block) -> str:
    code = block.code
    for old, new in block.replace:
        assert old in code, f"README line {block.line}: replace marker {old!r} matches nothing in its block"
        code = code.replace(old, new.replace("$README_TESTS", str(HERE)))
    return code


def _texts(folder: Path) -> None:
    """A folder of generated documents standing for the reader's own text."""
    rng = random.Random(0)
    folder.mkdir()
    for d in range(120):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                     for _ in range(rng.randint(6, 14))]
        (folder / f"doc{d:03d}.txt").write_text(" ".join(sentences) + "\n")


@pytest.mark.parametrize("block", README_BLOCKS, ids=[b.id for b in README_BLOCKS])
def test_readme_block_runs(block: Block, tmp_path: Path) -> None:
    if block.skip:
        pytest.skip(f"README line {block.line}: {block.skip}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "posattn").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m posattn.cli "$@"\n')
    (bin_dir / "posattn").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    work = tmp_path / "work"
    work.mkdir()
    _texts(work / "my_texts")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    code = _substituted(block)
    command = ["bash", "-euo", "pipefail", "-c", code] if block.lang == "bash" else [sys.executable, "-c", code]
    proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (f"README line {block.line} failed:\n{code}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def test_readme_mechanism_table_names_every_mechanism() -> None:
    """The README's mechanism table is hand-written: it must name exactly the registered mechanisms."""
    from posattn.mechanisms import names

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Mechanisms"):]
    section = section[:section.index("\n## ", 1)]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert sorted(listed) == sorted(names()), (set(names()) ^ set(listed))
