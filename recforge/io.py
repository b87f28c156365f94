"""Atomic file-system writes: every artefact recforge writes appears whole or not at all."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces ``final`` when the block succeeds.

    On any exception the temporary directory is removed and ``final`` is untouched. An
    existing ``final`` is first renamed aside, so a crash between the two renames leaves
    the old copy (``.NAME.old-PID``) rather than nothing.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds its file is fsynced and
    renamed over ``path``. On any exception the temporary file is removed and ``path`` is untouched.

    Example:
        >>> with atomic_file(out) as tmp:
        ...     pq.write_table(table, tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, payload: dict) -> None:
    """Write JSON to a temporary file in the same directory, fsync, then rename over ``path``."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
