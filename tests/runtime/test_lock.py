"""One writer per run folder: a second process gets one clear error; the lock frees with its holder."""
from __future__ import annotations

import re

import pytest

from posattn.errors import PositionError
from posattn.runtime.lock import run_lock

from .holder import Holder


def test_a_second_process_gets_an_error_naming_the_folder_and_the_holder(tmp_path):
    folder = tmp_path / "run"
    with Holder(folder) as pid:
        refused = rf"{re.escape(str(folder))} is in use by another run \(process {pid}\)"
        with pytest.raises(PositionError, match=refused), run_lock(folder):
            pass
    with run_lock(folder):                       # the holder has exited: the lock is free again
        assert (folder / ".lock").read_text() != f"{pid}\n"


def test_the_lock_is_reentrant_within_one_process(tmp_path):
    with run_lock(tmp_path / "run"):
        with run_lock(tmp_path / "run"):        # a cell runner and the loop it calls both take it
            pass
        with Holder(tmp_path / "other"):          # other folders are independent
            pass
    with Holder(tmp_path / "run"):                # released after the outer block
        pass
