"""The fused kernels' build, without compiling anything (torch's builder is replaced): a build and a
wait for another process's build each say so on stderr with the time taken, a built folder loads
quietly, and the build folder is keyed by the environment so two environments never share one."""
from __future__ import annotations

import fcntl
import sys
import threading
import types
from pathlib import Path

import pytest

from posattn.attention import native

MODULE = types.ModuleType("posattn_native")


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """native.kernels() with a builder that records its calls and returns :data:`MODULE` at once."""
    calls = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "enabled", lambda: True)
    monkeypatch.setattr(native, "_load", lambda build: calls.append(build) or MODULE)
    native._kernels.cache_clear()
    yield calls
    native._kernels.cache_clear()


def test_a_first_build_says_so_and_a_built_folder_loads_quietly(fake_build, capsys):
    assert native.kernels() is MODULE
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("posattn: building posattn's fused CPU kernels (first use in this environment, about 1-3 "
                      "minutes)...")
    assert err[-1].startswith("posattn: fused CPU kernels built in ") and err[-1].endswith(" s")
    native._kernels.cache_clear()
    assert native.kernels() is MODULE and capsys.readouterr().err == ""   # the next process: built already
    assert len(fake_build) == 2   # torch's loader still runs (it rebuilds what changed)


def test_changed_sources_announce_a_rebuild(fake_build, capsys, monkeypatch):
    native.kernels()
    native._kernels.cache_clear()
    monkeypatch.setattr(native, "_digest", lambda: "-DPOSATTN_CSRC=changed")
    capsys.readouterr()
    native.kernels()
    assert "building posattn's fused CPU kernels" in capsys.readouterr().err


def test_a_long_build_ticks(fake_build, capsys, monkeypatch):
    monkeypatch.setattr(native, "TICK", 0.05)
    monkeypatch.setattr(native, "_load", lambda build: threading.Event().wait(0.3) or MODULE)
    native.kernels()
    assert "posattn: ... still building posattn's fused CPU kernels (" in capsys.readouterr().err


def test_waiting_for_another_process_says_so(fake_build, capsys):
    """Another process holds the build lock (an flock on a second open file behaves the same): this
    one says it waits, then loads what the other built."""
    build = native._build_directory()
    (build / native.STAMP).write_text(native._digest())       # what the other process will have built
    with open(build / "posattn.lock", "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        threading.Timer(0.3, fcntl.flock, (other, fcntl.LOCK_UN)).start()
        assert native.kernels() is MODULE
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("posattn: waiting for another process to build the fused CPU kernels (in ")
    assert err[-1].startswith("posattn: fused CPU kernels ready in ")
    assert not any("building" in line for line in err[1:])


def test_the_build_folder_is_keyed_by_the_environment(monkeypatch):
    key = native.build_key()
    assert key.startswith(f"posattn_native-py{sys.version_info.major}{sys.version_info.minor}-torch")
    assert native.build_key() == key                                   # stable within an environment
    monkeypatch.setattr(sys, "prefix", sys.prefix + "-other-venv")
    other = native.build_key()
    assert other != key                                                # another environment: another folder
    monkeypatch.setenv("CXX", "clang++")
    compiler = native.build_key()
    assert compiler not in (key, other)                                # another compiler: another binary
    monkeypatch.setattr(native, "CSRC", Path("/elsewhere/checkout/posattn/attention/csrc"))
    assert native.build_key() not in (key, other, compiler)            # another checkout's sources: another folder
