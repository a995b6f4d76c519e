"""The calibration flags' meaning: ``odeify.calibrate`` with ``--calibrate-images``, ``--calibrate-steps``,
``--calibrate-seconds``, ``--calibrate-objective`` and ``--seed``, its report on stderr (``odeify
calibrate``, ``retarget --calibrate``)."""

from __future__ import annotations

import argparse
import sys

import torch.fx as fx

import odeify

__all__ = ["calibrate_with_flags"]


def calibrate_with_flags(model: fx.GraphModule, data: str, args: argparse.Namespace) -> fx.GraphModule:
    """``model`` calibrated on the images of ``data`` as the flags ask; the report goes to stderr."""
    calibrated, report = odeify.calibrate(
        model,
        data,
        images=args.calibrate_images,
        iterations=args.calibrate_steps,
        seconds=args.calibrate_seconds,
        seed=args.seed,
        objective=args.calibrate_objective,
    )
    print(report, file=sys.stderr)
    return calibrated
