"""Atomic writes: the target appears whole or not at all, and a failed write leaves no temporary file."""

from __future__ import annotations

import json
import re
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recforge.io import _host, atomic_directory, atomic_file, atomic_write_json, check_replaceable, clean_stale_temporaries


def test_atomic_file_replaces_on_success_and_keeps_the_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "out.bin"
    with atomic_file(target) as tmp:
        assert tmp.parent == target.parent and tmp != target
        tmp.write_bytes(b"first")
    assert target.read_bytes() == b"first"
    with pytest.raises(RuntimeError, match="boom"), atomic_file(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("boom")
    assert target.read_bytes() == b"first"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.bin"]


def test_atomic_write_json_and_directory(tmp_path: Path) -> None:
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}
    with pytest.raises(ValueError), atomic_directory(tmp_path / "d") as tmp:
        (tmp / "f").write_text("partial")
        raise ValueError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    with atomic_directory(tmp_path / "d") as tmp:
        (tmp / "f").write_text("whole")
    assert (tmp_path / "d" / "f").read_text() == "whole"


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_every_atomic_write_follows_the_umask(tmp_path: Path, umask_022) -> None:
    """tempfile makes 0600 files and 0700 directories; the renamed artefact must be readable by others."""
    with atomic_file(tmp_path / "f.bin") as tmp:
        tmp.write_bytes(b"x")
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    with atomic_directory(tmp_path / "d") as tmp:
        (tmp / "inner.bin").write_bytes(b"y")
        os.close(os.open(tmp / "private.bin", os.O_CREAT | os.O_WRONLY, 0o600))  # as safetensors' save_file does
        (tmp / "sub").mkdir(mode=0o700)
    assert stat.S_IMODE((tmp_path / "d" / "private.bin").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "d" / "sub").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "f.bin").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "d" / "inner.bin").stat().st_mode) == 0o644
    os.umask(0o077)
    atomic_write_json(tmp_path / "private.json", {"x": 1})
    assert stat.S_IMODE((tmp_path / "private.json").stat().st_mode) == 0o600


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_a_killed_writer_are_cleaned(tmp_path: Path) -> None:
    host, pid = _host(), _dead_pid()
    stale = tmp_path / f".d.tmp-{host}-{pid}-0abc1234"
    stale.mkdir()
    (stale / "half.parquet").write_bytes(b"partial")
    alive = tmp_path / f".d.tmp-{host}-{os.getppid()}-0abc1234"  # a live writer's: kept
    alive.mkdir()
    other_host = tmp_path / f".d.tmp-elsewhere-{pid}-0abc1234"  # another host's (shared file system): kept
    other_host.mkdir()
    with atomic_directory(tmp_path / "d") as tmp:
        (tmp / "f").write_text("whole")
    assert not stale.exists() and alive.exists() and other_host.exists()
    file_left = tmp_path / f".x.json.tmp-{host}-{pid}-0abc1234"
    file_left.write_text("{")
    atomic_write_json(tmp_path / "x.json", {"a": 1})
    assert not file_left.exists()


def test_an_old_copy_aside_is_restored_when_the_writer_died_between_renames(tmp_path: Path) -> None:
    old = tmp_path / f".d.old-{_host()}-{_dead_pid()}-0abc1234"
    old.mkdir()
    (old / "f").write_text("previous")
    clean_stale_temporaries(tmp_path / "d")
    assert (tmp_path / "d" / "f").read_text() == "previous" and not old.exists()


def test_check_replaceable_refuses_foreign_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "events.parquet").write_bytes(b"")
    check_replaceable(out, ["events.parquet"], "dataset")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"notes\.txt.*move them"):
        check_replaceable(out, ["events.parquet"], "dataset")


def test_leftovers_of_another_pid_namespace_on_the_same_hostname_are_kept(tmp_path: Path) -> None:
    """Containers sharing a hostname have their own PIDs: a pid that is dead here may be a live writer there."""
    import socket

    hostname, pid = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host", _dead_pid()
    if not Path("/proc/self/ns/pid").exists():
        pytest.skip("no PID namespaces here")
    other_ns = tmp_path / f".d.tmp-{hostname}-ns{os.stat('/proc/self/ns/pid').st_ino + 1}-{pid}-0abc1234"
    other_ns.mkdir()
    legacy_fresh = tmp_path / f".d.old-{hostname}-{pid}-0abc1234"  # an untagged name: could be any namespace's
    legacy_fresh.mkdir()
    clean_stale_temporaries(tmp_path / "d")
    assert other_ns.exists() and legacy_fresh.exists() and not (tmp_path / "d").exists()
    hour_ago = time.time() - 3600  # an untagged leftover past the grace period, its writer gone: stale
    os.utime(legacy_fresh, (hour_ago, hour_ago))
    clean_stale_temporaries(tmp_path / "d")
    assert other_ns.exists() and not legacy_fresh.exists() and (tmp_path / "d").is_dir()  # the old copy restored
