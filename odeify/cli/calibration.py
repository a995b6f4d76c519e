"""The calibration flags' meaning: ``odeify.calibrate`` with ``--calibrate-images``, ``--calibrate-steps``,
``--calibrate-seconds``, ``--calibrate-steps-set``, ``--calibrate-objective``, ``--calibrate-memory``,
``--seed`` and
(``odeify calibrate``) ``--source``, its report on stderr (``odeify calibrate``, ``retarget
--calibrate``)."""

from __future__ import annotations

import argparse
import sys

import torch.fx as fx

import odeify
from odeify.compiler.source_network import unknown_source
from odeify.core.errors import ConfigError
from odeify.serialization.io import is_converted_file
from odeify.train.calibration_store import MIB

__all__ = ["calibrate_with_flags"]


def calibrate_with_flags(model: fx.GraphModule, data: str, args: argparse.Namespace) -> fx.GraphModule:
    """``model`` calibrated on the images of ``data`` as the flags ask; the report goes to stderr."""
    depths = args.calibrate_steps_set
    calibrated, report = odeify.calibrate(
        model,
        data,
        steps=None if depths is None else [depth for listed in depths for depth in listed],
        images=args.calibrate_images,
        iterations=args.calibrate_steps,
        seconds=args.calibrate_seconds,
        seed=args.seed,
        source=_source(vars(args).get("source"), args.verify),
        objective=args.calibrate_objective,
        memory=args.calibrate_memory * MIB,
    )
    print(report, file=sys.stderr)
    return calibrated


def _source(path: str | None, verify: bool) -> fx.GraphModule | None:
    """The network ``--source FILE`` names: the source network that converted file keeps (so the
    file of the source at any depth will do), or None without the flag."""
    if path is None:
        return None
    if not is_converted_file(path):
        raise ConfigError(
            f"--source {path} is not a converted model file: convert the network to fit to first "
            f"(`odeify convert MODEL -o source.safetensors`) and pass that file."
        )
    source = odeify.load(path, verify=verify)
    why = unknown_source(source)
    if why is not None:
        raise ConfigError(f"--source {path} does not keep its source network ({why}): pass its native file.")
    return odeify.source_network(source)
