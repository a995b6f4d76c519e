"""What ``odeify retarget`` did, stage by stage: the settings that changed, the relative error of
the weights the refitted stage reads, the stages left as they are, and a warning where a --steps
request could not be met as asked (more knots than blocks: ``odeify.retarget`` warns itself).

A retarget that changes the knots or the basis refits each stage's weight path W(t) (least squares
when there are fewer knots). The model reads W only at its evaluation times (for Euler at native
steps, the knots t = k / L), so the error is measured there, at the new manifestation's times t:
sqrt(sum ||W_new(t) - W_old(t)||^2 / sum ||W_old(t)||^2) over every time-dependent tensor. Between
those times a path may differ (2 linear knots of a 2-block stage are not its constant path at
t = 1/4) without changing what the model computes. A stage whose integrator, steps and weights read
stay the same computes as before: it is left as it is. The steps and the integrator do not touch
the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import nn

from odeify.codegen.emit import build_unrolled_graph
from odeify.compiler.conversion import converted_stages
from odeify.runtime.stage import ODEStage

__all__ = ["StageChange", "retarget_changes"]


@dataclass
class StageChange:
    """One stage's retarget: ``changed`` as 'setting: before -> after', the relative error of the
    weights it reads at its ``times`` evaluation times (None when the weights were not refitted),
    whether it computes as before (``left_as_it_is``), and warnings."""

    stage: str
    changed: list[str] = field(default_factory=list)
    fit_error: float | None = None
    times: int = 0
    left_as_it_is: bool = False
    warnings: list[str] = field(default_factory=list)

    def line(self) -> str:
        what = ", ".join(self.changed)
        if self.left_as_it_is and not what:
            return f"{self.stage}: left as it is"
        if self.left_as_it_is:
            same = f"the same weights at its {self.times} evaluation times"
            return f"{self.stage}: {what}; left as it is: it computes as before ({same})"
        if self.fit_error is None:
            return f"{self.stage}: {what or 'unchanged'}"
        return (
            f"{self.stage}: {what}; weights refitted: relative error {self.fit_error:.3g} of the weights it "
            f"reads at its {self.times} evaluation times"
        )

    def to_dict(self) -> dict:
        return {"stage": self.stage, "changed": self.changed, "fit_error": self.fit_error,
                "evaluation_times": self.times, "left_as_it_is": self.left_as_it_is,
                "warnings": self.warnings}  # fmt: skip


def retarget_changes(before: nn.Module, after: nn.Module, steps_asked: object = None) -> list[StageChange]:
    """Each stage's change from ``before`` to ``after``; ``steps_asked`` is the --steps request."""
    old = {s.stage_name: s for s in converted_stages(before)}
    changes = []
    for stage in converted_stages(after):
        previous = old[stage.stage_name]
        change = StageChange(stage.stage_name, _changed(previous, stage))
        times = read_times(stage)
        change.times = len(times)
        if previous.num_knots != stage.num_knots or previous.basis != stage.basis:
            change.fit_error = fit_error(previous, stage, times)
        same_steps = (previous.integrator, previous.steps) == (stage.integrator, stage.steps)
        change.left_as_it_is = same_steps and not change.fit_error
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
        clamped = round(Fraction(steps_asked[1:]) * new.depth) < 1  # the multiplier's own line names it
        if new.steps == old.steps and not clamped:
            found.append(
                f"{new.stage_name}: --steps {steps_asked} of its {old.steps} step(s) rounds back to "
                f"{new.steps}: unchanged (a stage takes whole steps)"
            )
    return found  # more knots than blocks: odeify.retarget warns itself (KnotRefinementWarning)


def read_times(stage: ODEStage) -> list[tuple[Fraction, bool]]:
    """Each time (and side: a left limit or not) at which ``stage``'s forward reads its weight path,
    in order, recorded as its unrolled graph is written (so every integrator's rule is the emitter's)."""
    times: dict[tuple[Fraction, bool], None] = {}
    row = stage.row

    def recording(t: Fraction, left: bool) -> tuple[Fraction, ...]:
        times[(t, left)] = None
        return row(t, left)

    stage.row = recording  # an instance attribute over the method, removed below
    try:
        build_unrolled_graph(stage)
    finally:
        del stage.row
    return list(times)


def fit_error(old: ODEStage, new: ODEStage, times: list[tuple[Fraction, bool]]) -> float:
    """The relative error of the weights ``new`` reads at ``times`` against ``old``'s path there."""
    error = total = 0.0
    with torch.no_grad():
        for t, left in times:
            for a, b in zip(_weights_at(old, t, left), _weights_at(new, t, left), strict=True):
                error += float((b - a).pow(2).sum())
                total += float(a.pow(2).sum())
    return (error / total) ** 0.5 if total else float(error > 0)


def _weights_at(stage: ODEStage, t: Fraction, left: bool) -> list[torch.Tensor]:
    """Every time-dependent tensor of ``stage`` at time ``t``: its knots weighted by the basis row."""
    row = torch.tensor([float(c) for c in stage.row(t, left)], dtype=torch.float64)
    return [torch.tensordot(row, knots.detach().double(), dims=1) for knots in stage.knot_tensors()]
