"""Calibration's checks of its arguments, each refusal naming the argument and what it takes."""

from __future__ import annotations

import math

import torch.fx as fx

from odeify.compiler.conversion import check_converted
from odeify.compiler.source_network import unknown_source
from odeify.core.errors import ConfigError
from odeify.train.recipe import CALIBRATION_OBJECTIVES

__all__ = ["check_arguments", "check_objective", "check_source_known"]


def check_arguments(
    model: object, images: object, seconds: object, iterations: object, lr: object, batch: object,
    seed: object, memory: object,
) -> None:  # fmt: skip
    check_converted(model, "calibrate")
    named = (("images", images), ("iterations", iterations), ("batch_size", batch), ("memory", memory))
    for name, value in named:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"calibrate's {name} must be a positive integer; got {value!r}.")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not math.isfinite(seconds) or seconds <= 0):  # fmt: skip
        raise ConfigError(f"calibrate's seconds must be a positive number or None; got {seconds!r}.")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"calibrate's lr must be a positive number; got {lr!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"calibrate's seed must be an integer in [0, 2^63); got {seed!r}.")


def check_objective(objective: object, name: str) -> None:
    """Refuse an objective calibration does not know (``name``: the argument, for the message)."""
    if objective not in CALIBRATION_OBJECTIVES:
        raise ConfigError(f"{name} must be one of {', '.join(CALIBRATION_OBJECTIVES)}; got {objective!r}.")


def check_source_known(model: fx.GraphModule) -> None:
    """Refuse a model whose source network is not known."""
    why = unknown_source(model)
    if why is not None:
        raise ConfigError(
            f"calibration fits the stages to the model's source network, which is not known: {why}. Pass "
            "source= (the source converted at native depth)."
        )
