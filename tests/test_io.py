"""Atomic writes: the target appears whole or not at all, and a failed write leaves no temporary file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recforge.io import atomic_directory, atomic_file, atomic_write_json


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
