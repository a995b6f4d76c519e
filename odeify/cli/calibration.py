"""``odeify calibrate`` and ``retarget --calibrate``: fit a coarse manifestation's stages to its source.

The work is :func:`odeify.calibrate`'s; this module reads the flags, loads and saves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.fx as fx

import odeify
from odeify.cli.commands import checked_output_file, is_converted_file
from odeify.core.errors import ConfigError

__all__ = ["calibrated_if_asked", "run_calibrate"]


def run_calibrate(args: argparse.Namespace) -> int:
    """Load a converted file, calibrate it on ``--data``, save it with ``-o``."""
    output = checked_output_file(args.output, "-o", args, model=True)
    if not is_converted_file(args.model):
        raise ConfigError(
            f"{args.model} is not a converted model file. calibrate takes a file written by `odeify "
            "convert -o` or `odeify retarget -o` at a coarser manifestation (fewer steps or knots)."
        )
    loaded = odeify.load(args.model, verify=args.verify)
    model = _calibrate(loaded, args.data, args)
    odeify.save(model, output)
    print(f"wrote {output} (from {Path(args.model).name})", file=sys.stderr)
    return 0


def calibrated_if_asked(model: fx.GraphModule, args: argparse.Namespace) -> fx.GraphModule:
    """``model`` calibrated on ``--calibrate DIR`` when given (``odeify retarget``), else as it is."""
    return model if args.calibrate is None else _calibrate(model, args.calibrate, args)


def _calibrate(model: fx.GraphModule, data: str, args: argparse.Namespace) -> fx.GraphModule:
    calibrated, report = odeify.calibrate(
        model, data, images=args.calibrate_images, seconds=args.calibrate_seconds, seed=args.seed
    )
    print(report, file=sys.stderr)
    return calibrated
