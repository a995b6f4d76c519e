"""Atomic file writes: a failed or interrupted write never destroys the file already at the path.

Checkpoints, benchmark results and plots are all written through here: the data goes to a temporary
file in the target's own folder (same file system, so the final rename is atomic), is fsynced, and
only then replaces the target with ``os.replace``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_bytes"]


def _temp_name(target: Path) -> Path:
    """A hidden, unique sibling of ``target`` that keeps its suffix (writers infer formats from it)."""
    return target.with_name(f".{target.stem}.tmp-{secrets.token_hex(4)}{target.suffix}")


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
