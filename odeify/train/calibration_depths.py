"""The depths calibration fits, and the stages it leaves as they are.

A depth is what ``odeify.retarget(steps=...)`` takes; each is resolved to per-stage step counts. Two
listed depths that give the model the same steps are one depth: fitted once, under the first label,
with one log line saying so (``native,x0.5,x0.25`` on a ResNet-18, whose ``x0.5`` and ``x0.25`` are
the same steps, is what a user writes from the docs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from odeify.compiler.conversion import converted_stages, steps_at
from odeify.core.errors import ConfigError
from odeify.ir.settings import StepsSpec
from odeify.ir.source_tensors import SOURCE_PREFIX
from odeify.runtime.stage import ODEStage
from odeify.train.manifestations import runs_as_converted
from odeify.train.progress import LOGGER

__all__ = [
    "Depth",
    "DepthSpec",
    "at_depth",
    "merged_line",
    "nothing_to_fit",
    "resolve_depths",
    "runs_its_source",
]

DepthSpec = StepsSpec | Mapping[str, StepsSpec]
"""A depth as ``odeify.retarget(steps=...)`` takes it: an int, ``"native"``, a multiplier such as
``"x0.5"``, or a {stage name: steps} dict (its stages left out keep theirs)."""


@dataclass(frozen=True)
class Depth:
    """One depth calibration fits: its label as the user wrote it (None: the model's own depth, no
    ``steps`` given) and each stage's step count there."""

    label: str | None
    steps: dict[str, int]


def resolve_depths(model: fx.GraphModule, steps: object) -> list[Depth]:
    """The depths ``steps`` lists, each resolved to per-stage step counts as ``odeify.retarget``
    resolves it (:func:`~odeify.compiler.conversion.steps_at`, no copy of the model), those that give
    the same steps merged (logged); the model's own depth where ``steps`` is None."""
    if steps is None:
        return [Depth(None, {s.stage_name: s.steps for s in converted_stages(model)})]
    specs = [steps] if isinstance(steps, (str, int, Mapping)) else steps
    if not isinstance(specs, Sequence) or not specs:
        raise ConfigError(
            f"calibrate's steps must list depths such as ['native', 'x0.5'] (each an int, 'native', a "
            f"multiplier 'x0.5' or a {{stage: steps}} dict), or be None for the model's own; got {steps!r}."
        )
    depths: list[Depth] = []
    merged: dict[str, list[str]] = {}
    for spec in specs:
        label = ", ".join(f"{k}={v}" for k, v in spec.items()) if isinstance(spec, Mapping) else str(spec)
        counts = steps_at(model, spec)
        same = next((d.label for d in depths if d.steps == counts), None)
        if same is None:
            depths.append(Depth(label, counts))
        elif label != same:
            merged.setdefault(same, []).append(label)
    for kept, others in merged.items():
        LOGGER.info(merged_line(kept, others, next(d.steps for d in depths if d.label == kept)))
    return depths


def merged_line(kept: str, others: Sequence[str], steps: Mapping[str, int]) -> str:
    """'depths x0.5 and x0.25 give this model the same steps (...): merged, fitted once as x0.5'."""
    names = " and ".join([kept, *others])
    per_stage = ", ".join(f"{name} {count}" for name, count in steps.items())
    return (
        f"depths {names} give this model the same steps per stage ({per_stage}): merged, taken once as {kept}"
    )


def at_depth(work: fx.GraphModule, paths: dict[str, str], depth: Depth) -> fx.GraphModule:
    """``work`` (calibration's copy, which calls its stages as modules) switched in place to ``depth``."""
    for name, path in paths.items():
        work.get_submodule(path).configure(steps=depth.steps[name])
    return work


def runs_its_source(stage: ODEStage, source: ODEStage) -> bool:
    """Whether ``stage`` computes ``source`` (the same stage of the source network) exactly: Euler
    (Lie-Trotter), one step and one constant knot per block, as many blocks as the source stage, and
    the same tensors. Such a stage is left as it is. Fitting it too, to make up for the coarse stages
    before it, took about 2.5x the time at half the steps for no gain on the converted model
    (resnet18: 98.33 / 98.33% either way; resnetv2_18: 98.89 / 98.89% left, 99.44 / 98.61% fitted;
    docs/calibration.md)."""
    if not (runs_as_converted(stage) and stage.depth == source.depth):
        return False
    mine, theirs = (
        {k: v for k, v in s.state_dict().items() if not k.startswith(SOURCE_PREFIX)} for s in (stage, source)
    )  # the tensors it computes with, not its record of where they started
    return mine.keys() == theirs.keys() and all(torch.equal(mine[key], theirs[key]) for key in mine)


def nothing_to_fit(model: fx.GraphModule, depths: list[Depth], how: str) -> str:
    """Why a model that computes its source network exactly at every depth asked is refused (one
    rule, whatever makes it exact: native steps and knots, or knots that read as the blocks), and
    what would give calibration something to fit, never the call that was just made."""
    stages = converted_stages(model)
    at = "its depth" if depths[0].label is None else f"depth{'s' if len(depths) > 1 else ''} "
    at += ", ".join(d.label for d in depths if d.label)
    said = (
        f"calibration has nothing to fit: at {at} every stage of this model computes its source stage "
        f"exactly ({how}), so the calibrated model would be this one. A model with fewer blocks than "
        "the network it should match (a dropped-blocks student) is fitted to that network with source= "
        "(CLI: odeify calibrate --source FILE)."
    )
    if all(s.depth == 1 for s in stages):
        return (
            f"{said} Every stage has one block, so no depth or knot count below its source's exists (a "
            "multiplier such as x0.5 gives each stage its one step back): use the model as it is."
        )
    return (
        f"{said} Calibrate a depth with fewer steps than blocks: steps=['x0.5'] or "
        "odeify.retarget(model, steps='x0.5') (CLI: --calibrate-steps-set x0.5, or odeify retarget IN -o "
        "OUT --steps x0.5 --calibrate DIR), or fewer knots (knots=2)."
    )
