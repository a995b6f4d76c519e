"""``convert`` and ``retarget``: the public rewrite from a residual network to ODE stages.

convert = trace -> fold BatchNorm -> analyze -> lift runs into ODEStages -> lower (unroll).
retarget = raise stages -> change knots/basis/integrator/steps/backward -> lower again.
"""

from __future__ import annotations

import copy
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction

import torch
import torch.fx as fx
from torch import nn

from odeify.compiler.analysis import analyze_graph, input_shape_for, resolve_model, validate_leaf_modules
from odeify.compiler.record import record_conversion
from odeify.core.budget import check_fit_work, check_knot_bytes
from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError
from odeify.ir.plan import Run
from odeify.ir.settings import validate_backward, validate_steps
from odeify.numerics.bases import fit_matrix, get_basis, validate_knots
from odeify.numerics.tableaus import resolve_integrator
from odeify.passes.fold_bn import fold_batchnorm
from odeify.passes.lift import RunParts, lift_runs
from odeify.passes.lower import lower_stages, raise_stages, stage_nodes
from odeify.passes.segments import checkpoint_segments, has_segments
from odeify.passes.tracing import annotate_shapes, trace
from odeify.runtime.stage import ODEStage

StepsSpec = int | str | Mapping[str, int | str]
KnotsSpec = int | str | Mapping[str, int | str]


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
    :func:`odeify.models.loading.load_model`, e.g. ``pretrained=True``); a module is copied, never
    changed, and the result is in the same train/eval mode as it. ``steps`` takes an int,
    ``"native"`` (the run's block count), a depth multiplier ``"x2"`` / ``"x0.5"``, or a dict
    {stage name: value}; ``knots`` an int, ``"native"`` or a dict. ``backward`` is one mode for the
    whole model or a dict {stage name: mode}. With the defaults the result reproduces the model
    exactly.
    """
    resolve_integrator(integrator)  # fail fast on bad settings, before any tracing work
    get_basis(basis)
    _check_backward_spec(backward, integrator)
    validate_leaf_modules(leaf_modules)
    if isinstance(model, nn.Module):
        if converted_stages(model):
            raise ConfigError(
                "this model is already converted (it has ODE stages); use odeify.retarget(model, ...) "
                "to change its integrator, steps, knots, basis or backward mode."
            )
        training = model.training
        model = copy.deepcopy(model)  # loading puts a module in eval mode: never the caller's
    module, name = resolve_model(model, **load_kwargs)
    if not isinstance(model, nn.Module):
        training = module.training
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
    backward_of = _per_stage(backward, names, "backward")
    dtype_size = model_dtype(source).itemsize
    for run in plan.runs:  # every budget before any allocation
        if knots_of[run.name] != "native":
            count = validate_knots(knots_of[run.name], run.length, basis)
            per_knot = run.blocks[0].parameters * dtype_size
            _check_refit_budget(run.name, per_knot, count, run.length, basis)

    def make_stage(run: Run, parts: RunParts) -> ODEStage:
        depth = run.length
        count = depth if knots_of[run.name] == "native" else validate_knots(knots_of[run.name], depth, basis)
        tensors = {
            slot.name: _refit(parts.tensors[slot.name], basis, count, depth)
            if slot.kind != "shared"
            else parts.tensors[slot.name]
            for slot in parts.slots
        }
        return ODEStage(
            run.name,
            parts.template,
            parts.slots,
            tensors,
            run.form,
            depth,
            parts.variants,
            basis=basis,
            integrator=integrator,
            steps=_resolve_steps(steps_of[run.name], depth, run.name),
            backward=backward_of.get(run.name, "backprop"),
        )

    with torch.no_grad():
        gm, skipped = lift_runs(gm, plan.runs, make_stage)
    gm = record_conversion(gm, module, plan, skipped)  # what rebuilds it, and its timm interface
    return _guard_input_dtype(_lower(gm, _whole_model(backward, False))).train(training)


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
    _check_converted(converted, "retarget")
    if integrator is not None:
        resolve_integrator(integrator)
    if basis is not None:
        get_basis(basis)
    was_whole = has_segments(converted)
    gm = raise_stages(copy.deepcopy(converted))
    stages = {stage.stage_name: stage for _, stage in stage_nodes(gm)}
    names = list(stages)
    # a dict names the stages to change; the others keep their current value (not 'native')
    steps_of = _per_stage(steps, names, "steps", fill=False) if steps is not None else {}
    knots_of = _per_stage(knots, names, "knots", fill=False) if knots is not None else {}
    backward_of = _per_stage(backward, names, "backward", fill=False) if backward is not None else {}
    for name in knots_of:  # every budget before any allocation
        stage = stages[name]
        per_knot = sum(t.numel() // max(1, t.shape[0]) * t.element_size() for t in stage.knot_tensors())
        count = _knot_count(stage, knots_of[name], basis)
        _check_refit_budget(name, per_knot, count, stage.num_knots, basis or stage.basis)
    for name, stage in stages.items():
        if name in knots_of or basis is not None:
            _change_knots(stage, knots_of.get(name), basis)
        stage.configure(
            integrator=integrator,
            steps=_resolve_steps(steps_of[name], stage.depth, name) if name in steps_of else None,
            backward=backward_of.get(name),
        )
    return _lower(gm, _whole_model(backward, was_whole))


def set_backward(converted: fx.GraphModule, backward: str | Mapping[str, str]) -> fx.GraphModule:
    """Switch the backward mode of all stages (str) or some (dict) **in place**; returns the model.

    Only the emitted graph changes: the parameters stay the same objects, so an optimizer built
    before keeps training them. A refused mode (e.g. 'reversible' on an Euler stage) changes nothing.
    """
    _check_converted(converted, "set_backward")
    stages = converted_stages(converted)
    modes = _per_stage(backward, [stage.stage_name for stage in stages], "backward")
    for stage in stages:
        if stage.stage_name in modes:
            validate_backward(modes[stage.stage_name], stage.integrator)
    whole = _whole_model(backward, has_segments(converted))
    raise_stages(converted)
    for stage in stages:
        if stage.stage_name in modes:
            stage.configure(backward=modes[stage.stage_name])
    return _lower(converted, whole)


def converted_stages(converted: nn.Module) -> list[ODEStage]:
    """The ODE stages of a converted model, in graph order."""
    if not isinstance(converted, nn.Module):
        raise ConfigError(f"expected a converted model (an nn.Module), got {type(converted).__name__}.")
    return [m for m in converted.modules() if isinstance(m, ODEStage)]


def _whole_model(backward: object, current: bool) -> bool:
    """Whether the parts between the stages are recomputed in backward too (the whole-model plan).

    One memory-free mode for the whole model (``backward="reversible"``) applies to everything: the
    stem, the blocks that change shape and the head are checkpointed segments. A {stage: mode} dict
    sets stages only, and ``"backprop"`` turns the plan off; no setting keeps the current plan.
    """
    if backward is None:
        return current
    return isinstance(backward, str) and backward != "backprop"


def _lower(gm: fx.GraphModule, whole_model: bool) -> fx.GraphModule:
    """Lower the stages, then checkpoint the segments between them for the whole-model plan."""
    gm = lower_stages(gm)
    return checkpoint_segments(gm) if whole_model else gm


def _check_converted(model: object, what: str) -> None:
    if not isinstance(model, fx.GraphModule) or not converted_stages(model):
        raise ConfigError(
            f"{what} takes a converted model (the output of odeify.convert, odeify.retarget or "
            f"odeify.load); got {type(model).__name__}, which has no ODE stages."
        )


def _check_backward_spec(backward: object, integrator: str) -> None:
    """Validate convert's ``backward``: one mode for the whole model, or a {stage: mode} dict."""
    modes = backward.values() if isinstance(backward, Mapping) else [backward]
    for mode in modes:
        validate_backward(mode, resolve_integrator(integrator))


def _guard_input_dtype(gm: fx.GraphModule) -> fx.GraphModule:
    """Make a floating input of another dtype than the weights fail with a clear error, at the call."""
    gm.register_forward_pre_hook(_check_input_dtype)
    return gm


def _check_input_dtype(module: nn.Module, args: tuple) -> None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return
    weight = next((p for p in module.parameters() if p.is_floating_point()), None)
    if weight is None or weight.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
        return
    raise ConfigError(
        f"the input is {x.dtype} but this converted model's weights are {weight.dtype}: pass "
        f"x.to({weight.dtype}), or convert the model's dtype with model.to({x.dtype})."
    )


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
    count = _knot_count(stage, knots, basis)
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


def _knot_count(stage: ODEStage, knots: int | str | None, basis: str | None) -> int:
    """The knot count a retarget asks of ``stage``: unchanged (None), its depth ('native'), or validated."""
    if knots is None:
        return stage.num_knots
    if knots == "native":
        return stage.depth
    return validate_knots(knots, stage.depth, basis or stage.basis)


def _check_refit_budget(stage: str, bytes_per_knot: int, count: int, samples: int, basis: str) -> None:
    """Refuse a knot count whose tensors or exact least-squares fit would be too large (core.budget)."""
    check_knot_bytes(stage, count, bytes_per_knot)
    check_fit_work(stage, count, samples, basis)


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


_DECIMAL = re.compile(r"\d+(\.\d*)?|\.\d+")


def _resolve_steps(spec, depth: int, stage: str) -> int:
    """'native' -> depth, 'x<m>' -> round(m * depth) (at least 1), an integer as is (validated).

    One spelling in Python and on the command line: ``steps=4`` is 4 steps, ``steps="x2"`` twice
    the run's block count. A float is refused rather than guessed at (2.0 steps or a 2x multiplier?).
    """
    if spec == "native":
        return depth
    if isinstance(spec, str) and spec.startswith("x"):
        # Plain decimals only: Fraction("1e999999999") would build a billion-digit integer.
        plain = _DECIMAL.fullmatch(spec[1:]) is not None and len(spec) <= 16
        factor = Fraction(spec[1:]) if plain else None
        if factor is None or factor <= 0:
            raise ConfigError(
                f"a steps multiplier is 'x' and a positive number, e.g. 'x2' or 'x0.5'; got {spec!r}."
            )
        return max(1, round(factor * depth))
    if isinstance(spec, float):
        raise ConfigError(
            f"steps for stage '{stage}' is the float {spec!r}: pass an integer number of steps (e.g. "
            f"{max(1, round(spec)) if math.isfinite(spec) else 4}) or a depth multiplier as a string "
            f"(e.g. 'x{spec:g}')."
        )
    if isinstance(spec, numbers.Integral) and not isinstance(spec, bool):
        spec = int(spec)  # numpy and torch integers
    return validate_steps(spec, stage)
