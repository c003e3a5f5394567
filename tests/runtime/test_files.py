import json
import threading

import pytest

from posattn.errors import PositionError
from posattn.runtime.files import check_name, write_json_atomic


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".hidden", "", "-rf", "a\\b", "x" * 201, None, 3])
def test_unsafe_names_are_refused(name):
    with pytest.raises(PositionError, match="cannot name a file or folder"):
        check_name(name, "label")


@pytest.mark.parametrize("name", ["cat_fair_mqar", "conv_qkv+composite", "lr=1e-4", "a.b-c"])
def test_safe_names_pass(name):
    assert check_name(name, "label") == name


def test_concurrent_writers_never_share_a_temporary_file(tmp_path):
    """Many threads write one file at once: every write lands whole, no temporary file is left."""
    target = tmp_path / "result.json"
    errors = []

    def writer(i):
        try:
            for _ in range(20):
                write_json_atomic(target, {"writer": i, "pad": "x" * 5000})
        except Exception as e:  # noqa: BLE001 - the test reports any failure
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert json.loads(target.read_text())["pad"] == "x" * 5000
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
