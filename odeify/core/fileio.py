"""Files in and out: atomic writes, and the one reader of safetensors files and their JSON metadata.

Writing: checkpoints, saved models, training states, benchmark results and plots all go through
:func:`atomic_path`: the data goes to a temporary file in the target's own folder (same file system,
so the final rename is atomic), is fsynced, and only then replaces the target with ``os.replace``.
A temporary file left by a killed writer is removed by the next write to the same target. A failed
write names the file it could not write.

Reading: saved models, checkpoints and training states are safetensors files whose metadata holds
JSON; :func:`read_header`, :func:`read_tensors` and :func:`read_json` read them for every caller,
with the caller's error type and words. A duplicate key is refused (a plain reader keeps the last
value without a word). ``NaN``, ``Infinity`` and overflowing numbers are read as the floats they
are, for the caller's schema to refuse by name: every number a schema reads is checked to be finite.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from odeify.core.errors import OdeifyError

if TYPE_CHECKING:
    import torch

__all__ = [
    "SafetensorsHeader",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_tensors",
    "is_temp_of",
    "read_header",
    "read_json",
    "read_tensors",
    "remove_stale_temps",
]


STALE_AFTER_S = 24 * 3600  # a temp file this old is left over even if its writer's pid was reused


def _temp_name(target: Path) -> Path:
    """A hidden, unique sibling of ``target`` that keeps its suffix (writers infer formats from it).

    The writer's host and pid are part of the name, so a later write can tell a live writer's file
    from one left by a killed process.
    """
    return target.with_name(
        f".{_temp_stem(target)}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}{target.suffix}"
    )


NAME_MAX = 255  # bytes of a file name on Linux and macOS file systems
_TEMP_EXTRA = len(".") + len(".tmp-") + 8 + 1 + 10 + 1 + 8  # the temp name's other parts (a pid to 10 digits)


def _temp_stem(target: Path) -> str:
    """``target``'s stem, cut so that its temporary's name fits in NAME_MAX bytes: a legal name of 252
    characters must not fail with "File name too long" about a name the user never gave."""
    room = NAME_MAX - _TEMP_EXTRA - len(target.suffix.encode("utf-8", "surrogateescape"))
    return target.stem.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")


def _temp_pattern(target: Path) -> re.Pattern[str]:
    """The names :func:`_temp_name` gives ``target``'s temporaries (host and pid absent in older odeify)."""
    return re.compile(
        rf"\.{re.escape(_temp_stem(target))}\.tmp-(?:([0-9a-f]{{8}})-(\d+)-)?[0-9a-f]{{8}}{re.escape(target.suffix)}"
    )


def is_temp_of(name: str, target: Path) -> bool:
    """Whether a file called ``name`` is a temporary an atomic write of ``target`` made."""
    return _temp_pattern(target).fullmatch(name) is not None


def remove_stale_temps(target: Path) -> list[Path]:
    """Delete temporary siblings of ``target`` whose writer is gone (killed mid-write); return them.

    A temp file is stale when it was written on this host by a process that no longer runs, or it is
    older than ``STALE_AFTER_S`` (a reused pid, another host), or it has no writer in its name (older
    odeify) and predates this process.
    """
    pattern = _temp_pattern(target)
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
        except OSError as exc:  # a read-only folder, ...: name the target, not the hidden temporary name
            raise OSError(exc.errno, exc.strerror or str(exc), str(target)) from exc
    try:
        yield tmp
        _fsync_file(tmp)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        os.replace(tmp, target)
    except OSError as exc:  # no space, a file-size limit (EFBIG), ...: name the file, not only the reason
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if exc.filename is not None and Path(exc.filename) != tmp:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(target)) from exc
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


def atomic_write_tensors(
    path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write ``tensors`` (CPU, contiguous, none sharing memory) and ``metadata`` as a safetensors file
    at ``path``, atomically, straight from the tensors' memory: ``safetensors.torch.save`` builds the
    whole file in memory first, twice the tensors' bytes at its peak. An I/O error is the OSError it
    was (safetensors reports it as a SafetensorError naming the OS error's number)."""
    import safetensors.torch
    from safetensors import SafetensorError

    with atomic_path(path) as tmp:
        try:
            safetensors.torch.save_file(tensors, tmp, metadata=metadata)
        except SafetensorError as exc:
            code = re.search(r"\(os error (\d+)\)", str(exc))
            if code is None:
                raise
            raise OSError(int(code[1]), os.strerror(int(code[1])), str(tmp)) from exc


# ---------------------------------------------------------------------------------------------------
# Reading safetensors files and their JSON metadata


@dataclass(frozen=True)
class SafetensorsHeader:
    """What a safetensors file says before its tensors are read: string metadata, tensor shapes and dtypes."""

    metadata: dict[str, str]
    tensors: dict[str, tuple[tuple[int, ...], str]]


def read_header(path: Path, error: type[OdeifyError], describe: str) -> SafetensorsHeader:
    """The header of the safetensors file at ``path``; ``error("PATH is not DESCRIBE: ...")`` if not one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {}
            for key in handle.keys():
                piece = handle.get_slice(key)
                tensors[key] = (tuple(piece.get_shape()), str(piece.get_dtype()))
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise error(f"{path} is not {describe}: {exc}") from exc
    return SafetensorsHeader(metadata, tensors)


def read_tensors(path: Path, error: type[OdeifyError], describe: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at ``path``, on the CPU."""
    import safetensors.torch

    try:
        return safetensors.torch.load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise error(f"{path}: the tensors of {describe} cannot be read ({exc}); the file is damaged") from exc


class _Refused(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _Refused(f"the key {key!r:.60} appears twice in one object")
        found[key] = value
    return found


def read_json(
    text: object, where: str, error: type[OdeifyError], max_bytes: int, what: str = "the JSON"
) -> Any:
    """``text`` (at most ``max_bytes``) parsed as JSON whose objects hold each key once."""
    if not isinstance(text, str) or len(text) > max_bytes:
        raise error(f"{where}: {what} is not a string of at most {max_bytes} bytes")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _Refused as exc:
        raise error(f"{where}: {what} is refused: {exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, an integer of over 4300 digits
        raise error(f"{where}: {what} is not valid JSON ({exc})") from None
