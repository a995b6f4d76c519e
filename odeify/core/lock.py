"""One writer per folder: the lock a fine-tuning run holds on its ``--out`` folder while it runs.

Two runs writing into one folder would interleave their checkpoints (the last writer wins each
file). :func:`folder_lock` takes an exclusive ``flock`` on ``FOLDER/.odeify.lock`` and writes the
holder's host and pid into it. The kernel drops a ``flock`` when its process dies, however it dies,
so a lock file left by a killed run is not held: the next run takes it over (and says whose it
was). A second run while the first is alive is refused, naming the first's pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from odeify.core.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking, as before
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "check_free", "folder_lock"]

LOCK_FILE = ".odeify.lock"


@contextlib.contextmanager
def folder_lock(folder: Path, on_takeover=None) -> Iterator[None]:
    """Hold the lock on ``folder`` (created if missing) for the block; ConfigError if another process has it.

    ``on_takeover(previous)`` is called with the previous holder's record ({"host", "pid"}) when a
    lock left by a process that no longer holds it is taken over.
    """
    if fcntl is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    fd = _locked(path, folder)
    try:
        previous = _holder(fd)
        if previous and on_takeover is not None:
            on_takeover(previous)
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                path.unlink()  # while still holding it: a waiting opener then finds its inode gone
    finally:
        os.close(fd)  # releases the flock


def _locked(path: Path, folder: Path) -> int:
    """An open descriptor of ``path`` holding its exclusive flock; ConfigError if another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise _held(folder, holder) from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            return fd
        os.close(fd)  # the holder before us removed this file as we opened it: lock the new one


def check_free(folder: Path) -> None:
    """Refuse, naming the holder, when a live run holds ``folder``'s lock (before reading what it writes)."""
    if fcntl is None:
        return
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return  # no lock file: no run has it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with a holder's exclusive lock only
    except BlockingIOError:
        raise _held(folder, _holder(fd)) from None
    finally:
        os.close(fd)


def _held(folder: Path, holder: dict) -> ConfigError:
    return ConfigError(
        f"another fine-tuning run (pid {holder.get('pid', '?')} on {holder.get('host', 'this host')}, "
        f"holding {folder / LOCK_FILE}) is writing to {folder}; two runs in one folder would overwrite each "
        "other's checkpoints. Wait for it to finish, stop it, or pass another --out folder."
    )


def _holder(fd: int) -> dict:
    """The record a lock file holds ({} when empty or unreadable)."""
    try:
        data = os.pread(fd, 4096, 0)
        record = json.loads(data.decode()) if data else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
