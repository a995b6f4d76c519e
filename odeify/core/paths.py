"""The paths odeify reads and writes, checked where they enter: one rule for every reader and writer.

Every file a user names goes through here before anything is read or written: saved models
(``odeify.save``/``odeify.load``), checkpoints, the command line's ``-o``/``--out``/``--dot``/
``--plot``/``--markdown``, a fine-tuning run's folder and its training state.

- :func:`input_file` takes an existing regular file (or, where a reader takes folders, a
  directory) and says what anything else is: missing, a folder, a FIFO, a device, a socket, and
  where a link points.
- :func:`output_file` refuses what writing would destroy or what could not be read back: an empty
  path, an existing path that is not a regular file (writing replaces the path: ``-o /dev/null``
  would replace the device), a path that is also an input, a folder whose parent is a file, and,
  where a converted model is written, a suffix other than ``.safetensors``.
- :func:`output_folder` does the same for a folder that a run writes into.

No torch here: the command line's parser imports this module.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from odeify.core.errors import OdeifyError

__all__ = ["MODEL_SUFFIX", "describe_mode", "input_file", "output_file", "output_folder", "same_file"]

MODEL_SUFFIX = ".safetensors"  # what odeify.save writes and the odeify commands read as a converted model


def describe_mode(mode: int) -> str:
    """What a file of ``mode`` is, as a phrase: 'a regular file', 'a named pipe (FIFO)', ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory (a folder)"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def _as_path(path: object, what: str, example: str, error: type[OdeifyError]) -> Path:
    """``path`` as a Path (``~`` expanded); an empty or non-path value is refused."""
    if not isinstance(path, (str, os.PathLike)):
        raise error(f"{what} needs a file path such as {example!r}, not {type(path).__name__} {path!r:.80}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip():
        raise error(f"{what} needs a file path such as {example!r}; got an empty string")
    if "\0" in text:
        raise error(f"{what} {text!r:.80}: a path cannot hold a NUL character")
    return Path(text).expanduser()


def _linked(path: Path) -> str:
    """' (a link to TARGET)' when ``path`` is a symbolic link, else ''."""
    try:
        return f" (a link to {os.readlink(path)})" if path.is_symlink() else ""
    except OSError:
        return ""


def input_file(
    path: object,
    what: str = "the file",
    *,
    error: type[OdeifyError] = OdeifyError,
    folders: bool = False,
    example: str = "model.safetensors",
) -> Path:
    """``path`` if it is an existing regular file (a directory too, with ``folders``); else ``error``.

    The message says what the path is instead (missing, a folder, a FIFO, a device, a socket, and
    where a link points), so that nothing blocks on a pipe or reads a device.
    """
    target = _as_path(path, what, example, error)
    try:
        mode = target.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        dangling = f" (a link to {os.readlink(target)}, which does not exist)" if target.is_symlink() else ""
        raise error(
            f"{what} not found: {target} does not exist{dangling} (resolved: {target.resolve()})"
        ) from None
    except OSError as exc:
        raise error(f"cannot read {what} {target}: {exc.strerror or exc}") from None
    if stat.S_ISREG(mode) or (folders and stat.S_ISDIR(mode)):
        return target
    if stat.S_ISDIR(mode):
        raise error(f"{what} {target} is a directory (a folder), not a file")
    raise error(f"{what} {target} is {describe_mode(mode)}{_linked(target)}, not a regular file")


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name the same file (the same inode, or the same resolved path)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.expanduser().resolve() == b.expanduser().resolve()


def output_file(
    path: object,
    what: str = "the output",
    *,
    error: type[OdeifyError] = OdeifyError,
    inputs: Iterable[tuple[str, object]] = (),
    suffix: str | None = None,
    example: str = "model.safetensors",
) -> Path:
    """``path`` if writing a file there destroys nothing it should not; else ``error`` saying why.

    ``inputs``: (label, path) pairs of what the same command reads; an output equal to one of them
    is refused. ``suffix``: the one suffix the written file must have (``.safetensors`` for a
    converted model, which is what odeify reads back as one).
    """
    target = _as_path(path, what, example, error)
    try:
        mode = target.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # the parents are checked below
        mode = None
    except OSError as exc:
        raise error(f"cannot write {what} {target}: {exc.strerror or exc}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise error(f"{what} {target} is a folder (a directory); name a file in it, e.g. {target / example}")
    if mode is not None and not stat.S_ISREG(mode):
        raise error(
            f"{what} {target} is {describe_mode(mode)}{_linked(target)}, not a regular file: odeify writes a "
            f"file by replacing the path, which would replace it. Name a regular file."
        )
    _check_parents(target, what, error)
    for label, source in inputs:
        if source is not None and os.fspath(source) and same_file(target, Path(os.fspath(source))):
            raise error(
                f"{what} {target} is also the input ({label}); writing it would replace what is being read. "
                f"Name another file."
            )
    if suffix is not None and target.suffix != suffix:  # exact: the commands recognise '.safetensors' alone
        fixed = target.with_suffix(suffix) if target.suffix else target.with_name(target.name + suffix)
        raise error(
            f"{what} {target}: a converted model is written as a {suffix} file (what odeify.load and the "
            f"odeify commands read back); use {fixed}"
        )
    return target


def output_folder(
    path: object, what: str = "the output folder", *, error: type[OdeifyError] = OdeifyError
) -> Path:
    """``path`` if it is an existing folder or can be made one; else ``error`` saying what it is."""
    target = _as_path(path, what, "runs/finetune", error)
    try:
        mode = target.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        _check_parents(target, what, error)
        return target
    except OSError as exc:
        raise error(f"cannot use {what} {target}: {exc.strerror or exc}") from None
    if stat.S_ISREG(mode):
        raise error(f"{what} {target} is a file, not a folder; name a folder for the run's files")
    if not stat.S_ISDIR(mode):
        raise error(
            f"{what} {target} is {describe_mode(mode)}{_linked(target)}; name a folder for the run's files"
        )
    return target


def _check_parents(target: Path, what: str, error: type[OdeifyError]) -> None:
    """The nearest existing ancestor of ``target`` must be a folder."""
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise error(f"{what} {target}: {parent} is a file, not a folder")
            return
