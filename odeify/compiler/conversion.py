"""``convert``, ``retarget``, ``set_steps``, ``set_backward`` and ``verify``: the public rewrite from a
residual network to ODE stages, and its check.

Each checks its arguments where they enter, then runs pipelines of :mod:`odeify.compiler.pipelines`:
``convert`` runs CONVERT at the native manifestation on a copy of the source, measures it against the
source (:mod:`odeify.compiler.verification`) and runs REMANIFEST for the requested manifestation;
``retarget`` runs REMANIFEST on a copy of the converted model, ``set_steps`` and ``set_backward`` on
the model itself (its parameters stay the same objects: switching the depth copies no knot).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from odeify.compiler.analysis import analysis_copy, input_shape_for, resolve_model, validate_leaf_modules
from odeify.compiler.fitted_depths import warn_unfitted_depth
from odeify.compiler.knot_refinement import warn_refined_knots
from odeify.compiler.pipeline import Job
from odeify.compiler.pipelines import CONVERT, REMANIFEST
from odeify.compiler.record import META
from odeify.compiler.verification import NotOneTensor, Verification, VerificationError, measure
from odeify.core.errors import ConfigError
from odeify.ir.settings import (
    BACKWARD_MODES,
    DEFAULTS,
    DepthMultiplier,
    StageRequest,
    parse_steps,
    resolve_steps,
    validate_backward,
)
from odeify.numerics.bases import get_basis
from odeify.numerics.tableaus import resolve_integrator
from odeify.passes.manifest import check_manifestation
from odeify.passes.segments import has_segments
from odeify.runtime.stage import ODEStage

__all__ = [
    "check_converted",
    "check_materialized",
    "convert",
    "converted_stages",
    "own_tensors",
    "retarget",
    "set_backward",
    "verify",
]

StepsSpec = int | str | Mapping[str, int | str]
IntegratorSpec = str | Mapping[str, str]
KnotsSpec = int | str | Mapping[str, int | str]
Settings = Callable[[list[str]], dict[str, StageRequest]]


def convert(
    model: str | nn.Module,
    integrator: IntegratorSpec = DEFAULTS["integrator"],
    steps: StepsSpec = DEFAULTS["steps"],
    basis: str = DEFAULTS["basis"],
    knots: KnotsSpec = DEFAULTS["knots"],
    input_size: Sequence[int] | None = None,
    backward: str = DEFAULTS["backward"],
    *,
    leaf_modules: Sequence[type[nn.Module]] = (),
    verify: bool = True,
    **load_kwargs,
) -> fx.GraphModule:
    """Compile a residual network into a GraphModule whose runs are ODE stages.

    ``model`` is a module, a timm name or a checkpoint path (``load_kwargs`` go to
    :func:`odeify.models.loading.load_model`, e.g. ``pretrained=True``); a module is copied, never
    changed, and the result is in the same train/eval mode as it. ``steps`` takes an int,
    ``"native"`` (the run's block count), a depth multiplier ``"x2"`` / ``"x0.5"``, or a dict
    {stage name: value}; ``knots`` an int, ``"native"`` or a dict. ``integrator`` and ``backward`` are
    one for the whole model or a dict {stage name: value} (say ``{"layer3": "alf"}`` beside
    ``backward={"layer3": "reversible"}``); a stage a dict leaves out gets the default. With the
    defaults the result reproduces the model exactly.

    ``verify``: the native conversion (the defaults) is run against the source on one seeded input
    before the requested manifestation is applied; the measured
    :class:`~odeify.compiler.verification.Verification` is ``result.meta["odeify"]["verification"]``
    (None when skipped, with the reason in ``["verification_skipped_because"]``: ``verify=False``, or
    an output that is not one tensor). Past the tolerance it raises
    :class:`~odeify.compiler.verification.VerificationError`, an odeify bug to report.
    """
    _check_values(integrator, resolve_integrator)  # fail fast on bad settings, before any tracing work
    get_basis(basis)
    _check_values(steps, parse_steps)
    if not isinstance(integrator, Mapping):  # per-stage integrators: each stage checks its pair
        _check_values(backward, lambda mode: validate_backward(mode, resolve_integrator(integrator)))
    validate_leaf_modules(leaf_modules)
    if isinstance(model, nn.Module):
        if converted_stages(model):
            raise ConfigError(
                "this model is already converted (it has ODE stages); use odeify.retarget(model, ...) "
                "to change its integrator, steps, knots, basis or backward mode."
            )
        check_materialized(model, "odeify.convert")
        _refuse_hooks(model)
        training, caller = model.training, model
        model = analysis_copy(model, copy_tensors=load_kwargs.get("checkpoint") is not None)
    module, name = resolve_model(model, **load_kwargs)
    if not isinstance(model, nn.Module):
        training, caller = module.training, None
    requested = dict(integrator=integrator, basis=basis, steps=steps, knots=knots, backward=backward)
    shape = input_shape_for(module, input_size)
    job = Job(
        source=analysis_copy(module).eval(),
        name=name,
        input_shape=shape,
        leaf_modules=leaf_modules,
        settings_for=_settings(DEFAULTS, fill=True),
    )
    with torch.no_grad():
        gm = CONVERT.run(job).gm
        del job  # the traced copy: the blocks its stages replaced go before the check's float64 copy
        if caller is not None:
            own_tensors(gm, caller)
        check = _record_verification(gm, module, shape) if verify else _record_skipped(gm, "verify=False")
        if requested != DEFAULTS:
            settings = _settings(requested, fill=True)
            job = Job(gm=gm, settings_for=settings, whole_model=_whole_model(backward, False))
            native = {stage.stage_name: stage.num_knots for stage in converted_stages(gm)}
            gm = REMANIFEST.run(job).gm
            _record_steps(gm, steps)
            warn_refined_knots(native, gm)
    gm = guard_input_dtype(gm).train(training)
    if check is not None and not check.passed:
        raise VerificationError(check, gm)
    return gm


def own_tensors(gm: nn.Module, source: nn.Module) -> None:
    """Give ``gm`` its own copy of each tensor it shares storage with ``source``'s parameters and buffers.

    Conversion traces a structural copy of the source that shares its tensors (no second copy of the
    weights: the stages' knots are new tensors, stacked from the blocks'); what the converted model
    keeps of the source as it was (the stem, the head) is copied here, once, so that training either
    model never changes the other. Tied tensors stay tied.
    """
    shared = {t.untyped_storage().data_ptr() for t in (*source.parameters(), *source.buffers()) if t.numel()}
    copies: dict[int, torch.Tensor] = {}

    def own(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.numel() or tensor.untyped_storage().data_ptr() not in shared:
            return tensor
        if id(tensor) not in copies:
            clone = tensor.detach().clone()
            copies[id(tensor)] = (
                nn.Parameter(clone, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else clone
            )
        return copies[id(tensor)]

    for module in gm.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is not None:
                    table[name] = own(tensor)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                setattr(module, name, own(value))


def _record_verification(
    gm: fx.GraphModule, source: nn.Module, shape: tuple[int, ...]
) -> Verification | None:
    """Measure the native ``gm`` against ``source`` and record the result on it (None: skipped)."""
    try:
        check = measure(gm, source, shape)
    except NotOneTensor as exc:
        return _record_skipped(gm, exc.reason)
    gm.meta[META].update(verification=check, verification_skipped_because=None)
    return check


def _record_skipped(gm: fx.GraphModule, reason: str) -> None:
    gm.meta[META].update(verification=None, verification_skipped_because=reason)


def _record_steps(gm: fx.GraphModule, steps: object) -> None:
    """Record what a whole-model depth multiplier became (``["steps_multiplier"]``, a
    :class:`~odeify.ir.settings.DepthMultiplier` as a dict); any other steps request drops an older one."""
    if steps is None:
        return
    record = gm.meta[META]
    if isinstance(steps, str) and steps.startswith("x"):
        depths = {stage.stage_name: stage.depth for stage in converted_stages(gm)}
        record["steps_multiplier"] = DepthMultiplier.of(steps, depths).to_dict()
    else:
        record.pop("steps_multiplier", None)


def verify(converted: nn.Module, source: nn.Module, input_size: Sequence[int] | None = None) -> Verification:
    """Compare ``converted`` (at its own manifestation; native depth reproduces the source) with
    ``source`` on one random input of ``input_size`` (C, H, W; default: the size the model was
    converted at), seeded with :data:`~odeify.compiler.verification.VERIFY_SEED`. Both run in eval
    mode; neither is changed. Raises ConfigError when an output is not one tensor."""
    check_converted(converted, "verify")
    traced = converted.meta.get(META, {}).get("input_shape")
    shape = tuple(traced) if input_size is None and traced else input_shape_for(source, input_size)
    return measure(converted, source, shape)


def retarget(
    converted: fx.GraphModule,
    integrator: IntegratorSpec | None = None,
    steps: StepsSpec | None = None,
    knots: KnotsSpec | None = None,
    basis: str | None = None,
    backward: str | None = None,
) -> fx.GraphModule:
    """Re-emit a converted model for another manifestation; the original network is not needed.

    ``knots`` below the current count compresses by least squares, above it refines by evaluating
    the current weight path; ``basis`` alone reinterprets the same knots with another basis.
    Settings left as None keep each stage's current value; every setting but ``basis`` may be a
    {stage name: value} dict, whose stages left out keep theirs. Returns a new module.
    """
    check_converted(converted, "retarget")
    if integrator is not None:
        _check_values(integrator, resolve_integrator)
    if basis is not None:
        get_basis(basis)
    if steps is not None:
        _check_values(steps, parse_steps)
    requested = {
        "integrator": integrator,
        "basis": basis,
        "steps": steps,
        "knots": knots,
        "backward": backward,
    }
    settings = _settings({k: v for k, v in requested.items() if v is not None}, fill=False)
    job = Job(gm=copy.deepcopy(converted), settings_for=settings)
    job.whole_model = _whole_model(backward, has_segments(converted))
    gm = guard_input_dtype(REMANIFEST.run(job).gm)
    _record_steps(gm, steps)
    warn_refined_knots({s.stage_name: s.num_knots for s in converted_stages(converted)}, gm)
    if steps is not None:
        warn_unfitted_depth(gm)
    return gm


def set_steps(converted: fx.GraphModule, steps: StepsSpec) -> fx.GraphModule:
    """Switch the depth of all stages (one spec) or some ({stage: spec}) **in place**; returns the model.

    ``steps`` as :func:`retarget` takes it: a count, ``"native"`` or a multiplier such as ``"x0.5"``.
    Only the emitted graphs change: the knots stay the same tensors (no copy, no refit), so one file
    serves every depth, and an optimizer built before keeps training them. A refused spec changes
    nothing. Warns (:class:`~odeify.compiler.fitted_depths.UnfittedDepthWarning`) where a stage then
    runs at a depth its knots were not calibrated or fine-tuned for.
    """
    check_converted(converted, "set_steps")
    settings = _checked_steps(converted, steps)
    job = Job(gm=converted, settings_for=settings, whole_model=has_segments(converted))
    gm = REMANIFEST.run(job).gm
    _record_steps(gm, steps)
    warn_unfitted_depth(gm)
    return gm


def relower(converted: fx.GraphModule) -> fx.GraphModule:
    """Emit ``converted``'s stages again **in place**, every setting kept: after a change the emitted
    graph reads (a stage's per-depth knot correction added or dropped); returns the model."""
    job = Job(gm=converted, settings_for=_settings({}, fill=False), whole_model=has_segments(converted))
    return REMANIFEST.run(job).gm


def steps_at(converted: fx.GraphModule, steps: StepsSpec) -> dict[str, int]:
    """Each stage's step count at the depth ``steps`` (as :func:`retarget` and :func:`set_steps` take it,
    refused as they refuse it), without changing or copying the model."""
    check_converted(converted, "steps_at")
    stages = converted_stages(converted)
    requests = _checked_steps(converted, steps)([s.stage_name for s in stages])
    return {
        stage.stage_name: stage.steps
        if (request := requests[stage.stage_name]).steps is None
        else resolve_steps(request.steps, stage.depth, stage.stage_name, request.steps_for_all)
        for stage in stages
    }


def _checked_steps(converted: fx.GraphModule, steps: object) -> Settings:
    """The per-stage settings of a depth request, checked against ``converted``'s stages."""
    _check_values(steps, parse_steps)
    settings = _settings({"steps": steps}, fill=False)
    check_manifestation(converted, settings([s.stage_name for s in converted_stages(converted)]))
    return settings


def set_backward(converted: fx.GraphModule, backward: str | Mapping[str, str]) -> fx.GraphModule:
    """Switch the backward mode of all stages (str) or some (dict) **in place**; returns the model.

    Only the emitted graph changes: the parameters stay the same objects, so an optimizer built
    before keeps training them. A refused mode (e.g. 'reversible' on an Euler stage) changes nothing.
    """
    check_converted(converted, "set_backward")
    if not isinstance(backward, (str, Mapping)):
        raise ConfigError(
            f"set_backward takes a backward mode ({', '.join(BACKWARD_MODES)}) or a {{stage: mode}} dict, "
            f"not {backward!r:.60}, which would change nothing. Pass the mode to switch to."
        )
    settings = _settings({"backward": backward}, fill=False)
    check_manifestation(converted, settings([s.stage_name for s in converted_stages(converted)]))
    job = Job(
        gm=converted, settings_for=settings, whole_model=_whole_model(backward, has_segments(converted))
    )
    return REMANIFEST.run(job).gm


def check_materialized(model: nn.Module, what: str) -> None:
    """Refuse a module with tensors on the meta device (shapes without values), naming ``what`` refuses."""
    meta = next((name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
    if meta is not None:
        raise ConfigError(
            f"{what}: the model's tensors are on the meta device (shapes without values; {meta} is the "
            "first), so there is nothing to compute or write. Give it values first: model.to_empty(device="
            "'cpu') and then model.load_state_dict(...), or build it on a real device."
        )


def _refuse_hooks(model: nn.Module) -> None:
    """Refuse forward hooks: the traced graph calls no module's hooks, so the result would differ."""
    hooked = next(
        (
            name or "the model"
            for name, m in model.named_modules()
            if m._forward_pre_hooks or m._forward_hooks
        ),
        None,
    )
    if hooked is not None:
        raise ConfigError(
            f"odeify.convert: {hooked} has a forward hook or pre-hook, which the converted model would not "
            "run (its graph is traced from the forward alone), so it would compute something else. Remove "
            "the hook (handle.remove()) and apply what it does to the inputs or outputs yourself."
        )


def converted_stages(converted: nn.Module) -> list[ODEStage]:
    """The ODE stages of a converted model, in graph order."""
    if not isinstance(converted, nn.Module):
        raise ConfigError(f"expected a converted model (an nn.Module), got {type(converted).__name__}.")
    return [m for m in converted.modules() if isinstance(m, ODEStage)]


def check_converted(model: object, what: str) -> None:
    """Refuse anything but a converted model, naming the call (``what``) that wanted one."""
    if not isinstance(model, fx.GraphModule) or not converted_stages(model):
        raise ConfigError(
            f"{what} takes a converted model (the output of odeify.convert, odeify.retarget or "
            f"odeify.load); got {type(model).__name__}, which has no ODE stages."
        )


def guard_input_dtype(gm: fx.GraphModule) -> fx.GraphModule:
    """Make a floating input of another dtype than the weights fail with a clear error, at the call.

    Idempotent: every pipeline's result gets the guard once, whatever it was made from.
    """
    if not any(hook is _check_input_dtype for hook in gm._forward_pre_hooks.values()):
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


def _whole_model(backward: object, current: bool) -> bool:
    """Whether the parts between the stages are recomputed in backward too (the whole-model plan).

    One memory-free mode for the whole model (``backward="reversible"``) applies to everything: the
    stem, the blocks that change shape and the head are checkpointed segments. A {stage: mode} dict
    sets stages only, and ``"backprop"`` turns the plan off; no setting keeps the current plan.
    """
    if backward is None:
        return current
    return isinstance(backward, str) and backward != "backprop"


def _check_values(spec: object, check: Callable[[object], object]) -> None:
    """Run ``check`` on a setting's value, or on each value of a {stage: value} dict."""
    for value in spec.values() if isinstance(spec, Mapping) else [spec]:
        check(value)


def _settings(requested: Mapping[str, object], fill: bool) -> Settings:
    """The per-stage settings of a call, as a function of the stage names (known after analysis).

    Each setting is one value for every stage or a {stage: value} dict (all but basis); with
    ``fill`` (convert) a dict's missing stages get the default, without (retarget) they keep theirs.
    """

    def settings_for(names: list[str]) -> dict[str, StageRequest]:
        per_stage = {key: _per_stage(value, names, key, fill) for key, value in requested.items()}
        for_all = "steps" in requested and not isinstance(requested["steps"], Mapping)
        return {
            name: StageRequest(
                **{k: v[name] for k, v in per_stage.items() if name in v}, steps_for_all=for_all
            )
            for name in names
        }

    return settings_for


def _per_stage(spec: object, names: list[str], what: str, fill: bool) -> dict[str, object]:
    """Expand a scalar or {stage: value} setting to every stage, checking the names."""
    if not isinstance(spec, Mapping):
        return {n: spec for n in names}
    if what == "basis":
        raise ConfigError("basis is one value for every stage (a name such as 'linear'), not a dict.")
    unknown = [k for k in spec if k not in names]
    if unknown:
        raise ConfigError(
            f"{what} names stage(s) {', '.join(map(repr, unknown))} that do not exist; "
            f"the stages are: {', '.join(names)}."
        )
    default = DEFAULTS[what] if fill and what in ("integrator", "steps", "knots") else None
    return {n: spec.get(n, default) for n in names if n in spec or default is not None}
