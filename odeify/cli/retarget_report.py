"""What ``odeify retarget`` did, stage by stage: the settings that changed, the relative error of
the weight path's refit, and a warning where a request could not be met as asked.

A retarget that changes the knots or the basis refits each stage's weight path W(t) (least squares
when there are fewer knots); its error is measured on a fine grid of times t in (0, 1):
sqrt(sum ||W_new(t) - W_old(t)||^2 / sum ||W_old(t)||^2) over every time-dependent tensor. The
steps and the integrator do not touch the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import nn

from odeify.compiler.conversion import converted_stages
from odeify.runtime.stage import ODEStage

__all__ = ["StageChange", "retarget_changes"]

GRID_PER_KNOT = 8  # sample times per knot (or block) of the finer path: enough to see a refit's error


@dataclass
class StageChange:
    """One stage's retarget: ``changed`` as 'setting: before -> after', the refit's error (None when
    the weights were not refitted), and warnings."""

    stage: str
    changed: list[str] = field(default_factory=list)
    fit_error: float | None = None
    warnings: list[str] = field(default_factory=list)

    def line(self) -> str:
        what = ", ".join(self.changed) if self.changed else "unchanged"
        fit = "" if self.fit_error is None else f"; weight path refitted, relative error {self.fit_error:.3g}"
        return f"{self.stage}: {what}{fit}"

    def to_dict(self) -> dict:
        return {"stage": self.stage, "changed": self.changed, "fit_error": self.fit_error,
                "warnings": self.warnings}  # fmt: skip


def retarget_changes(before: nn.Module, after: nn.Module, steps_asked: object = None) -> list[StageChange]:
    """Each stage's change from ``before`` to ``after``; ``steps_asked`` is the --steps request."""
    old = {s.stage_name: s for s in converted_stages(before)}
    changes = []
    for stage in converted_stages(after):
        previous = old[stage.stage_name]
        change = StageChange(stage.stage_name, _changed(previous, stage))
        if previous.num_knots != stage.num_knots or previous.basis != stage.basis:
            change.fit_error = fit_error(previous, stage)
        change.warnings = _warnings(previous, stage, steps_asked)
        changes.append(change)
    return changes


def _changed(old: ODEStage, new: ODEStage) -> list[str]:
    pairs = {
        "integrator": (old.integrator.name, new.integrator.name),
        "steps": (old.steps, new.steps),
        "knots": (old.num_knots, new.num_knots),
        "basis": (old.basis, new.basis),
        "backward": (old.backward, new.backward),
    }
    return [f"{name} {a} -> {b}" for name, (a, b) in pairs.items() if a != b]


def _warnings(old: ODEStage, new: ODEStage, steps_asked: object) -> list[str]:
    found = []
    if isinstance(steps_asked, str) and steps_asked.startswith("x") and float(steps_asked[1:]) != 1:
        if new.steps == old.steps:
            found.append(
                f"{new.stage_name}: --steps {steps_asked} of its {old.steps} step(s) rounds back to "
                f"{new.steps}: unchanged (a stage takes whole steps)"
            )
    if new.num_knots > new.depth and new.num_knots > old.num_knots:
        grown = _knot_parameters(new) / max(1, _knot_parameters(old))
        found.append(
            f"{new.stage_name}: {new.num_knots} knots for a run of {new.depth} block(s): the knots "
            f"interpolate {new.depth} block(s) of weights, so they add parameters ({grown:.2f}x this "
            f"stage's) and no information; --knots native or at most {new.depth} keeps it as it is"
        )
    return found


def _knot_parameters(stage: ODEStage) -> int:
    return sum(t.numel() for t in stage.knot_tensors())


def fit_error(old: ODEStage, new: ODEStage) -> float:
    """The relative error of ``new``'s weight path against ``old``'s on a fine grid of times."""
    n = GRID_PER_KNOT * max(old.num_knots, new.num_knots, old.depth)
    times = [Fraction(2 * j + 1, 2 * n) for j in range(n)]
    error = total = 0.0
    with torch.no_grad():
        for t in times:
            for a, b in zip(_weights_at(old, t), _weights_at(new, t), strict=True):
                error += float((b.double() - a.double()).pow(2).sum())
                total += float(a.double().pow(2).sum())
    return (error / total) ** 0.5 if total else float(error > 0)


def _weights_at(stage: ODEStage, t: Fraction) -> list[torch.Tensor]:
    """Every time-dependent tensor of ``stage`` at time ``t``: its knots weighted by the basis row."""
    row = torch.tensor([float(c) for c in stage.row(t, False)], dtype=torch.float64)
    return [torch.tensordot(row, knots.detach().double(), dims=1) for knots in stage.knot_tensors()]
