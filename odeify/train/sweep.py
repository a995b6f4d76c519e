"""Accuracy and cost of one converted model over many manifestations, without any training.

``odeify sweep`` retargets the model to every (integrator, steps, knots) combination asked for, in one
basis (the model's own unless another is asked for), and evaluates each: the trade-off between field
evaluations (NFE) and accuracy a user picks from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import product

import torch.fx as fx

from odeify.compiler.conversion import converted_stages, retarget, set_steps, steps_at
from odeify.inspection.report import markdown_table
from odeify.train.calibration_depths import merged_line
from odeify.train.evaluate import evaluate
from odeify.train.progress import LOGGER

__all__ = ["SweepPoint", "sweep", "sweep_markdown"]


@dataclass(frozen=True)
class SweepPoint:
    """One manifestation and what it measured (accuracy in [0, 1], NFE per forward pass)."""

    integrator: str
    steps: str
    knots: str
    basis: str
    nfe: int
    accuracy: float
    seconds_per_batch: float


def sweep(
    model: fx.GraphModule,
    batches: Callable[[], Iterable],
    integrators: Sequence[str],
    steps: Sequence[int | str],
    knots: Sequence[int | str] = ("native",),
    *,
    basis: str | None = None,
    max_batches: int | None = None,
) -> list[SweepPoint]:
    """Evaluate ``model`` retargeted to every combination; ``batches()`` yields a fresh pass of data.

    Each (integrator, knots) is one copy of the model, switched to every depth in place (no copy of
    the knots per depth). Knots are refitted from the model as given (least squares below its count,
    resampled above), in ``basis`` (default: the model's own); every point runs with
    ``backward='backprop'`` (evaluation never runs a backward pass). Each point is logged as it is
    measured (``logging.getLogger("odeify")``). Depths that give the model the same steps are
    measured once, under the first (logged).
    """
    points = []
    steps = _distinct_depths(model, steps)
    for integrator in integrators:
        copies: dict[int | str, fx.GraphModule] = {}  # one per knot count: the depths switch in place
        for step, knot in product(steps, knots):
            if knot in copies:
                manifestation = set_steps(copies[knot], step)
            else:
                manifestation = copies[knot] = retarget(
                    model, integrator=integrator, steps=step, knots=knot, basis=basis, backward="backprop"
                )
            points.append(_measured(manifestation, batches, max_batches, integrator, step, knot))
    return points


def _distinct_depths(model: fx.GraphModule, steps: Sequence[int | str]) -> list[int | str]:
    """``steps`` without those that give ``model`` the same steps per stage as one before (logged)."""
    resolved = [steps_at(model, step) for step in steps]
    kept = [step for i, step in enumerate(steps) if resolved[i] not in resolved[:i]]
    for step in kept:
        counts = resolved[steps.index(step)]
        others = [str(s) for s, c in zip(steps, resolved, strict=True) if c == counts and s != step]
        if others:
            LOGGER.info(merged_line(str(step), others, counts))
    return kept


def _measured(
    manifestation: fx.GraphModule, batches: Callable[[], Iterable], max_batches: int | None,
    integrator: str, step: int | str, knot: int | str,
) -> SweepPoint:  # fmt: skip
    """One point: ``manifestation`` evaluated, and logged."""
    result = evaluate(manifestation, batches(), max_batches=max_batches)
    used = ",".join(sorted({stage.basis for stage in converted_stages(manifestation)}))
    point = SweepPoint(
        integrator, str(step), str(knot), used, result.nfe, result.accuracy, result.seconds_per_batch
    )
    LOGGER.info(
        f"{point.integrator:>16} steps {point.steps:>6} knots {point.knots:>6} {point.basis}: NFE "
        f"{point.nfe:>4}, accuracy {point.accuracy:.2%}"
    )
    return point


def sweep_markdown(points: Sequence[SweepPoint]) -> list[str]:
    """The points as markdown table lines (accuracy in percent, time in milliseconds per batch)."""
    rows = [
        (
            p.integrator,
            p.steps,
            p.knots,
            p.basis,
            str(p.nfe),
            f"{100 * p.accuracy:.2f}",
            f"{1000 * p.seconds_per_batch:.1f}",
        )
        for p in points
    ]
    return markdown_table(
        ("integrator", "steps", "knots", "basis", "NFE", "accuracy %", "ms/batch"), rows, text_columns=4
    )
