"""The mpnet cache: posattn replaces only an extraction of its own, never a folder a user put there."""
import pytest

from posattn.analysis.hf import CheckpointError, mpnet_path


def test_a_folder_posattn_did_not_create_is_never_deleted(tmp_path):
    user = tmp_path / "all-mpnet-base-v2"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="was not extracted by posattn; move it away"):
        mpnet_path(tmp_path)
    assert (user / "notes.txt").read_text() == "mine"
