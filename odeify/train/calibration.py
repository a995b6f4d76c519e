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
  shared by the stages; deterministic for a seed (on one thread). Memory: the images, and
  activations within a byte budget (``memory``; the rest in a temporary file:
  :mod:`odeify.train.calibration_store`), passes and fit micro-batches sized to it. Time: one pass
  of the source gives every stage's target and the network's output, and each stage's inputs come
  from the last pass of the stage fitted before it (through the graph between them), so no prefix
  of either network is run again per stage.

The :class:`CalibrationReport` gives each stage's residual, ``||stage(x) - target|| / ||target||`` over
the calibration images, before and after the fit.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from odeify.codegen.emit import StepGraph
from odeify.compiler.conversion import check_converted, converted_stages, retarget, steps_at
from odeify.compiler.source_network import source_network, unknown_source
from odeify.core.errors import ConfigError
from odeify.ir.settings import StepsSpec
from odeify.ir.source_tensors import SOURCE_PREFIX, record_stage_source
from odeify.runtime.stage import ODEStage
from odeify.train.calibration_data import CalibrationData, calibration_images
from odeify.train.calibration_store import MIB, Budget, Rows
from odeify.train.manifestations import runs_as_converted
from odeify.train.network_tail import graph_from, network_tail
from odeify.train.parametrization import SourceCoordinates
from odeify.train.peak_memory import EpochPeakMemory
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
DEFAULT_MEMORY = 128 * MIB
"""Activations held in memory at once by default, and the most one pass or fit micro-batch is sized
to take: resnet50 at 224x224 (3.2 MB per image of layer1) calibrates 256 images in small passes and
fit micro-batches, its peak under half of holding everything at once
(benchmarks/results/calibration_memory.md: 0.47x of before at 128 MiB, 0.506x at 192)."""
BACKWARD_FACTOR = 3
"""A fit micro-batch's peak, in units of what autograd saves for it: the saved tensors, the
gradients of the activations in backward and the forward's temporaries. Measured on resnet50's
layer1 at 224x224, half its steps: 2.5-3x (benchmarks/results/calibration_memory.md)."""
WORKING_SET = 4
"""Activations of one image alive at once in a forward pass without gradients, in units of the
largest one (an input, its output, a shortcut, the allocator's slack): sizes the passes' chunks."""
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
    memory: tuple[float, float, float | None] | None = None
    """The activations' memory budget and what was spilled to a temporary file (MiB), and the
    process's peak memory during the calibration (MiB: resident on the CPU, allocated on a GPU; None
    where unknown)."""

    @property
    def fit_seconds(self) -> float:
        """The time in the stages' fits (their residuals before and after included)."""
        return sum(fit.seconds for fit in self.stages)

    def __str__(self) -> str:
        at = f" at depths {', '.join(self.depths)}" if self.depths else ""
        head = (
            f"calibrated on {self.images} images{at} in {self.seconds:.1f} s (fits {self.fit_seconds:.1f} s)"
        )
        if self.memory is not None:
            budget, spilled, peak = self.memory
            on_disk = f", {spilled:.1f} MiB more in a temporary file" if spilled else ""
            head += f", activations within {budget:g} MiB of memory{on_disk}"
            head += f", peak memory {peak:.0f} MiB" if peak is not None else ""
        return "\n".join([head + ":", *(f"  {fit}" for fit in self.stages)])


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
    memory: int = DEFAULT_MEMORY,
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
    loss); ``"stage"`` fits each stage's output only. ``memory``: the bytes of activations held in
    memory at once (the rest goes to a temporary file, read back bit for bit), and the most that one
    forward pass or one fit micro-batch is sized to take; the report and the log say what was used.
    ``progress`` logs a line per stage (logger ``odeify``). Returns the calibrated model, in
    ``model``'s train/eval mode, and the :class:`CalibrationReport`.
    """
    _check_arguments(model, images, seconds, iterations, lr, batch_size, seed, memory)
    check_objective(objective, "calibrate's objective")
    depths = _depths(model, steps)
    own_source = source is None
    if own_source:
        _check_source_known(model)
        source = source_network(model)
    elif not converted_stages(source):
        raise ConfigError("calibrate's source must be a converted model (odeify.convert) at native depth.")
    started = time.perf_counter()
    peak = EpochPeakMemory(next(model.parameters()).device)
    peak.start()
    work = _with_stage_calls(model)  # the copy that is fitted; the model's copy gets its tensors at the end
    for stage in converted_stages(work):
        record_stage_source(stage)  # its knots are its source only while they are the blocks'
    reference = _with_stage_calls(source).eval()
    del source  # the reference is the one copy of it kept (resnet50: each copy 100 MB and more)
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
    budget = Budget(memory)
    chunk = _chunk(reference, x, memory, batch_size)
    tails = {
        name: network_tail(work, paths[name]) for name in to_fit if objective == "output"
    }  # fmt: skip
    wanted = {name: reference_paths[name] for name in to_fit}
    targets, outputs = _activations(reference, wanted, x, chunk, "output", budget, any(tails.values()))
    if progress:
        LOGGER.info(_memory_line(budget, chunk, x.shape[0]))
    names = list(paths)
    carried: list[Rows] | None = None  # the stage's inputs at each depth, from the fit of the stage before
    for index, (name, path) in enumerate(paths.items()):
        fit = StageFit(name, None, None, 0, 0.0)
        if name in to_fit:
            stage = work.get_submodule(path)
            if carried is None:
                runs = [_run(work, paths, depth, name, x, chunk, budget) for depth in depths]
            else:
                runs = [
                    _carried(work, paths, depth, name, rows, x)
                    for depth, rows in zip(depths, carried, strict=True)
                ]
            following = names[index + 1] if index + 1 < len(names) else None
            onward = None if following not in to_fit else _segment_between(work, path, paths[following])
            share, stages_left = None, len(to_fit) - to_fit.index(name)
            if seconds is not None:  # an equal share of what is left
                share = max(0.0, seconds - (time.perf_counter() - started)) / stages_left
            coordinates = SourceCoordinates(work, within=path)
            tail = None if tails.get(name) is None else (tails[name].requires_grad_(False), outputs)
            setting = _Setting(iterations, share, lr, batch_size, chunk, memory, generator)
            target = targets.pop(name)
            fit, carried = _fit_stage(
                stage, coordinates, runs, target, setting, tail, _Onward(onward, budget)
            )
            for rows in (target, *(run.inputs for run in runs)):
                rows.close()
        else:
            carried = None
        report.stages.append(fit)
        if progress:
            LOGGER.info(f"calibration of {name} ({index + 1}/{len(paths)}):{str(fit).partition(':')[2]}")
    if own_source and not any(fit.fitted for fit in report.stages):
        raise ConfigError(
            _nothing_to_fit(model, depths, "its residual against the source is 0 on the images")
        )
    del reference, targets, outputs
    calibrated = copy.deepcopy(model)
    for stage in converted_stages(calibrated):
        record_stage_source(stage)
    calibrated.load_state_dict(work.state_dict())
    report.memory = (budget.nbytes / MIB, budget.spilled / MIB, peak.mib())
    report.seconds = time.perf_counter() - started
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
    """The depths ``steps`` lists, each resolved to per-stage step counts as ``odeify.retarget`` resolves
    it (:func:`~odeify.compiler.conversion.steps_at`, no copy of the model); the model's own depth where
    ``steps`` is None."""
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
        counts = steps_at(model, spec)
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
    that count, its inputs there (the calibrated model's own activations at that depth) and its
    constant inputs (:attr:`StageIR.inputs`, the same for every image)."""

    depth: str | None
    steps: int
    graph: StepGraph
    inputs: Rows
    constants: tuple[torch.Tensor, ...] = ()


def _run(
    work: fx.GraphModule,
    paths: dict[str, str],
    depth: _Depth,
    name: str,
    x: torch.Tensor,
    chunk: int,
    budget: Budget,
) -> _Run:
    """Stage ``name`` of ``work`` switched to ``depth``, with its inputs there on ``x``."""
    stage = _at_depth(work, paths, depth).get_submodule(paths[name])
    inputs = _activations(work, {name: paths[name]}, x, chunk, "input", budget)[0][name]
    return _Run(depth.label, stage.steps, stage.unrolled_graph(), inputs, _constants(work, paths[name], x))


def _carried(
    work: fx.GraphModule, paths: dict[str, str], depth: _Depth, name: str, inputs: Rows, x: torch.Tensor
) -> _Run:
    """Stage ``name`` of ``work`` switched to ``depth``, with the inputs there that the fit of the
    stage before computed (the same values a pass of the model gives, without running its prefix)."""
    stage = _at_depth(work, paths, depth).get_submodule(paths[name])
    return _Run(depth.label, stage.steps, stage.unrolled_graph(), inputs, _constants(work, paths[name], x))


def _constants(work: fx.GraphModule, path: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The constant inputs the stage at ``path`` is called with (a rotary ViT's position table), taken
    from a pass of one image: they depend on the images' size, not on the images."""
    if not work.get_submodule(path).inputs:
        return ()
    taken: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple) -> None:
        taken.extend(value.detach() for value in args[1:])
        raise _Stop

    handle = work.get_submodule(path).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            work(x[:1])
    except _Stop:
        pass
    finally:
        handle.remove()
    return tuple(taken)


@torch.no_grad()
def _chunk(model: nn.Module, x: torch.Tensor, memory: int, batch_size: int) -> int:
    """Images per pass without gradients: ``batch_size``, or fewer where :data:`WORKING_SET` times
    the largest activation of one image (a module's output, measured on one image) exceeds
    ``memory``."""
    largest = 0

    def hook(module: nn.Module, args: tuple, output: object) -> None:
        nonlocal largest
        if isinstance(output, torch.Tensor):
            largest = max(largest, output.numel() * output.element_size())

    handles = [m.register_forward_hook(hook) for m in model.modules() if m is not model]
    try:
        model(x[:1])
    finally:
        for handle in handles:
            handle.remove()
    return max(1, min(batch_size, memory // max(1, WORKING_SET * largest)))


def _memory_line(budget: Budget, chunk: int, images: int) -> str:
    spilled = f"; {budget.spilled / MIB:.1f} MiB of targets in a temporary file" if budget.spilled else ""
    return (
        f"calibration holds at most {budget.nbytes / MIB:g} MiB of activations in memory (memory=), the "
        f"rest in a temporary file{spilled}; passes of {chunk} of the {images} images"
    )


def _check_arguments(
    model: object, images: object, seconds: object, iterations: object, lr: object, batch: object,
    seed: object, memory: object,
) -> None:  # fmt: skip
    check_converted(model, "calibrate")
    named = (("images", images), ("iterations", iterations), ("batch_size", batch), ("memory", memory))
    for name, value in named:
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
    model: nn.Module,
    paths: dict[str, str],
    x: torch.Tensor,
    chunk: int,
    which: str,
    budget: Budget,
    output: bool = False,
) -> tuple[dict[str, Rows], torch.Tensor | None]:
    """The ``input`` or ``output`` of each named stage of ``model`` on ``x``, ``chunk`` images at a
    time, as :class:`Rows` within ``budget``; with ``output``, the model's outputs too (the pass then
    runs to the end: one pass of the source gives every stage's target and the network's output)."""
    taken: dict[str, Rows] = {}
    if not paths:
        return taken, None
    last = list(paths)[-1]

    def hook_for(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, out: torch.Tensor | None = None) -> None:
            value = (args[0] if which == "input" else out).detach()
            if name not in taken:
                taken[name] = budget.rows(x.shape[0], value)
            taken[name].append(value)
            if name == last and not output:
                raise _Stop

        return hook

    handles = []
    for name, path in paths.items():
        module = model.get_submodule(path)
        register = module.register_forward_pre_hook if which == "input" else module.register_forward_hook
        handles.append(register(hook_for(name)))
    outputs = []
    try:
        for batch in x.split(chunk):
            try:
                outputs.append(model(batch))
            except _Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return taken, (torch.cat(outputs) if output else None)


Tail = tuple[fx.GraphModule, torch.Tensor]
"""The network after the stage (``h -> output``) and the source's outputs on the calibration images."""


@dataclass
class _Setting:
    """How a stage is fitted: Adam steps and their time share (None: no limit), learning rate,
    images per step, per pass without gradients, the memory a micro-batch is sized to, the RNG."""

    iterations: int
    seconds: float | None
    lr: float
    batch_size: int
    chunk: int
    memory: int
    generator: torch.Generator


def _fit_stage(
    stage: ODEStage,
    coordinates: SourceCoordinates,
    runs: list[_Run],
    target: Rows,
    setting: _Setting,
    tail: Tail | None,
    onward: _Onward,
) -> tuple[StageFit, list[Rows] | None]:
    """Fit ``stage``'s knots (in source coordinates) so that the stage on each run's inputs, at the
    run's depth, matches ``target`` (and, with a ``tail``, the network's output matches the source's):
    the sum of the runs' objectives, on the same images at every depth. Each step's batch goes
    through forward and backward in micro-batches sized to ``setting.memory`` (the gradient is the
    batch's: each micro-batch's error is divided by the whole batch's target energy). Also returns
    the next stage's inputs at each run's depth, where ``onward`` can take them from the last pass
    of the fitted stage (else None)."""
    started = time.perf_counter()
    replaced = coordinates.replaced()
    own = [p for p in stage.knot_tensors() if p.requires_grad and id(p) not in replaced]
    trained = own + [p for _, p in coordinates.named_sources()]
    before = [_residuals(stage, run, target, setting.chunk, tail) for run in runs]
    exact = torch.finfo(target.dtype).eps
    if all(_objective(residuals) <= exact * exact for residuals in before):
        return StageFit(
            stage.stage_name, None, None, 0, time.perf_counter() - started, why=LEFT_AS_EXACT
        ), None
    if not trained:
        return _stage_fit(stage, runs, before, before, 0, started), None
    kept = [p.detach().clone() for p in trained]
    optimizer = torch.optim.Adam(trained, lr=setting.lr)
    n, lr, iterations = target.n, setting.lr, setting.iterations
    micro = _micro_batch(stage, runs, setting)
    done = 0
    for step in range(iterations):
        if setting.seconds is not None and time.perf_counter() - started > setting.seconds:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / iterations))
        pick = torch.randperm(n, generator=setting.generator)[: min(setting.batch_size, n)]
        optimizer.zero_grad(set_to_none=True)
        stage.zero_grad(set_to_none=True)
        parts = pick.split(micro)
        wanted = [target.take(part) for part in parts] if len(parts) == 1 else None
        energy = _energy(wanted or (target.take(part) for part in parts))
        output_energy = _energy([tail[1][pick]]) if tail is not None else None
        for i, part in enumerate(parts):
            goal = wanted[i] if wanted is not None else target.take(part)
            loss = None
            for run in runs:  # equal weights on the depths' relative errors (calibrate's docstring says why)
                h = stage.run_graph(run.graph, (run.inputs.take(part),), inputs=run.constants)
                term = (h - goal).pow(2).sum() / energy
                if tail is not None:
                    term = term + (tail[0](h) - tail[1][part]).pow(2).sum() / output_energy
                loss = term if loss is None else loss + term
            loss.backward()
        coordinates.pull()
        optimizer.step()
        coordinates.push()
        done += 1
    nexts = [onward.rows(target.n) for _ in runs]
    after = [
        _residuals(stage, run, target, setting.chunk, tail, then)
        for run, then in zip(runs, nexts, strict=True)
    ]
    if not _total(after) < _total(before):  # never worse than where it started (diverged, too short)
        with torch.no_grad():
            for p, start in zip(trained, kept, strict=True):
                p.copy_(start)
            coordinates.push()
        for rows in nexts:
            rows.close()
        nexts = [onward.rows(target.n) for _ in runs]
        after = [
            _residuals(stage, run, target, setting.chunk, tail, then)
            for run, then in zip(runs, nexts, strict=True)
        ]
    carried = [rows.rows for rows in nexts] if onward.segment is not None else None
    return _stage_fit(stage, runs, before, after, done, started), carried


def _energy(targets: Iterable[torch.Tensor]) -> torch.Tensor:
    """``||target||^2`` over a batch given in parts, kept from 0 (:data:`HEAD_ROOM`)."""
    return sum(t.pow(2).sum() for t in targets).clamp_min(HEAD_ROOM)


def _micro_batch(stage: ODEStage, runs: list[_Run], setting: _Setting) -> int:
    """Images per forward and backward in the fit: the batch, or fewer where what autograd saves for
    the runs' forwards, measured per image (on two images less on one), exceeds ``setting.memory``."""
    if runs[0].inputs.n < 2:
        return setting.batch_size
    per_image = sum(_saved_bytes(stage, run, 2) - _saved_bytes(stage, run, 1) for run in runs)
    return max(1, min(setting.batch_size, setting.memory // max(1, BACKWARD_FACTOR * per_image)))


def _saved_bytes(stage: ODEStage, run: _Run, images: int) -> int:
    """The bytes autograd saves for the backward of the stage's forward at the run's depth on
    ``images`` of its inputs."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        stage.run_graph(run.graph, (run.inputs.take(torch.arange(images)),), inputs=run.constants)
    return total


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


def _segment_between(model: fx.GraphModule, path: str, following: str) -> fx.GraphModule | None:
    """A graph module ``h -> the input of the stage at module path following``, where ``h`` is the
    output of the stage at ``path`` (a ResNet's downsampling block between them); None where that
    input depends on more than ``h`` (a value from before the stage crosses it). ``model`` calls its
    stages as modules, once each (calibration's copy)."""
    nodes = list(model.graph.nodes)
    calls = {
        n.target: i for i, n in enumerate(nodes) if n.op == "call_module" and n.target in (path, following)
    }
    counts = [n.target for n in nodes if n.op == "call_module"]
    if counts.count(path) != 1 or counts.count(following) != 1 or calls[following] < calls[path]:
        return None
    call = nodes[calls[following]]
    if len(call.args) != 1 or call.kwargs or not isinstance(call.args[0], fx.Node):
        return None
    copy = graph_from(nodes[calls[path]], nodes[calls[path] + 1 : calls[following]])
    if copy is None or call.args[0] not in copy[1]:
        return None
    graph, copied = copy
    graph.output(copied[call.args[0]])
    return fx.GraphModule(model, graph)


class _Onward:
    """What the next stage's inputs are taken with: the graph from the stage's output to them
    (:func:`segment_between`; None: not taken), and the budget they are held in."""

    def __init__(self, segment: fx.GraphModule | None, budget: Budget) -> None:
        self.segment, self.budget = segment, budget

    def rows(self, n: int) -> _Next:
        return _Next(self, n)


class _Next:
    """The next stage's inputs at one depth, taken batch by batch from the stage's outputs."""

    def __init__(self, onward: _Onward, n: int) -> None:
        self.onward, self.n, self.rows = onward, n, None

    def add(self, h: torch.Tensor) -> None:
        if self.onward.segment is None:
            return
        value = self.onward.segment(h)
        if self.rows is None:
            self.rows = self.onward.budget.rows(self.n, value)
        self.rows.append(value)

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()


@torch.no_grad()
def _residuals(
    stage: ODEStage, run: _Run, target: Rows, chunk: int, tail: Tail | None, then: _Next | None = None
) -> Residuals:
    """``||stage(inputs) - target|| / ||target||`` at the run's depth over all the calibration images,
    and the same of the network's output against the source's where a ``tail`` is given; ``then``
    takes the next stage's inputs from the stage's outputs on the way."""
    outputs = tail[1].split(chunk) if tail is not None else [None] * math.ceil(target.n / chunk)
    stage_sums, output_sums = _Sums(), _Sums()
    for x, y, wanted in zip(run.inputs.batches(chunk), target.batches(chunk), outputs, strict=True):
        h = stage.run_graph(run.graph, (x,), inputs=run.constants)
        stage_sums.add(h, y)
        if then is not None:
            then.add(h)
        if tail is not None:
            output_sums.add(tail[0](h), wanted)
    return stage_sums.residual(), (output_sums.residual() if tail is not None else None)


class _Sums:
    """A relative residual ``||got - wanted|| / ||wanted||`` summed batch by batch, in float64, one
    image at a time (a float64 copy of a whole batch of resnet50's layer1 at 224x224 would take twice
    the batch's memory again)."""

    def __init__(self) -> None:
        self.error = self.energy = 0.0

    def add(self, got: torch.Tensor, wanted: torch.Tensor) -> None:
        for mine, theirs in zip(got, wanted, strict=True):
            self.error += float((mine - theirs).double().pow(2).sum())
            self.energy += float(theirs.double().pow(2).sum())

    def residual(self) -> float:
        return math.sqrt(self.error / self.energy) if self.energy > HEAD_ROOM else 0.0
