"""The depths a converted model's knots were fitted for, and the warning when it runs at another.

A converted model is one weight path per stage, read at whatever step count the stage runs: a file
calibrated or fine-tuned at half the steps still runs at native depth, but no longer computes its
source network there. Each stage keeps the step counts its knots were fitted for
(``stage.fitted_steps``, written by calibration and fine-tuning, saved with the file, reset when the
knots are refitted); a model switched to a depth outside them says so, once per call, naming the
call that gives the source network back (:func:`odeify.source_network`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from torch import nn

from odeify.runtime.stage import ODEStage

__all__ = ["UnfittedDepthWarning", "fitted_label", "unfitted_stages", "warn_unfitted_depth"]


class UnfittedDepthWarning(UserWarning):
    """A stage runs at a step count its knots were not fitted for."""


def unfitted_stages(stages: Iterable[ODEStage]) -> list[ODEStage]:
    """The stages whose knots were fitted for other step counts than the one they run at."""
    return [s for s in stages if s.fitted_steps is not None and s.steps not in s.fitted_steps]


def fitted_label(stage: ODEStage) -> str:
    """'2, 4 steps' (native marked), or 'not fitted'."""
    if stage.fitted_steps is None:
        return "not fitted"
    return ", ".join(f"{n} (native)" if n == stage.depth else str(n) for n in stage.fitted_steps) + " steps"


def warn_unfitted_depth(model: nn.Module, stacklevel: int = 3) -> None:
    """Warn, once for the whole model, where a stage runs at a depth its knots were not fitted for."""
    stages = unfitted_stages(m for m in model.modules() if isinstance(m, ODEStage))
    if not stages:
        return
    native = [s.stage_name for s in stages if s.steps == s.depth]
    parts = "; ".join(
        f"'{s.stage_name}' runs {s.steps} step{'s' * (s.steps != 1)}, fitted for {fitted_label(s)}"
        for s in stages
    )
    source = (
        f" At native depth ({', '.join(native)}) it no longer computes its source network: "
        "odeify.source_network(model) gives that network back."
        if native
        else ""
    )
    warnings.warn(
        f"the model's knots were calibrated or fine-tuned for other depths than it now runs at: {parts}."
        f"{source} Pick a depth it was fitted for (odeify.set_steps(model, steps), --steps), or fit this "
        "one too (odeify.calibrate(model, data, steps=[...]))",
        UnfittedDepthWarning,
        stacklevel=stacklevel,
    )
