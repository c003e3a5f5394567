import json

import pytest

from posattn.errors import PositionError
from posattn.experiments import store

PROV = {"date": "2026-11-26", "hardware": "test", "command": "posattn compare tiny"}


def test_publish_load_and_merge_by_id(tmp_path):
    assert store.publish("tiny", "abc123", {"accuracy": 0.5}, PROV, root=tmp_path)
    assert not store.publish("tiny", "abc123", {"accuracy": 0.9}, PROV, root=tmp_path)   # first result stands
    assert store.publish("tiny", "def456", {"accuracy": 0.7}, PROV, root=tmp_path)
    records = store.load("tiny", root=tmp_path)
    assert [(r["id"], r["result"]["accuracy"]) for r in records] == [("abc123", 0.5), ("def456", 0.7)]
    assert store.recipes(tmp_path) == ["tiny"]
    assert store.load("absent", root=tmp_path) == []


def test_names_cannot_leave_the_store(tmp_path):
    with pytest.raises(PositionError, match="cannot name"):
        store.publish("../outside", "abc", {}, PROV, root=tmp_path)
    with pytest.raises(PositionError, match="cannot name"):
        store.publish("tiny", "../../abc", {}, PROV, root=tmp_path)
    assert not any(tmp_path.parent.glob("outside*"))


def test_bad_records_and_provenance_are_refused(tmp_path):
    with pytest.raises(PositionError, match="provenance lacks hardware"):
        store.publish("tiny", "a", {}, {"date": "2026-11-26", "command": "x"}, root=tmp_path)
    with pytest.raises(PositionError, match="over"):
        store.publish("tiny", "a", {"big": "x" * (store.MAX_BYTES + 1)}, PROV, root=tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "zzz.json").write_text(json.dumps({"recipe": "tiny"}))
    with pytest.raises(PositionError, match="zzz.json is not a store record"):
        store.load("tiny", root=tmp_path)


def test_provenance_names_date_hardware_command():
    prov = store.provenance("posattn compare", device="cpu")
    assert set(prov) >= {"date", "hardware", "command"} and "cores" in prov["hardware"]
