"""Folders written whole: a reader sees the old folder or the new one; a failed write changes nothing."""
from __future__ import annotations

import pytest

from posattn.runtime.folders import replace_folder


def test_a_folder_is_replaced_whole_and_a_failed_write_keeps_the_old_one(tmp_path):
    target = tmp_path / "model"
    replace_folder(target, lambda d: (d / "a.txt").write_text("one"))
    assert (target / "a.txt").read_text() == "one"

    def half(d):
        (d / "a.txt").write_text("two")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_folder(target, half)
    assert (target / "a.txt").read_text() == "one"
    replace_folder(target, lambda d: (d / "b.txt").write_text("two"))
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]       # no temporary folder left behind
