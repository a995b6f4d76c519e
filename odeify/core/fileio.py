"""Atomic file writes: a failed or interrupted write never destroys the file already at the path.

Checkpoints, benchmark results and plots are all written through here: the data goes to a temporary
file in the target's own folder (same file system, so the final rename is atomic), is fsynced, and
only then replaces the target with ``os.replace``. A temporary file left by a killed writer is
removed by the next write to the same target.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_bytes", "remove_stale_temps"]


STALE_AFTER_S = 24 * 3600  # a temp file this old is left over even if its writer's pid was reused


def _temp_name(target: Path) -> Path:
    """A hidden, unique sibling of ``target`` that keeps its suffix (writers infer formats from it).

    The writer's host and pid are part of the name, so a later write can tell a live writer's file
    from one left by a killed process.
    """
    return target.with_name(f".{target.stem}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}{target.suffix}")


def remove_stale_temps(target: Path) -> list[Path]:
    """Delete temporary siblings of ``target`` whose writer is gone (killed mid-write); return them.

    A temp file is stale when it was written on this host by a process that no longer runs, or it is
    older than ``STALE_AFTER_S`` (a reused pid, another host), or it has no writer in its name (older
    odeify) and predates this process.
    """
    pattern = re.compile(
        rf"\.{re.escape(target.stem)}\.tmp-(?:([0-9a-f]{{8}})-(\d+)-)?[0-9a-f]{{8}}{re.escape(target.suffix)}"
    )
    removed = []
    try:
        siblings = list(target.parent.iterdir())
    except OSError:
        return removed
    for path in siblings:
        match = pattern.fullmatch(path.name)
        if match is None:
            continue
        try:
            age = time.time() - path.lstat().st_mtime
        except OSError:
            continue
        host, pid = match.group(1), int(match.group(2)) if match.group(2) else None
        if host == _HOST and pid == os.getpid():
            continue  # this process's own writes in flight
        dead = host == _HOST and pid is not None and not _alive(pid)
        if dead or age > STALE_AFTER_S or (host is None and age > time.time() - _STARTED):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


_STARTED = time.time()
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _fsync_file(path: Path) -> None:
    """Flush a written file's data to disk, so the rename below cannot expose a half-written file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    """Persist a rename in ``folder`` (best effort: not every platform can open a directory)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path to write to; on success it replaces ``path``, on error it is deleted.

    The temporary file already exists (empty) when the block starts, reserving its name; writers may
    overwrite it freely. An existing target keeps its permission bits. The parent folder is created
    if missing.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)
    while True:
        tmp = _temp_name(target)
        try:
            # O_EXCL reserves a fresh name; mode 0o666 lets the umask decide, as for a plain open().
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        _fsync_file(tmp)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: readers see the old file or the complete new one."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
