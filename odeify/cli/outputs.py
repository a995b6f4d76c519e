"""The files a command writes, checked before any work: a path that can be written, not one of the
command's inputs, and two outputs that are two files."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from odeify.core.errors import ConfigError
from odeify.core.paths import MODEL_SUFFIX, output_file, same_file

__all__ = ["checked_output_file", "distinct_outputs"]


def checked_output_file(
    path: str | None, what: str = "-o", args: argparse.Namespace | None = None, *, model: bool = False
) -> Path | None:
    """Check an output path before any work (:func:`odeify.core.paths.output_file`): not empty, not a
    folder, FIFO or device, its parent not a file, not one of the command's inputs; ``model``: a
    ``.safetensors`` file."""
    if path is None:
        return None
    inputs = _inputs(args) if args is not None else []
    return output_file(
        path, what, error=ConfigError, inputs=inputs, suffix=MODEL_SUFFIX if model else None,
        example="model.safetensors" if model else "out.png",
    )  # fmt: skip


def _inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The files the command reads (MODEL when it is a path, --checkpoint), as (label, path)."""
    found = []
    model = getattr(args, "model", None)
    if model and os.path.lexists(model):
        found.append(("MODEL", model))
    if getattr(args, "checkpoint", None):
        found.append(("--checkpoint", args.checkpoint))
    return found


def distinct_outputs(*outputs: tuple[str, Path | None]) -> None:
    """Two outputs of one command must be two files (the second would replace the first)."""
    given = [(flag, path) for flag, path in outputs if path is not None]
    for i, (flag, path) in enumerate(given):
        for other, second in given[i + 1 :]:
            if same_file(path, second):
                raise ConfigError(f"{flag} and {other} name the same file {path}; name two files.")
