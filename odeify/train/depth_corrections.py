"""Calibration for several depths in one file: no depth paid for by another.

One set of knots fitted for several depths trades them against each other (a user's ViT lost 2.9
points at native depth). Here the knots stay as they are, so native depth reads the source's blocks
bit for bit, and each other listed depth gets a **correction** of its own: the tensors added to the
knots while a stage runs that depth's step count (:meth:`odeify.ir.stage_ir.StageIR.correction`),
fitted exactly as ``calibrate(steps=[that depth])`` fits a file for it alone. A stage whose step
count is the same at two listed depths has one correction, fitted at the first.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from odeify.compiler.conversion import converted_stages, relower, set_steps
from odeify.compiler.fitted_depths import UnfittedDepthWarning
from odeify.core.errors import ConfigError
from odeify.ir.source_tensors import record_stage_source
from odeify.train.calibration_depths import Depth
from odeify.train.calibration_report import CalibrationReport, StageFit

__all__ = ["FitOne", "adopt_corrections", "calibrate_each_depth", "hold_corrections"]

FitOne = Callable[[fx.GraphModule, Depth, frozenset[str]], tuple[fx.GraphModule, CalibrationReport] | None]
"""Calibration of one depth: the model at that depth and the stages to leave as they are, to the
calibrated model and its report (None where nothing is left to fit)."""

Corrections = dict[tuple[str, int], dict[str, torch.Tensor]]
"""(stage name, step count) -> one correction tensor per trainable slot."""


def calibrate_each_depth(
    model: fx.GraphModule, depths: list[Depth], fit_one: FitOne
) -> tuple[fx.GraphModule, CalibrationReport]:
    """A copy of ``model`` holding, for each listed depth, the corrections ``fit_one`` fits there.

    Depths are fitted in the order listed; each starts from the model's weights at that depth (its
    knots, plus a correction already held or fitted for a stage's step count there, which is then
    left as it is). Native depth (a stage at its block count) reads the knots and is never fitted.
    """
    _check_one_knot_per_block(model)
    native = {stage.stage_name: stage.depth for stage in converted_stages(model)}
    found: Corrections = {}
    reports: list[tuple[Depth, CalibrationReport]] = []
    for depth in depths:
        kept = frozenset(
            name for name, steps in depth.steps.items() if steps == native[name] or (name, steps) in found
        )
        if len(kept) == len(native):
            continue
        fitted = fit_one(_as_read_at(model, depth, found), depth, kept)
        if fitted is None:
            continue
        calibrated, report = fitted
        found |= _corrections_of(model, calibrated, depth, report, kept)
        reports.append((depth, report))
    if not found:
        raise ConfigError(
            "calibrate: every listed depth computes the source network exactly (native depth reads the "
            "blocks themselves), so there is no correction to fit. List a coarser depth, such as 'x0.5'."
        )
    result = copy.deepcopy(model)
    for stage in converted_stages(result):
        name = stage.stage_name
        for steps in sorted({d.steps[name] for d in depths if (name, d.steps[name]) in found}):
            stage.set_correction(steps, found[(name, steps)])
            stage.fitted_steps = tuple(sorted({d.steps[name] for d in depths}))
    return relower(result), _joined(reports, depths)


def _check_one_knot_per_block(model: fx.GraphModule) -> None:
    """Refuse stages whose knots are not their blocks': native depth would not read the source."""
    for stage in converted_stages(model):
        if stage.num_knots != stage.depth:
            raise ConfigError(
                f"calibrate for several depths keeps each stage's knots as native depth's weights and fits "
                f"a correction for every other depth, but stage '{stage.stage_name}' has {stage.num_knots} "
                f"knots for its {stage.depth} blocks. Calibrate one depth at a time (steps='x0.5'), or "
                "retarget with knots='native' first."
            )


def _as_read_at(model: fx.GraphModule, depth: Depth, found: Corrections) -> fx.GraphModule:
    """A copy of ``model`` at ``depth`` whose knots are what each stage reads there (the knots plus a
    correction fitted or held for its step count), without corrections of its own."""
    copied = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnfittedDepthWarning)
        set_steps(copied, "native")  # where no correction is read: its graph then reads none
    for stage in converted_stages(copied):
        record_stage_source(stage)  # the blocks' own knots, before they change
        steps = depth.steps[stage.stage_name]
        extra = found.get((stage.stage_name, steps), stage.correction(steps))
        stage.drop_corrections()
        if extra is not None:
            with torch.no_grad():
                for name, knots in stage.knots.items():
                    knots.add_(extra[name])
    return copied


def _corrections_of(
    model: fx.GraphModule,
    calibrated: fx.GraphModule,
    depth: Depth,
    report: CalibrationReport,
    kept: frozenset[str],
) -> Corrections:
    """Each fitted stage's knots in ``calibrated`` less its knots in ``model``, at its step count."""
    fitted = {fit.stage for fit in report.stages if fit.fitted} - kept
    before = {stage.stage_name: stage for stage in converted_stages(model)}
    found: Corrections = {}
    for stage in converted_stages(calibrated):
        if stage.stage_name in fitted:
            knots = before[stage.stage_name].knots
            found[(stage.stage_name, depth.steps[stage.stage_name])] = {
                name: (value.detach() - knots[name].detach()).clone() for name, value in stage.knots.items()
            }
    return found


def _joined(reports: list[tuple[Depth, CalibrationReport]], depths: list[Depth]) -> CalibrationReport:
    """One report of the per-depth fits: each stage with its residuals at every depth it was fitted."""
    first = reports[0][1]
    joined = CalibrationReport(
        images=first.images,
        seconds=sum(r.seconds for _, r in reports),
        depths=[d.label for d in depths if d.label],
        memory=max((r.memory for _, r in reports if r.memory), default=None, key=lambda m: m[2] or 0.0),
    )
    for index, fit in enumerate(first.stages):
        fits = [report.stages[index] for _, report in reports]
        per_depth = [d for f in fits for d in f.depths]
        done = [f for f in fits if f.fitted]
        if not done:
            joined.stages.append(fit)
            continue
        joined.stages.append(
            StageFit(
                fit.stage, done[0].before, done[0].after, sum(f.iterations for f in done),
                sum(f.seconds for f in fits), done[0].output, per_depth,
            )
        )  # fmt: skip
    return joined


def hold_corrections(model: fx.GraphModule, depths: Sequence[Mapping[str, int]]) -> None:
    """Give ``model``'s stages, **in place**, a zero correction at each step count of ``depths`` other
    than native that they hold none for, so that fine-tuning for several depths trains each depth's
    correction and native's knots apart (before the optimizer is built: it must see them)."""
    added = False
    for stage in converted_stages(model):
        for steps in sorted({depth[stage.stage_name] for depth in depths}):
            if steps != stage.depth and stage.correction(steps) is None and stage.num_knots == stage.depth:
                stage.hold_zero_correction(steps)
                added = True
    if added:
        relower(model)


def adopt_corrections(model: fx.GraphModule, calibrated: fx.GraphModule) -> None:
    """Give ``model``, **in place**, ``calibrated``'s tensors, corrections included (a calibrated copy
    of it: :func:`calibrate_each_depth`'s result)."""
    own = {stage.stage_name: stage for stage in converted_stages(model)}
    for stage in converted_stages(calibrated):
        for steps in stage.corrected_steps:
            if own[stage.stage_name].correction(steps) is None:
                own[stage.stage_name].hold_zero_correction(steps)
    with torch.no_grad():
        model.load_state_dict(calibrated.state_dict())
    relower(model)
