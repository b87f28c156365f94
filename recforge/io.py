"""Atomic file-system writes: every artefact recforge writes appears whole or not at all.

Everything written is given the permissions the process umask allows before it is renamed into
place (``tempfile`` makes files 0600 and directories 0700, and so do some writers, e.g.
safetensors: a serving process under another user, or a container running as non-root, could
not read a dataset, checkpoint or exported model). Temporary names carry
the host, its PID namespace where there is one, and the process id
(``.NAME.tmp-HOST-nsINODE-PID-RANDOM``), so the next write to the same target removes what a
killed writer of this host and namespace left behind (containers sharing a hostname have their
own PIDs: their entries are left alone).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


STALE_GRACE_S = 600  # an entry named without a PID namespace is judged stale only this long after its last change


def _hostname() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _host() -> str:
    """The writer tag of temporary names: the hostname, and the PID namespace's inode where there is one."""
    try:
        return f"{_hostname()}-ns{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc (macOS, Windows): no PID namespaces either
        return _hostname()


def _temp_name(final: Path, kind: str) -> Path:
    return final.with_name(f".{final.name}.{kind}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}")


def _writer_is_gone(entry: Path) -> bool:
    """True when a ``.NAME.tmp-HOST-nsINODE-PID-RAND`` entry was left by a process of this host and PID
    namespace that no longer runs. An entry named without a namespace (an older recforge's) may be a
    live writer's in another container of the same hostname: stale only if its pid is not running
    here and it has not changed for ``STALE_GRACE_S``."""
    m = re.search(r"\.(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]+$", entry.name)
    if m is None:
        return False
    tag = _host()
    if m.group("host") != tag:
        untagged = m.group("host") == _hostname() and tag != _hostname()
        if not untagged:
            return False  # another host's or another namespace's writer (a shared file system): leave it
        try:
            if entry.lstat().st_mtime > time.time() - STALE_GRACE_S:
                return False
        except OSError:
            return False
    pid = int(m.group("pid"))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.ESRCH
    return False


def clean_stale_temporaries(final: Path) -> None:
    """Remove the temporary siblings of ``final`` that a killed writer of this host (and PID namespace) left behind.

    A renamed-aside old copy (``.NAME.old-...``) is put back when ``final`` is missing (the writer
    died between its two renames), otherwise removed.
    """
    final = Path(final)
    if not final.parent.is_dir():
        return
    for entry in sorted(final.parent.glob(f".{glob_escape(final.name)}.*-*")):
        kind = entry.name[len(final.name) + 2 :].split("-", 1)[0]
        if kind not in ("tmp", "old") or not _writer_is_gone(entry):
            continue
        if kind == "old" and not final.exists():
            os.replace(entry, final)
            log.warning("restored %s from %s (a writer was killed while replacing it)", final, entry.name)
            continue
        log.info("removing %s (left by a killed writer)", entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def make_temp_dir(final: Path) -> Path:
    """Create and return an empty temporary directory beside ``final`` (mode 0777 minus the umask)."""
    final = Path(final)
    while True:
        tmp = _temp_name(final, "tmp")
        try:
            tmp.mkdir(mode=0o777)
            return tmp
        except FileExistsError:
            continue


def _make_temp_file(final: Path) -> Path:
    while True:
        tmp = _temp_name(final, "tmp")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:
            continue


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask can only be read by setting it, racing other threads)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _allow_umask(path: str | Path, mask: int) -> None:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would have: 0666 (0777 for directories and
    executables) minus the umask."""
    mode = os.stat(path, follow_symlinks=False).st_mode
    if stat.S_ISLNK(mode):
        return
    full = 0o777 if stat.S_ISDIR(mode) or mode & 0o111 else 0o666
    os.chmod(path, full & ~mask)


def _finish_tree(root: Path) -> None:
    """fsync every file under ``root`` and give everything the umask's permissions."""
    mask = _umask()
    for dirpath, _, files in os.walk(root):
        _allow_umask(dirpath, mask)
        for name in files:
            path = os.path.join(dirpath, name)
            _allow_umask(path, mask)
            if os.path.islink(path):
                continue
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def check_replaceable(final: Path, owned: Iterable[str], what: str) -> None:
    """Refuse to replace ``final`` when it holds entries recforge did not write there.

    ``--overwrite`` replaces a whole directory; anything else inside it (a ``notes.txt``, another
    tool's output) would be deleted with it, so it must be moved away first.
    """
    final = Path(final)
    if not final.exists():
        return
    if not final.is_dir():
        raise ValueError(f"{final} exists and is not a directory; --overwrite replaces only a {what} directory")
    owned = set(owned)
    ours = re.compile(r"\..+\.(tmp|old)-")  # what a killed atomic write inside it left
    foreign = sorted(p.name for p in final.iterdir() if p.name not in owned and not ours.match(p.name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"{final} holds files that are not part of a {what} ({shown}); --overwrite replaces the "
                         "whole directory and would delete them: move them elsewhere first, or choose another --out")  # fmt: skip


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces ``final`` when the block succeeds.

    On any exception the temporary directory is removed and ``final`` is untouched. The files are
    fsynced before the rename; an existing ``final`` is first renamed aside, so a crash between the
    two renames leaves the old copy (``.NAME.old-...``, restored by the next write) rather than nothing.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(final)
    tmp = make_temp_dir(final)
    try:
        yield tmp
        _finish_tree(tmp)
        if final.exists():
            old = _temp_name(final, "old")
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
    clean_stale_temporaries(path)
    tmp = _make_temp_file(path)
    try:
        yield tmp
        _allow_umask(tmp, _umask())  # a writer may have replaced the file with a private one
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
