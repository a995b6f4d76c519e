"""Give a converted model's stages a manifestation: knots and basis, integrator, steps, backward mode.

:func:`set_manifestation` is the one place a stage's settings change, for ``convert`` (from the
native stages ``lift`` made), ``retarget``, ``set_backward`` and ``load`` (from a file's recipe)
alike. It works on the stage-call form of the graph (``lower.raise_stages`` gives it), checks every
request and budget before it changes anything, then refits the knots and configures each stage.

Knots: fewer than the current count compresses by least squares (fit with the new basis), more
refines by evaluating the current weight path at the new knots; the same count keeps them. A new
basis may read the current knots as they are only when they are one per block (the blocks' own
weights, which every basis interpolates): compressed or refined knots are values of their basis's
weight path, and reading them with another basis would silently swap the path. Before a stage's
knot count changes, its blocks' own knots are kept (:mod:`odeify.ir.source_tensors`), and its fold
records follow its knots (:func:`refit_fold_records`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx
from torch import nn

from odeify.core.budget import check_fit_work, check_knot_bytes
from odeify.core.errors import ConfigError
from odeify.ir.fold_records import fold_records
from odeify.ir.settings import DepthMultiplier, StageRequest, resolve_steps, validate_backward
from odeify.ir.source_tensors import record_stage_source
from odeify.ir.stage_ir import StageIR
from odeify.numerics.bases import fit_matrix, get_basis, validate_knots
from odeify.numerics.tableaus import resolve_integrator
from odeify.passes.contract import PassResult, graph_pass, transformation
from odeify.passes.properties import SEGMENTS, STAGE_CALLS

__all__ = ["SET_MANIFESTATION", "check_manifestation", "refit", "refit_fold_records", "set_manifestation"]

SET_MANIFESTATION = transformation(
    "set_manifestation",
    preserves_computation=False,  # the point: another integrator, depth or weight path
    requires={STAGE_CALLS},
    forbids={SEGMENTS},
)


@graph_pass(SET_MANIFESTATION)
def set_manifestation(gm: fx.GraphModule, settings: Mapping[str, StageRequest]) -> PassResult:
    """Apply ``settings`` ({stage name: StageRequest}) to the stages of ``gm``, in place.

    Every request is validated, and every knot budget checked, before any stage changes: a refused
    call changes nothing.
    """
    stages = _stages_of(gm)
    counts = check_manifestation(gm, settings)
    for name, request in settings.items():
        stage = stages[name]
        if not _keeps_knots(stage, counts[name], request.basis):
            _change_knots(stage, counts[name], request.basis)
        stage.configure(
            integrator=request.integrator,
            steps=None
            if request.steps is None
            else resolve_steps(request.steps, stage.depth, name, request.steps_for_all),
            backward=request.backward,
            checkpoint_every=request.checkpoint_every,
        )
    return PassResult(gm, modified=bool(settings))


def _keeps_knots(stage: StageIR, count: int, basis: str | None) -> bool:
    """Whether ``count`` knots under ``basis`` (None: the stage's own) are what ``stage`` holds, so that a
    refit would only copy every knot tensor (convert's native request: a second copy of the weights)."""
    return count == stage.num_knots and (basis is None or get_basis(basis).name == stage.basis)


def check_manifestation(gm: fx.GraphModule, settings: Mapping[str, StageRequest]) -> dict[str, int]:
    """Validate ``settings`` against the stages of ``gm`` (either form) without changing anything.

    Returns each named stage's knot count after the change. For a caller that changes a model in
    place and must refuse before the pipeline starts.
    """
    stages = _stages_of(gm)
    unknown = sorted(set(settings) - set(stages))
    if unknown:
        raise ConfigError(
            f"settings name stage(s) {', '.join(map(repr, unknown))} that this model does not have; "
            f"its stages are: {', '.join(stages)}."
        )
    counts = {name: _validated(stages[name], request) for name, request in settings.items()}
    _check_multiplier(stages, settings)
    return counts


def _check_multiplier(stages: Mapping[str, StageIR], settings: Mapping[str, StageRequest]) -> None:
    """Refuse a depth multiplier given for the whole model that would leave every stage as it is."""
    asked = {request.steps for request in settings.values() if request.steps_for_all}
    spec = asked.pop() if len(asked) == 1 else None
    if isinstance(spec, str) and spec.startswith("x") and set(settings) == set(stages):
        DepthMultiplier.of(spec, {name: stage.depth for name, stage in stages.items()}).check_changes()


def refit(stack: torch.Tensor, basis: str, count: int, depth: int) -> torch.Tensor:
    """``count`` knots from ``depth`` samples of a weight path (exact copy when equal), in float64."""
    if count == depth:
        return stack.detach().clone()
    matrix = torch.tensor(
        [[float(c) for c in row] for row in fit_matrix(basis, count, depth)], dtype=torch.float64
    )
    return torch.tensordot(matrix, stack.detach().to(torch.float64), dims=1).to(stack.dtype)


def _stages_of(gm: fx.GraphModule) -> dict[str, StageIR]:
    """The stage modules of ``gm`` by stage name, called or inlined."""
    return {m.stage_name: m for m in gm.children() if isinstance(m, StageIR)}


def _validated(stage: StageIR, request: StageRequest) -> int:
    """Check ``request`` against ``stage`` without changing it; returns the knot count it asks for."""
    basis = request.basis if request.basis is not None else stage.basis
    get_basis(basis)
    integrator = (
        resolve_integrator(request.integrator) if request.integrator is not None else stage.integrator
    )
    if request.steps is not None:
        resolve_steps(request.steps, stage.depth, stage.stage_name, request.steps_for_all)
    backward = request.backward if request.backward is not None else stage.backward
    validate_backward(backward, integrator, stage.stage_name)
    if request.knots is None:
        count = stage.num_knots
    elif request.knots == "native":
        count = stage.depth
    else:
        count = validate_knots(request.knots, stage.depth, basis)
    if count != stage.num_knots:
        per_knot = sum(t.numel() // max(1, t.shape[0]) * t.element_size() for t in stage.knot_tensors())
        check_knot_bytes(stage.stage_name, count, per_knot)
        check_fit_work(stage.stage_name, count, stage.num_knots, basis)
    _check_basis_switch(stage, get_basis(basis).name, count)
    return count


def _check_basis_switch(stage: StageIR, new_basis: str, count: int) -> None:
    old_basis, old_count = stage.basis, stage.num_knots
    if new_basis == old_basis or count != old_count or old_count == stage.depth:
        return
    how = "compressed by least squares" if old_count < stage.depth else "refined"
    raise ConfigError(
        f"stage '{stage.stage_name}' has {old_count} knots for its {stage.depth} blocks, {how} under "
        f"the '{old_basis}' basis; reading them with the '{new_basis}' basis would silently change its "
        f"weight path (only one-knot-per-block stages can switch basis as they are). To fit "
        f"{old_count} '{new_basis}' knots to the original blocks, convert the original model with "
        f"basis='{new_basis}', knots={old_count}; to resample the current weight path, pass knots "
        f"too, e.g. retarget(..., basis='{new_basis}', knots='native')."
    )


def _change_knots(stage: StageIR, count: int, basis: str | None) -> None:
    """Refit every knot tensor of ``stage`` in place to ``count`` knots under ``basis``."""
    old_basis, old_count = stage.basis, stage.num_knots
    new_basis = get_basis(basis).name if basis is not None else old_basis
    # compression fits with the new basis; refinement evaluates the current weight path
    fit_basis = new_basis if count < old_count else old_basis
    if count != old_count or new_basis != old_basis:
        stage.fitted_steps = None  # another weight path: what the knots were fitted for no longer holds
        stage.drop_corrections()  # corrections of knots that are no longer there
    if count != old_count:
        record_stage_source(stage)  # the blocks' own knots: what the model needs to run its source
    with torch.no_grad():
        for slot in stage.slots:
            if slot.kind == "shared":
                continue
            fitted = refit(stage.slot_tensor(slot).detach(), fit_basis, count, old_count)
            if slot.kind == "param":
                stage.knots[slot.name] = nn.Parameter(fitted)
            else:
                setattr(stage, f"{slot.kind}_{slot.name}", fitted)
        refit_fold_records(stage, fit_basis, count, old_count)
    stage.configure(basis=new_basis)


def refit_fold_records(owner: nn.Module, basis: str, count: int, old_count: int) -> None:
    """Give ``owner``'s (a stage's) records ``count`` knots, as its knot stacks go from ``old_count``.

    A fitted or refined knot mixes blocks with the coefficients of ``fit_matrix``; its record mixes
    theirs with the coefficients' magnitudes, normalised to sum to 1 (a weighted mean), and averages
    the gammas' magnitudes, so that blocks whose gammas differ in sign do not cancel into a zero
    scale. Any such record parametrizes the knot's tensors exactly (fine-tuning divides them by
    ``gamma * inv_std``); this one gives the knot the scale of the blocks it stands for.
    """
    records = fold_records(owner)
    if count == old_count or not records:
        return
    matrix = torch.tensor(
        [[abs(float(c)) for c in row] for row in fit_matrix(basis, count, old_count)], dtype=torch.float64
    )
    weights = matrix / matrix.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    for record in records.values():
        for part in ("gamma", "inv_std", "offset"):
            values = getattr(record, part)
            stack = values.detach().to(torch.float64)
            if part == "gamma":
                stack = stack.abs()
            setattr(record, part, torch.tensordot(weights, stack, dims=1).to(values.dtype))
