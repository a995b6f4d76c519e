"""Calibration: fit a coarse manifestation's stages to what the source network computes, from images.

``retarget`` makes a cheaper model by reading a stage's weights at fewer steps, or from fewer knots
fitted to the blocks' weights by least squares. Trained weights are not smooth in depth, so a good
fit of the weights can be a poor fit of what the stage computes: two knots per stage keep 45-85% of
a 98% model, a ViT at half its steps 25%. Calibration looks at data instead, as post-training
quantization's block reconstruction does (AdaRound, BRECQ: each block fitted in turn so that its
output on a few hundred unlabelled images matches the full-precision network's):

- stage after stage, in graph order, the stage's input is the calibrated model's own activation
  there (the stages before it already fitted, so errors do not pile up), its target the source
  network's activation at the stage's end (:func:`odeify.compiler.source_network.source_network`, or
  a ``source`` model given); a stage that runs its source stage's blocks as they are (native depth
  and knots, the same tensors) is left as it is;
- what is fitted is the stage's knot tensors in the source's coordinates, what fine-tuning trains
  (:class:`odeify.train.parametrization.SourceCoordinates`: a folded BatchNorm's conv weight, gamma
  and beta, not the folded product), by Adam on the stage's relative squared error, minibatches of
  the calibration images, with a cosine learning-rate decay; nothing outside the stages changes;
- the default ``objective="output"`` adds, on the network's last stage, the relative error of the
  network's output (the tail after the stage: :mod:`odeify.train.network_tail`) against the
  source's: a ViT's head reads the class token alone, and fitting what it reads lifts a ViT at a
  third of its steps by 4 to 6 points (docs/calibration.md); ``"stage"`` fits the stage outputs only;
- several depths at once (``steps=["native", "x0.5"]``): one set of knots, each stage's objective
  summed over the depths, each depth's stage input the calibrated model's own activation at that
  depth; a model that computes its source exactly at every depth asked (native steps and knots, or
  knots that read as one-block stages) is refused, one rule whatever makes it exact;
- bounded: ``images`` samples, ``iterations`` optimizer steps per stage, and a ``seconds`` budget
  shared by the stages; deterministic for a seed (on one thread). Memory: the images and one stage's
  input and target at a time (each stage's target is taken by its own partial forward of the source,
  not all kept from one pass: resnet50's four at 224x224 would be 6 MB per image).

The :class:`CalibrationReport` gives each stage's residual, ``||stage(x) - target|| / ||target||`` over
the calibration images, before and after the fit.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from odeify.codegen.emit import StepGraph
from odeify.compiler.conversion import check_converted, converted_stages, retarget
from odeify.compiler.source_network import source_network, unknown_source
from odeify.core.errors import ConfigError
from odeify.ir.settings import StepsSpec
from odeify.ir.source_tensors import SOURCE_PREFIX, record_stage_source
from odeify.runtime.stage import ODEStage
from odeify.train.calibration_data import CalibrationData, calibration_images
from odeify.train.manifestations import runs_as_converted
from odeify.train.network_tail import network_tail
from odeify.train.parametrization import SourceCoordinates
from odeify.train.progress import LOGGER
from odeify.train.recipe import (
    CALIBRATION_IMAGES,
    CALIBRATION_OBJECTIVE,
    CALIBRATION_OBJECTIVES,
    CALIBRATION_STEPS,
)

__all__ = [
    "CalibrationReport",
    "DepthFit",
    "StageFit",
    "calibrate",
]

DEFAULT_LR = 1e-3
DEFAULT_BATCH = 64
HEAD_ROOM = 1e-12  # a target this small in energy has nothing to match: the residual is reported as 0


DepthSpec = StepsSpec | Mapping[str, StepsSpec]
"""A depth as ``odeify.retarget(steps=...)`` takes it: an int, ``"native"``, a multiplier such as
``"x0.5"``, or a {stage name: steps} dict (its stages left out keep theirs)."""


@dataclass
class DepthFit:
    """One listed depth of a stage's fit: the stage's step count there, its output's relative residual
    before and after, and the network output's where it was fitted too."""

    depth: str
    steps: int
    before: float
    after: float
    output: tuple[float, float] | None = None

    def __str__(self) -> str:
        output = f", output residual {self.output[0]:.4f} -> {self.output[1]:.4f}" if self.output else ""
        steps = f"{self.steps} step{'s' if self.steps != 1 else ''}"
        return f"at {self.depth} ({steps}) residual {self.before:.4f} -> {self.after:.4f}{output}"


LEFT_AS_SOURCE = "it runs its source stage's blocks as they are"
LEFT_AS_EXACT = "it computes its source stage exactly: residual 0 on the calibration images"


@dataclass
class StageFit:
    """One stage's calibration: its relative residual on the calibration images before and after;
    None for a stage left as it is because it computes its source stage exactly (``why`` says how).
    ``output``: the network output's relative residual before and after, where it was fitted too.
    ``depths``: each listed depth's residuals, where ``calibrate`` was given ``steps``; ``before``,
    ``after`` and ``output`` are then the first listed depth's."""

    stage: str
    before: float | None
    after: float | None
    iterations: int
    seconds: float
    output: tuple[float, float] | None = None
    depths: list[DepthFit] = field(default_factory=list)
    why: str = LEFT_AS_SOURCE

    @property
    def fitted(self) -> bool:
        return self.before is not None

    def __str__(self) -> str:
        if not self.fitted:
            return f"{self.stage}: left as it is ({self.why})"
        if self.depths:
            fits = "; ".join(str(depth) for depth in self.depths)
            return f"{self.stage}: {fits} ({self.iterations} steps, {self.seconds:.1f} s)"
        output = f", output residual {self.output[0]:.4f} -> {self.output[1]:.4f}" if self.output else ""
        return (
            f"{self.stage}: residual {self.before:.4f} -> {self.after:.4f}{output} "
            f"({self.iterations} steps, {self.seconds:.1f} s)"
        )


@dataclass
class CalibrationReport:
    """What :func:`calibrate` did: the images, the time, the depths fitted (empty: the model's own),
    and each stage's fit."""

    images: int
    seconds: float
    stages: list[StageFit] = field(default_factory=list)
    depths: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        at = f" at depths {', '.join(self.depths)}" if self.depths else ""
        head = f"calibrated on {self.images} images{at} in {self.seconds:.1f} s:"
        return "\n".join([head, *(f"  {fit}" for fit in self.stages)])


def calibrate(
    model: fx.GraphModule,
    data: CalibrationData,
    *,
    steps: DepthSpec | Sequence[DepthSpec] | None = None,
    images: int = CALIBRATION_IMAGES,
    seconds: float | None = None,
    iterations: int = CALIBRATION_STEPS,
    lr: float = DEFAULT_LR,
    batch_size: int = DEFAULT_BATCH,
    seed: int = 0,
    source: nn.Module | None = None,
    objective: str = CALIBRATION_OBJECTIVE,
    progress: bool = True,
) -> tuple[fx.GraphModule, CalibrationReport]:
    """A new model of ``model``'s manifestation whose stages match the source network's on ``data``.

    ``data``: unlabelled images (see :func:`odeify.train.calibration_data.calibration_images`); a
    seeded choice of ``images`` of them is read. ``steps``: the depths to fit one set of knots for,
    each as ``odeify.retarget(steps=...)`` takes it (``["native", "x0.5", "x0.25"]``; one spec alone
    is a list of one); None (the default) fits the depth the model runs at. Each stage's objective is
    then the sum over the depths of its objective at that depth, the stage's input being the
    calibrated model's own activation at that depth. The depths weigh equally, on relative errors:
    the target is the same for all, so this is the plain squared error summed over depths, in which a
    coarse depth, whose residual is the largest, leads the fit, while a depth near the source (native,
    residual 0 at the start) pulls back as soon as the knots leave it; no depth is favoured but by
    how far it is from the source. The model keeps the depth it runs at; a stage is fitted unless it
    computes its source stage exactly at every listed depth, and each stage fitted records the step
    counts it was fitted for (``stage.fitted_steps``).
    ``source``: the network whose activations each stage is fitted to, a converted model at native
    depth with the same stage names (default: the source network ``model`` keeps; a model that
    computes that network exactly at every depth asked is refused). ``seconds`` caps the whole fit
    (each stage gets an equal share of what is left); ``iterations`` caps each stage. ``objective``:
    ``"output"`` (the default) fits each stage's output and, on the network's last stage, the
    network's output too (where nothing but the stage's output reaches the head; elsewhere the stage
    loss); ``"stage"`` fits each stage's output only. ``progress`` logs a line per stage (logger
    ``odeify``). Returns the calibrated model, in ``model``'s train/eval mode, and the
    :class:`CalibrationReport`.
    """
    _check_arguments(model, images, seconds, iterations, lr, batch_size, seed)
    check_objective(objective, "calibrate's objective")
    depths = _depths(model, steps)
    own_source = source is None
    if own_source:
        _check_source_known(model)
        source = source_network(model)
    elif not converted_stages(source):
        raise ConfigError("calibrate's source must be a converted model (odeify.convert) at native depth.")
    started = time.perf_counter()
    calibrated = copy.deepcopy(model)
    for stage in converted_stages(calibrated):
        record_stage_source(stage)  # its knots are its source only while they are the blocks'
    work = _with_stage_calls(calibrated)
    reference = _with_stage_calls(source).eval()
    paths, reference_paths = _stage_paths(work), _stage_paths(reference)
    missing = [name for name in paths if name not in reference_paths]
    if missing:
        raise ConfigError(
            f"calibrate's source has no stage {missing[0]!r}: it must be converted from the same network "
            f"(its stages: {', '.join(reference_paths)})."
        )
    training = model.training
    work.eval()
    to_fit = [
        name for name, path in paths.items()
        if not all(
            _runs_its_source(_at_depth(work, paths, depth).get_submodule(path),
                             reference.get_submodule(reference_paths[name]))
            for depth in depths
        )
    ]  # fmt: skip
    if own_source and not to_fit:
        raise ConfigError(_nothing_to_fit(model, depths, "Euler, one step and one constant knot per block"))
    x = calibration_images(data, model, images, seed)
    report = CalibrationReport(images=x.shape[0], seconds=0.0, depths=[d.label for d in depths if d.label])
    generator = torch.Generator().manual_seed(seed)
    for index, (name, path) in enumerate(paths.items()):
        fit = StageFit(name, None, None, 0, 0.0)
        if name in to_fit:
            stage = work.get_submodule(path)
            runs = [_run(work, paths, depth, name, x, batch_size) for depth in depths]
            target = _activations(reference, {name: reference_paths[name]}, x, batch_size, "output")[name]
            budget, stages_left = None, len(to_fit) - to_fit.index(name)
            if seconds is not None:  # an equal share of what is left
                budget = max(0.0, seconds - (time.perf_counter() - started)) / stages_left
            coordinates = SourceCoordinates(work, within=path)
            tail = _tail(work, path, reference, x, batch_size) if objective == "output" else None
            fit = _fit_stage(
                stage, coordinates, runs, target, iterations, budget, lr, batch_size, generator, tail
            )
        report.stages.append(fit)
        if progress:
            LOGGER.info(f"calibration of {name} ({index + 1}/{len(paths)}):{str(fit).partition(':')[2]}")
    if own_source and not any(fit.fitted for fit in report.stages):
        raise ConfigError(
            _nothing_to_fit(model, depths, "its residual against the source is 0 on the images")
        )
    report.seconds = time.perf_counter() - started
    calibrated.load_state_dict(work.state_dict())
    fitted = {fit.stage for fit in report.stages if fit.fitted}
    for stage in converted_stages(calibrated):
        if stage.stage_name in fitted:
            stage.fitted_steps = tuple(sorted({depth.steps[stage.stage_name] for depth in depths}))
    return calibrated.train(training), report


@dataclass(frozen=True)
class _Depth:
    """One depth calibration fits: its label as the user wrote it (None: the model's own depth, no
    ``steps`` given) and each stage's step count there."""

    label: str | None
    steps: dict[str, int]


def _depths(model: fx.GraphModule, steps: object) -> list[_Depth]:
    """The depths ``steps`` lists, each resolved to per-stage step counts by ``odeify.retarget`` itself
    (so a depth means here what it means there); the model's own depth where ``steps`` is None."""
    if steps is None:
        return [_Depth(None, {s.stage_name: s.steps for s in converted_stages(model)})]
    specs = [steps] if isinstance(steps, (str, int, Mapping)) else steps
    if not isinstance(specs, Sequence) or not specs:
        raise ConfigError(
            f"calibrate's steps must be a list of depths such as ['native', 'x0.5'] (each an int, 'native', "
            f"a multiplier 'x0.5' or a {{stage: steps}} dict), or None for the model's own; got {steps!r}."
        )
    depths: list[_Depth] = []
    for spec in specs:
        label = ", ".join(f"{k}={v}" for k, v in spec.items()) if isinstance(spec, Mapping) else str(spec)
        counts = {s.stage_name: s.steps for s in converted_stages(retarget(model, steps=spec))}
        same = [d.label for d in depths if d.steps == counts]
        if same:
            raise ConfigError(
                f"calibrate's steps lists one depth twice: {same[0]!r} and {label!r} both give "
                f"{counts} steps per stage; list each depth once (they weigh equally)."
            )
        depths.append(_Depth(label, counts))
    return depths


def _at_depth(work: fx.GraphModule, paths: dict[str, str], depth: _Depth) -> fx.GraphModule:
    """``work`` (calibration's copy, which calls its stages as modules) switched in place to ``depth``."""
    for name, path in paths.items():
        work.get_submodule(path).configure(steps=depth.steps[name])
    return work


@dataclass
class _Run:
    """A stage at one listed depth: the depth's label, its step count, the stage's unrolled graph at
    that count, and its inputs there (the calibrated model's own activations at that depth)."""

    depth: str | None
    steps: int
    graph: StepGraph
    inputs: torch.Tensor


def _run(
    work: fx.GraphModule, paths: dict[str, str], depth: _Depth, name: str, x: torch.Tensor, batch_size: int
) -> _Run:
    """Stage ``name`` of ``work`` switched to ``depth``, with its inputs there on ``x``."""
    stage = _at_depth(work, paths, depth).get_submodule(paths[name])
    inputs = _activations(work, {name: paths[name]}, x, batch_size, "input")[name]
    return _Run(depth.label, stage.steps, stage.unrolled_graph(), inputs)


def _check_arguments(
    model: object, images: object, seconds: object, iterations: object, lr: object, batch: object,
    seed: object,
) -> None:  # fmt: skip
    check_converted(model, "calibrate")
    for name, value in (("images", images), ("iterations", iterations), ("batch_size", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"calibrate's {name} must be a positive integer; got {value!r}.")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not math.isfinite(seconds) or seconds <= 0):  # fmt: skip
        raise ConfigError(f"calibrate's seconds must be a positive number or None; got {seconds!r}.")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"calibrate's lr must be a positive number; got {lr!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"calibrate's seed must be an integer in [0, 2^63); got {seed!r}.")


def check_objective(objective: object, name: str) -> None:
    """Refuse an objective calibration does not know (``name``: the argument, for the message)."""
    if objective not in CALIBRATION_OBJECTIVES:
        raise ConfigError(f"{name} must be one of {', '.join(CALIBRATION_OBJECTIVES)}; got {objective!r}.")


def _check_source_known(model: fx.GraphModule) -> None:
    """Refuse a model whose source network is not known."""
    why = unknown_source(model)
    if why is not None:
        raise ConfigError(
            f"calibration fits the stages to the model's source network, which is not known: {why}. Pass "
            "source= (the source converted at native depth)."
        )


def _nothing_to_fit(model: fx.GraphModule, depths: list[_Depth], how: str) -> str:
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


def _runs_its_source(stage: ODEStage, source: ODEStage) -> bool:
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


def _with_stage_calls(model: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``model`` whose graph calls each stage as a module (``checkpoint`` stages), so that a
    hook sees the stage's input and output; the same function as ``model``."""
    return retarget(model, backward={s.stage_name: "checkpoint" for s in converted_stages(model)})


def _stage_paths(model: nn.Module) -> dict[str, str]:
    """Each stage's module path, by stage name, in graph order."""
    paths = {id(m): path for path, m in model.named_modules() if isinstance(m, ODEStage)}
    return {s.stage_name: paths[id(s)] for s in converted_stages(model)}


class _Stop(Exception):
    """Raised by a hook once the activations wanted are taken: the rest of the forward is not needed."""


@torch.no_grad()
def _activations(
    model: nn.Module, paths: dict[str, str], x: torch.Tensor, batch_size: int, which: str
) -> dict[str, torch.Tensor]:
    """The ``input`` or ``output`` of each named stage of ``model`` on ``x``, batch by batch."""
    taken: dict[str, list[torch.Tensor]] = {name: [] for name in paths}
    last = list(paths)[-1]

    def hook_for(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor | None = None) -> None:
            taken[name].append((args[0] if which == "input" else output).detach())
            if name == last:
                raise _Stop

        return hook

    handles = []
    for name, path in paths.items():
        module = model.get_submodule(path)
        register = module.register_forward_pre_hook if which == "input" else module.register_forward_hook
        handles.append(register(hook_for(name)))
    try:
        for batch in x.split(batch_size):
            try:
                model(batch)
            except _Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(values) for name, values in taken.items()}


Tail = tuple[fx.GraphModule, torch.Tensor]
"""The network after the stage (``h -> output``) and the source's outputs on the calibration images."""


def _fit_stage(
    stage: ODEStage,
    coordinates: SourceCoordinates,
    runs: list[_Run],
    target: torch.Tensor,
    iterations: int,
    budget: float | None,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    tail: Tail | None = None,
) -> StageFit:
    """Fit ``stage``'s knots (in source coordinates) so that the stage on each run's inputs, at the
    run's depth, matches ``target`` (and, with a ``tail``, the network's output matches the source's):
    the sum of the runs' objectives, on the same images at every depth."""
    started = time.perf_counter()
    replaced = coordinates.replaced()
    own = [p for p in stage.knot_tensors() if p.requires_grad and id(p) not in replaced]
    trained = own + [p for _, p in coordinates.named_sources()]
    before = [_residuals(stage, run, target, batch_size, tail) for run in runs]
    exact = torch.finfo(target.dtype).eps
    if all(_objective(residuals) <= exact * exact for residuals in before):
        return StageFit(stage.stage_name, None, None, 0, time.perf_counter() - started, why=LEFT_AS_EXACT)
    if not trained:
        return _stage_fit(stage, runs, before, before, 0, started)
    kept = [p.detach().clone() for p in trained]
    optimizer = torch.optim.Adam(trained, lr=lr)
    n = target.shape[0]
    done = 0
    for step in range(iterations):
        if budget is not None and time.perf_counter() - started > budget:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / iterations))
        pick = torch.randperm(n, generator=generator)[: min(batch_size, n)]
        optimizer.zero_grad(set_to_none=True)
        stage.zero_grad(set_to_none=True)
        loss = None
        for run in runs:  # equal weights on the depths' relative errors (calibrate's docstring says why)
            h = stage.run_graph(run.graph, (run.inputs[pick],))
            term = _relative_error(h, target[pick])
            if tail is not None:
                term = term + _relative_error(tail[0](h), tail[1][pick])
            loss = term if loss is None else loss + term
        loss.backward()
        coordinates.pull()
        optimizer.step()
        coordinates.push()
        done += 1
    after = [_residuals(stage, run, target, batch_size, tail) for run in runs]
    if not _total(after) < _total(before):  # never worse than where it started (diverged, too short)
        with torch.no_grad():
            for p, start in zip(trained, kept, strict=True):
                p.copy_(start)
            coordinates.push()
        after = [_residuals(stage, run, target, batch_size, tail) for run in runs]
    return _stage_fit(stage, runs, before, after, done, started)


Residuals = tuple[float, float | None]
"""The stage output's relative residual, and the network output's where a tail is fitted too."""


def _stage_fit(
    stage: ODEStage,
    runs: list[_Run],
    before: list[Residuals],
    after: list[Residuals],
    done: int,
    started: float,
) -> StageFit:
    """The fit's record: the first run's residuals, and each depth's where depths were listed."""
    depths = [
        DepthFit(run.depth, run.steps, b[0], a[0], None if b[1] is None or a[1] is None else (b[1], a[1]))
        for run, b, a in zip(runs, before, after, strict=True)
        if run.depth is not None
    ]
    output = None if before[0][1] is None or after[0][1] is None else (before[0][1], after[0][1])
    seconds = time.perf_counter() - started
    return StageFit(stage.stage_name, before[0][0], after[0][0], done, seconds, output, depths)


def _objective(residuals: Residuals) -> float:
    """What the fit minimizes at one depth, over all the calibration images: the sum of the squared
    residuals."""
    return sum(r * r for r in residuals if r is not None)


def _total(per_depth: list[Residuals]) -> float:
    """What the fit minimizes over the listed depths: the sum of their objectives."""
    return sum(_objective(residuals) for residuals in per_depth)


def _relative_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``||output - target||^2 / ||target||^2`` over the batch."""
    return (output - target).pow(2).sum() / target.pow(2).sum().clamp_min(HEAD_ROOM)


@torch.no_grad()
def _residuals(
    stage: ODEStage, run: _Run, target: torch.Tensor, batch_size: int, tail: Tail | None
) -> Residuals:
    """``||stage(inputs) - target|| / ||target||`` at the run's depth over all the calibration images,
    and the same of the network's output against the source's where a ``tail`` is given."""
    inputs = run.inputs
    outputs = tail[1].split(batch_size) if tail is not None else [None] * len(inputs.split(batch_size))
    stage_sums, output_sums = _Sums(), _Sums()
    for x, y, wanted in zip(inputs.split(batch_size), target.split(batch_size), outputs, strict=True):
        h = stage.run_graph(run.graph, (x,))
        stage_sums.add(h, y)
        if tail is not None:
            output_sums.add(tail[0](h), wanted)
    return stage_sums.residual(), (output_sums.residual() if tail is not None else None)


class _Sums:
    """A relative residual ``||got - wanted|| / ||wanted||`` summed batch by batch, in float64."""

    def __init__(self) -> None:
        self.error = self.energy = 0.0

    def add(self, got: torch.Tensor, wanted: torch.Tensor) -> None:
        self.error += float((got - wanted).double().pow(2).sum())
        self.energy += float(wanted.double().pow(2).sum())

    def residual(self) -> float:
        return math.sqrt(self.error / self.energy) if self.energy > HEAD_ROOM else 0.0


@torch.no_grad()
def _tail(
    work: fx.GraphModule, path: str, reference: nn.Module, x: torch.Tensor, batch_size: int
) -> Tail | None:
    """The network after the stage at ``path`` with its tensors held fixed (only the stage is fitted),
    and the source's outputs on ``x``: what ``objective="output"`` fits. None where the output depends
    on more than the stage's output (:func:`odeify.train.network_tail.network_tail`)."""
    after = network_tail(work, path)
    if after is None:
        return None
    return after.requires_grad_(False), torch.cat([reference(batch) for batch in x.split(batch_size)])
