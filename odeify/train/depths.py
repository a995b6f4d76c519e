"""Fine-tuning one file for several depths at once (``Recipe.depths``, ``--depths``).

A converted model reads its knots at whatever step count each stage runs, so one file can serve
several depths; trained at one, it drifts away at the others. With depths listed, each depth but
native reads the knots plus a correction of its own (:mod:`odeify.train.depth_corrections`), and
every batch of a run trains at a depth drawn at random, uniformly: native's batches the knots, a
depth's batches its correction. The draws are seeded by (seed, epoch) alone, so every rank draws the
same and a resumed epoch draws what an uninterrupted one drew. The switch is
:func:`odeify.set_steps` on the model itself: only the stages' graphs change, no weight is copied.
Validation scores every depth, and the epoch's ``val_accuracy`` is the worst depth's (what decides
``best.safetensors``: the file is as good as its worst listed depth); the model is saved at the
first listed depth, with each stage's fitted step counts recorded (``stage.fitted_steps``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from odeify.compiler.conversion import converted_stages, set_steps
from odeify.compiler.fitted_depths import UnfittedDepthWarning
from odeify.core.errors import ConfigError
from odeify.train.calibration_depths import merged_line
from odeify.train.depth_list import depth_specs
from odeify.train.distributed import Processes
from odeify.train.progress import LOGGER
from odeify.train.state import EpochRecord
from odeify.train.trainer import Trainer, validation

__all__ = [
    "DepthPlan",
    "batch_depths",
    "depths_line",
    "mark_trained_depths",
    "validation_at_depths",
]


@dataclass(frozen=True)
class DepthPlan:
    """The listed depths of a model: each one's label and steps per stage."""

    labels: tuple[str, ...]
    steps: tuple[dict[str, int], ...]

    @classmethod
    def of(cls, model: nn.Module, depths: str) -> DepthPlan:
        """Resolve ``depths`` against ``model``'s stages by switching to each (as every later switch
        does, so a depth means here what it means to :func:`odeify.set_steps`); leaves the model at
        the first depth. Depths that give the model the same steps are one, under the first label
        (logged)."""
        specs = depth_specs(depths)
        resolved: list[dict[str, int]] = []
        with warnings.catch_warnings():  # fitting these depths is what the run is for
            warnings.simplefilter("ignore", UnfittedDepthWarning)
            for spec in (*specs, specs[0]):
                try:
                    set_steps(model, spec)
                except ConfigError as exc:
                    raise ConfigError(
                        f"the model cannot run at depth {spec}, one of the depths to train for: {exc} "
                        "Every stage runs at every listed depth: pick an integrator that does (euler, "
                        "reversible_heun; --integrator), or leave that depth out."
                    ) from None
                resolved.append({s.stage_name: s.steps for s in converted_stages(model)})
        resolved.pop()
        labels, steps = [], []
        for spec, counts in zip(specs, resolved, strict=True):
            if counts not in steps:
                labels.append(str(spec))
                steps.append(counts)
        for kept, counts in zip(labels, steps, strict=True):
            others = [str(s) for s, c in zip(specs, resolved, strict=True) if c == counts and str(s) != kept]
            if others:
                LOGGER.info(merged_line(kept, others, counts))
        return cls(tuple(labels), tuple(steps))

    def draws(self, seed: int, epoch: int, batches: int) -> list[int]:
        """The depth of each batch of ``epoch``: uniform, from (seed, epoch) alone."""
        generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
        return torch.randint(len(self.labels), (batches,), generator=generator).tolist()

    def switch(self, model: nn.Module, index: int) -> None:
        """Run ``model`` at depth ``index``, in place (nothing happens when it runs there already)."""
        wanted = self.steps[index]
        if any(s.steps != wanted[s.stage_name] for s in converted_stages(model)):
            set_steps(model, wanted)

    def mark_fitted(self, model: nn.Module) -> None:
        """Record on each stage the step counts its knots are trained for."""
        for stage in converted_stages(model):
            stage.fitted_steps = tuple(sorted({steps[stage.stage_name] for steps in self.steps}))


def mark_trained_depths(model: nn.Module, plan: DepthPlan | None) -> None:
    """Record on ``model``'s stages the depths a run trains them for: the plan's, else the current."""
    if plan is not None:
        plan.mark_fitted(model)
        return
    for stage in converted_stages(model):
        stage.fitted_steps = (stage.steps,)


def batch_depths(
    trainer: Trainer, plan: DepthPlan | None, seed: int, epoch: int, batches: int
) -> Callable[[int], None] | None:
    """What runs before each batch of ``epoch``: the switch to its drawn depth (None without a plan)."""
    if plan is None:
        return None
    draws = plan.draws(seed, epoch, batches)
    return lambda index: plan.switch(trainer.model, draws[index])


def validation_at_depths(
    model: nn.Module, loader, procs: Processes, plan: DepthPlan | None
) -> tuple[float, float, dict[str, float]]:
    """Validation accuracy and loss of ``model``; with a plan, the worst depth's, and the accuracy at
    each depth (the model is left at the first depth, where it is saved)."""
    if plan is None:
        return (*validation(model, loader, procs), {})
    scores = {}
    for index, label in enumerate(plan.labels):
        plan.switch(model, index)
        scores[label] = validation(model, loader, procs)
    plan.switch(model, 0)
    worst = min(scores, key=lambda label: scores[label][0])
    return scores[worst][0], scores[worst][1], {label: accuracy for label, (accuracy, _) in scores.items()}


def depths_line(record: EpochRecord) -> str:
    """'  at each depth: native 98.33%, x0.5 97.77% (the worst decides the best epoch)'."""
    scores = ", ".join(f"{label} {accuracy:.2%}" for label, accuracy in record.depth_accuracy.items())
    return f"  val accuracy at each depth: {scores} (the worst is the epoch's)"
