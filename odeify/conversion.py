"""``convert`` and ``retarget``: the public rewrite from a residual network to ODE stages.

convert = trace -> fold BatchNorm -> analyze -> lift runs into ODEStages -> lower (unroll).
retarget = raise stages -> change knots/basis/integrator/steps/backward -> lower again.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

import torch
import torch.fx as fx
from torch import nn

from odeify.analysis import analyze_graph, input_shape_for, resolve_model
from odeify.bases import fit_matrix, get_basis, validate_knots
from odeify.errors import ConfigError
from odeify.passes.fold_bn import fold_batchnorm
from odeify.passes.lift import lift_runs
from odeify.passes.lower import lower_stages, raise_stages, stage_nodes
from odeify.plan import Run
from odeify.recipe import record_conversion
from odeify.settings import validate_steps
from odeify.stage import ODEStage
from odeify.tableaus import resolve_integrator
from odeify.tracing import annotate_shapes, trace

StepsSpec = int | float | str | Mapping[str, int | float | str]
KnotsSpec = int | str | Mapping[str, int | str]
META = "odeify"


def convert(
    model: str | nn.Module,
    integrator: str = "euler",
    steps: StepsSpec = "native",
    basis: str = "constant",
    knots: KnotsSpec = "native",
    input_size: Sequence[int] | None = None,
    backward: str = "backprop",
    *,
    leaf_modules: Sequence[type[nn.Module]] = (),
    **load_kwargs,
) -> fx.GraphModule:
    """Compile a residual network into a GraphModule whose runs are ODE stages.

    ``model`` is a module, a timm name or a checkpoint path (``load_kwargs`` go to
    :func:`odeify.loading.load_model`, e.g. ``pretrained=True``). ``steps`` and ``knots`` take an
    int, ``"native"`` (the run's block count), a float depth multiplier (steps only) or a dict
    {stage name: value}. With the defaults the result reproduces the model exactly.
    """
    resolve_integrator(integrator)  # fail fast on bad settings, before any tracing work
    get_basis(basis)
    module, name = resolve_model(model, **load_kwargs)
    shape = input_shape_for(module, input_size)
    source = copy.deepcopy(module).eval()
    with torch.no_grad():
        gm = trace(source, leaf_modules)
        annotate_shapes(gm, shape)
        fold_batchnorm(gm)
        plan = analyze_graph(gm, name, shape)
    names = [run.name for run in plan.runs]
    steps_of = _per_stage(steps, names, "steps")
    knots_of = _per_stage(knots, names, "knots")

    def make_stage(run: Run, parts: dict) -> ODEStage:
        depth = run.length
        count = depth if knots_of[run.name] == "native" else validate_knots(knots_of[run.name], depth, basis)
        tensors = {
            slot.name: _refit(parts["tensors"][slot.name], basis, count, depth)
            if slot.kind != "shared"
            else parts["tensors"][slot.name]
            for slot in parts["slots"]
        }
        return ODEStage(
            run.name,
            parts["template"],
            parts["slots"],
            tensors,
            run.form,
            depth,
            parts["variants"],
            basis=basis,
            integrator=integrator,
            steps=_resolve_steps(steps_of[run.name], depth, run.name),
            backward=backward,
        )

    with torch.no_grad():
        gm, skipped = lift_runs(gm, plan.runs, make_stage)
    gm = record_conversion(gm, module, plan, skipped)  # what rebuilds it, and its timm interface
    return lower_stages(gm).train(module.training)


def retarget(
    converted: fx.GraphModule,
    integrator: str | None = None,
    steps: StepsSpec | None = None,
    knots: KnotsSpec | None = None,
    basis: str | None = None,
    backward: str | None = None,
) -> fx.GraphModule:
    """Re-emit a converted model for another manifestation; the original network is not needed.

    ``knots`` below the current count compresses by least squares, above it refines by evaluating
    the current weight path; ``basis`` alone reinterprets the same knots with another basis.
    Settings left as None keep each stage's current value. Returns a new module.
    """
    if integrator is not None:
        resolve_integrator(integrator)
    if basis is not None:
        get_basis(basis)
    gm = raise_stages(copy.deepcopy(converted))
    stages = {stage.stage_name: stage for _, stage in stage_nodes(gm)}
    if not stages:
        raise ConfigError("this module has no ODE stages; retarget takes the output of odeify.convert.")
    names = list(stages)
    # a dict names the stages to change; the others keep their current value (not 'native')
    steps_of = _per_stage(steps, names, "steps", fill=False) if steps is not None else {}
    knots_of = _per_stage(knots, names, "knots", fill=False) if knots is not None else {}
    for name, stage in stages.items():
        if name in knots_of or basis is not None:
            _change_knots(stage, knots_of.get(name), basis)
        stage.configure(
            integrator=integrator,
            steps=_resolve_steps(steps_of[name], stage.depth, name) if name in steps_of else None,
            backward=backward,
        )
    return lower_stages(gm)


def set_backward(converted: fx.GraphModule, backward: str | Mapping[str, str]) -> fx.GraphModule:
    """The converted model with another backward mode for all stages (str) or some (dict)."""
    names = [stage.stage_name for stage in converted_stages(converted)]
    modes = _per_stage(backward, names, "backward")
    gm = raise_stages(copy.deepcopy(converted))
    for _, stage in stage_nodes(gm):
        if stage.stage_name in modes:
            stage.configure(backward=modes[stage.stage_name])
    return lower_stages(gm)


def converted_stages(converted: nn.Module) -> list[ODEStage]:
    """The ODE stages of a converted model, in graph order."""
    return [m for m in converted.modules() if isinstance(m, ODEStage)]


def _change_knots(stage: ODEStage, knots: int | str | None, basis: str | None) -> None:
    """Refit every knot tensor of ``stage`` in place for a new knot count and/or basis.

    A new basis may read the current knots as they are only when they are one per block (the
    blocks' own weights, which every basis interpolates): knots that were compressed by least
    squares or refined under the old basis are values of *that* basis's weight path, and reading
    them with another basis would silently swap the weight path. Changing the knot count in the
    same call is allowed: it resamples the current path (see the ConfigError's message).
    """
    old_basis, old_count = stage.basis, stage.num_knots
    new_basis = get_basis(basis).name if basis is not None else old_basis
    count = old_count if knots is None else stage.depth if knots == "native" else None
    if count is None:
        count = validate_knots(knots, stage.depth, new_basis)
    if new_basis != old_basis and count == old_count and old_count != stage.depth:
        how = "compressed by least squares" if old_count < stage.depth else "refined"
        raise ConfigError(
            f"stage '{stage.stage_name}' has {old_count} knots for its {stage.depth} blocks, {how} under "
            f"the '{old_basis}' basis; reading them with the '{new_basis}' basis would silently change its "
            f"weight path (only one-knot-per-block stages can switch basis as they are). To fit "
            f"{old_count} '{new_basis}' knots to the original blocks, convert the original model with "
            f"basis='{new_basis}', knots={old_count}; to resample the current weight path, pass knots "
            f"too, e.g. retarget(..., basis='{new_basis}', knots='native')."
        )
    # compression fits with the new basis; refinement evaluates the current weight path
    fit_basis = new_basis if count < old_count else old_basis
    with torch.no_grad():
        for slot in stage.slots:
            if slot.kind == "shared":
                continue
            refit = _refit(stage.slot_tensor(slot).detach(), fit_basis, count, old_count)
            if slot.kind == "param":
                stage.knots[slot.name] = nn.Parameter(refit)
            else:
                setattr(stage, f"{slot.kind}_{slot.name}", refit)
    stage.configure(basis=new_basis)


def _refit(stack: torch.Tensor, basis: str, count: int, depth: int) -> torch.Tensor:
    """Knots for ``count`` knots from ``depth`` samples: exact identity when equal."""
    if count == depth:
        return stack.detach().clone()
    matrix = torch.tensor(
        [[float(c) for c in row] for row in fit_matrix(basis, count, depth)], dtype=torch.float64
    )
    fitted = torch.tensordot(matrix, stack.detach().to(torch.float64), dims=1)
    return fitted.to(stack.dtype)


def _per_stage(spec, names: list[str], what: str, fill: bool = True) -> dict:
    """Expand a scalar or {stage: value} setting to every stage, checking the names.

    With ``fill`` a dict's missing steps/knots stages get 'native' (convert); without, they are
    left out so the caller keeps their current value (retarget).
    """
    if isinstance(spec, Mapping):
        unknown = [k for k in spec if k not in names]
        if unknown:
            raise ConfigError(
                f"{what} names stage(s) {', '.join(map(repr, unknown))} that do not exist; "
                f"the stages are: {', '.join(names)}."
            )
        default = "native" if fill and what in ("steps", "knots") else None
        return {n: spec.get(n, default) for n in names if n in spec or default is not None}
    return {n: spec for n in names}


def _resolve_steps(spec, depth: int, stage: str) -> int:
    """'native' -> depth, a float multiplier m -> round(m * depth), an int as is (validated)."""
    if spec == "native":
        return depth
    if isinstance(spec, float):
        if not math.isfinite(spec) or spec <= 0:
            raise ConfigError(f"a steps multiplier must be > 0 (e.g. 2.0 for twice the depth); got {spec}.")
        return max(1, round(Fraction(spec) * depth))
    return validate_steps(spec, stage)
