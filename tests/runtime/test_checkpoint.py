"""Checkpoints: tensors and plain data round-trip; anything else is refused without running it;
one config check names every key that differs."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from posattn.errors import PositionError
from posattn.runtime.checkpoint import check_config, load_checkpoint, save_checkpoint

from .payload import Payload, plant


def test_plain_checkpoint_round_trips(tmp_path):
    state = {"config": {"lr": 1e-3, "betas": (0.9, 0.99)}, "model": {"w": torch.randn(3, 2)}, "step": 7,
             "history": [{"step": 7, "loss": 0.5}], "rng": torch.get_rng_state(), "cuda_rng": None}
    save_checkpoint(tmp_path / "checkpoint.pt", state)
    back = load_checkpoint(tmp_path / "checkpoint.pt", ("config", "model"))
    assert back["config"] == state["config"] and back["history"] == state["history"]
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and torch.equal(back["rng"], state["rng"])
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]     # no temporary file left


def test_saving_anything_but_plain_data_is_a_bug(tmp_path):
    @dataclasses.dataclass
    class Settings:
        lr: float = 1.0

    with pytest.raises(TypeError, match=r"checkpoint\['config'\] is a .*Settings"):
        save_checkpoint(tmp_path / "c.pt", {"config": Settings()})
    with pytest.raises(TypeError, match=r"checkpoint\['history'\]\[1\] is a numpy"):
        save_checkpoint(tmp_path / "c.pt", {"config": {}, "history": [1.0, __import__("numpy").float64(2.0)]})
    assert not (tmp_path / "c.pt").exists()


def test_a_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "marker"
    path = plant(tmp_path / "run", marker)
    before = path.read_bytes()
    with pytest.raises(PositionError, match="unreadable .*objects other than tensors and plain data"):
        load_checkpoint(path)
    assert not marker.exists() and path.read_bytes() == before
    torch.load(path, weights_only=False)          # the payload is real: unpickled freely, it runs
    assert marker.exists()


def test_damaged_or_foreign_files_are_refused(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(PositionError, match="junk.pt is unreadable"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(PositionError, match="not a posattn checkpoint \\(a mapping with config, step\\)"):
        load_checkpoint(tmp_path / "list.pt", ("config", "step"))


def test_config_check_names_every_key_that_differs():
    check_config({"lr": 1.0, "steps": 2, "workers": 1}, {"lr": 1.0, "steps": 2, "workers": 4}, "c.pt",
                 ignore=("workers",))
    with pytest.raises(PositionError, match=r"c.pt was written with a different config "
                                            r"\(lr: 1.0 -> 2.0; new: '\(absent\)' -> 3; old: 1 -> '\(absent\)'\)"):
        check_config({"lr": 1.0, "old": 1}, {"lr": 2.0, "new": 3}, "c.pt")


def test_payload_class_is_what_it_claims(tmp_path):
    """The test's own payload: pickling then unpickling it opens (creates) the marker file."""
    import pickle

    pickle.loads(pickle.dumps(Payload(tmp_path / "m")))
    assert (tmp_path / "m").exists()
