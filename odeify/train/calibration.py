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
- several depths at once (``steps=["native", "x0.5"]``): the knots kept, so native computes the
  source bit for bit, and a correction per other depth fitted as that depth alone is
  (:mod:`odeify.train.depth_corrections`); a model that computes its source exactly at every depth
  asked (native steps and knots, or knots that read as one-block stages) is refused, one rule
  whatever makes it exact;
- bounded: ``images`` samples, ``iterations`` optimizer steps per stage, and a ``seconds`` budget
  shared by the stages; deterministic for a seed (on one thread). Memory: the images, and
  activations within a byte budget (``memory``; the rest in a temporary file:
  :mod:`odeify.train.calibration_store`), passes and fit micro-batches sized to it. Time: one pass
  of the source gives every stage's target and the network's output, and each stage's inputs come
  from the last pass of the stage fitted before it (through the graph between them), so no prefix
  of either network is run again per stage.

The :class:`CalibrationReport` gives each stage's residual, ``||stage(x) - target|| / ||target||`` over
the calibration images, before and after the fit.

This module is the fit; beside it: the depths and what is left as it is (``calibration_depths``),
the passes without gradients (``calibration_passes``), the checks (``calibration_checks``), the
report (``calibration_report``), the progress (``calibration_progress``), the images
(``calibration_data``) and the activations' store (``calibration_store``).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from odeify.codegen.emit import StepGraph
from odeify.compiler.conversion import converted_stages
from odeify.compiler.source_network import source_network
from odeify.core.errors import ConfigError
from odeify.core.words import plural
from odeify.ir.source_tensors import record_stage_source
from odeify.runtime.stage import ODEStage
from odeify.train.calibration_checks import check_arguments, check_objective, check_source_known
from odeify.train.calibration_data import CalibrationData, calibration_images
from odeify.train.calibration_depths import (
    Depth,
    DepthSpec,
    at_depth,
    nothing_to_fit,
    resolve_depths,
    runs_its_source,
)
from odeify.train.calibration_passes import (
    Next,
    Onward,
    activations,
    chunk_size,
    constants,
    memory_line,
    segment_between,
    stage_paths,
    with_stage_calls,
)
from odeify.train.calibration_progress import FitProgress
from odeify.train.calibration_report import LEFT_AS_EXACT, CalibrationReport, DepthFit, StageFit
from odeify.train.calibration_store import MIB, Budget, Rows
from odeify.train.depth_corrections import calibrate_each_depth
from odeify.train.network_tail import network_tail
from odeify.train.parametrization import SourceCoordinates
from odeify.train.peak_memory import EpochPeakMemory
from odeify.train.progress import LOGGER
from odeify.train.recipe import (
    CALIBRATION_IMAGES,
    CALIBRATION_MEMORY_MIB,
    CALIBRATION_OBJECTIVE,
    CALIBRATION_STEPS,
)

__all__ = [
    "CalibrationReport",
    "DepthFit",
    "StageFit",
    "calibrate",
    "check_objective",
]

DEFAULT_LR = 1e-3
DEFAULT_BATCH = 64
DEFAULT_MEMORY = CALIBRATION_MEMORY_MIB * MIB
"""Activations held in memory at once by default, and the most one pass or fit micro-batch is sized
to take: resnet50 at 224x224 (3.2 MB per image of layer1) calibrates 256 images in small passes and
fit micro-batches, its peak under half of holding everything at once
(benchmarks/results/calibration_memory.md: 0.47x of before at 128 MiB, 0.506x at 192)."""
BACKWARD_FACTOR = 3
"""A fit micro-batch's peak, in units of what autograd saves for it: the saved tensors, the
gradients of the activations in backward and the forward's temporaries. Measured on resnet50's
layer1 at 224x224, half its steps: 2.5-3x (benchmarks/results/calibration_memory.md)."""
HEAD_ROOM = 1e-12  # a target this small in energy has nothing to match: the residual is reported as 0


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
    seeded choice of ``images`` of them is read. ``steps``: the depths to fit, each as
    ``odeify.retarget(steps=...)`` takes it (``["native", "x0.5", "x0.25"]``; one spec alone is a list
    of one); None (the default) fits the depth the model runs at, and one depth fits the knots
    themselves. Two or more depths leave the knots as they are, so native depth still computes what
    it did, and give each stage, at each other listed depth, a correction of its own
    (:mod:`odeify.train.depth_corrections`), fitted as a calibration for that depth alone fits: no
    depth is paid for by another. The model keeps the depth it runs at; a stage is fitted unless it
    computes its source stage exactly, and each stage fitted records the step counts it was fitted
    for (``stage.fitted_steps``).
    ``source``: the network whose activations each stage is fitted to, a converted model at native
    depth with the same stage names (default: the source network ``model`` keeps; a model that
    computes that network exactly at every depth asked is refused). ``seconds`` caps the whole fit
    (each depth and each stage gets an equal share of what is left); ``iterations`` caps each stage.
    ``objective``:
    ``"output"`` (the default) fits each stage's output and, on the network's last stage, the
    network's output too (where nothing but the stage's output reaches the head; elsewhere the stage
    loss); ``"stage"`` fits each stage's output only. ``memory``: the bytes of activations held in
    memory at once (the rest goes to a temporary file, read back bit for bit), and the most that one
    forward pass or one fit micro-batch is sized to take; the report and the log say what was used.
    ``progress`` logs a line per stage (logger ``odeify``). Returns the calibrated model, in
    ``model``'s train/eval mode, and the :class:`CalibrationReport`.
    """
    check_arguments(model, images, seconds, iterations, lr, batch_size, seed, memory)
    check_objective(objective, "calibrate's objective")
    depths = resolve_depths(model, steps)
    share = None if seconds is None or len(depths) == 1 else seconds / (len(depths) - 1)
    options = _Options(data, images, share if len(depths) > 1 else seconds, iterations, lr, batch_size,
                       seed, source, objective, memory, progress)  # fmt: skip
    if len(depths) == 1:
        fitted = _calibrate(model, depths, frozenset(), options, alone=True)
        assert fitted is not None  # alone, a calibration with nothing to fit is refused
        return fitted
    return calibrate_each_depth(
        model, depths, lambda at, depth, kept: _calibrate(at, [depth], kept, options, alone=False)
    )


@dataclass(frozen=True)
class _Options:
    """What :func:`calibrate` was asked, besides the model and its depths."""

    data: CalibrationData
    images: int
    seconds: float | None
    iterations: int
    lr: float
    batch_size: int
    seed: int
    source: nn.Module | None
    objective: str
    memory: int
    progress: bool


def _calibrate(
    model: fx.GraphModule, depths: list[Depth], kept: frozenset[str], options: _Options, alone: bool
) -> tuple[fx.GraphModule, CalibrationReport] | None:
    """Calibrate ``model``'s knots for ``depths``, the stages in ``kept`` left as they are.
    ``alone``: a calibration with nothing to fit is refused, naming why; else it returns None."""
    job = _Job.of(model, options.source, depths, kept, alone)
    if job is None:
        return None
    x = calibration_images(options.data, model, options.images, options.seed)
    report = CalibrationReport(
        images=x.shape[0], seconds=0.0, depths=[d.label for d in job.depths if d.label]
    )
    budget = Budget(options.memory)
    chunk = chunk_size(job.reference, x, options.memory, options.batch_size)
    tails = {
        name: network_tail(job.work, job.paths[name]) for name in job.to_fit if options.objective == "output"
    }  # fmt: skip
    wanted = {name: job.reference_paths[name] for name in job.to_fit}
    targets, outputs = activations(job.reference, wanted, x, chunk, "output", budget, any(tails.values()))
    if options.progress:
        LOGGER.info(memory_line(budget, chunk, x.shape[0]))
    setting = _Setting(
        options.iterations, options.seconds, options.lr, options.batch_size, chunk, options.memory,
        torch.Generator().manual_seed(options.seed),
    )  # fmt: skip
    job.fit_stages(x, report, setting, targets, (tails, outputs), budget, options.progress)
    del targets, outputs
    return job.finish(report, budget)


@dataclass
class _Job:
    """One calibration: the model, the copy that is fitted (``work``, its stages called as modules),
    the source's copy it is fitted to, each one's stage paths, the depths, and the stages to fit."""

    model: fx.GraphModule
    work: fx.GraphModule
    reference: fx.GraphModule
    paths: dict[str, str]
    reference_paths: dict[str, str]
    depths: list[Depth]
    to_fit: list[str]
    refuse_exact: bool  # refuse a model whose fit changes nothing: calibrating its own source, alone
    started: float
    peak: EpochPeakMemory

    @classmethod
    def of(
        cls, model: fx.GraphModule, source: nn.Module | None, depths: list[Depth], kept: frozenset[str],
        alone: bool,
    ) -> _Job | None:  # fmt: skip
        """The job, its stages in ``kept`` and those that compute their source exactly at every depth
        left out; refuses a source without ``model``'s stages, and (``alone``) a model with nothing to
        fit against its own source (else None)."""
        own_source = source is None
        if own_source:
            check_source_known(model)
            source = source_network(model)
        elif not converted_stages(source):
            raise ConfigError(
                "calibrate's source must be a converted model (odeify.convert) at native depth."
            )
        started = time.perf_counter()
        peak = EpochPeakMemory(next(model.parameters()).device)
        peak.start()
        work = with_stage_calls(model)  # the copy that is fitted; the model's gets its tensors at the end
        for stage in converted_stages(work):
            record_stage_source(stage)  # its knots are its source only while they are the blocks'
        reference = with_stage_calls(source).eval()
        del source  # the reference is the one copy of it kept (resnet50: each copy 100 MB and more)
        paths, reference_paths = stage_paths(work), stage_paths(reference)
        missing = [name for name in paths if name not in reference_paths]
        if missing:
            raise ConfigError(
                f"calibrate's source has no stage {missing[0]!r}: it must be converted from the same "
                f"network (its stages: {', '.join(reference_paths)})."
            )
        work.eval()
        to_fit = [
            name for name, path in paths.items()
            if name not in kept and not all(
                runs_its_source(at_depth(work, paths, depth).get_submodule(path),
                                reference.get_submodule(reference_paths[name]))
                for depth in depths
            )
        ]  # fmt: skip
        if not to_fit and not alone:
            return None
        if own_source and not to_fit:
            raise ConfigError(
                nothing_to_fit(model, depths, "Euler, one step and one constant knot per block")
            )
        refuse = own_source and alone
        return cls(model, work, reference, paths, reference_paths, depths, to_fit, refuse, started, peak)

    def fit_stages(
        self, x: torch.Tensor, report: CalibrationReport, setting: _Setting, targets: dict[str, Rows],
        tails: tuple[dict[str, fx.GraphModule | None], torch.Tensor | None], budget: Budget, progress: bool,
    ) -> None:  # fmt: skip
        """Fit each stage in graph order, appending its fit to ``report``; each stage's inputs are
        carried from the last pass of the stage fitted before it where the graph between allows."""
        names = list(self.paths)
        carried: list[Rows] | None = None  # the stage's inputs at each depth, from the stage before's fit
        for index, name in enumerate(names):
            fit, carried = StageFit(name, None, None, 0, 0.0), None if name not in self.to_fit else carried
            if name in self.to_fit:
                title = f"calibration of {name} ({index + 1}/{len(names)})"
                following = names[index + 1] if index + 1 < len(names) else None
                fit, carried = self._fit(name, following, x, carried, setting, targets.pop(name), tails,
                                         budget, title if progress else None)  # fmt: skip
            report.stages.append(fit)
            if progress:
                LOGGER.info(f"calibration of {name} ({index + 1}/{len(names)}):{str(fit).partition(':')[2]}")
        if self.refuse_exact and not any(fit.fitted for fit in report.stages):
            raise ConfigError(
                nothing_to_fit(self.model, self.depths, "its residual against the source is 0 on the images")
            )

    def _fit(
        self, name: str, following: str | None, x: torch.Tensor, carried: list[Rows] | None,
        setting: _Setting, target: Rows, tails: tuple[dict, torch.Tensor | None], budget: Budget,
        title: str | None,
    ) -> tuple[StageFit, list[Rows] | None]:  # fmt: skip
        """Stage ``name``'s fit at every depth, and the next stage's inputs it carries (or None)."""
        work, paths, path = self.work, self.paths, self.paths[name]
        if carried is None:
            runs = [_run(work, paths, depth, name, x, setting.chunk, budget) for depth in self.depths]
        else:
            runs = [
                _carried(work, paths, d, name, rows, x) for d, rows in zip(self.depths, carried, strict=True)
            ]
        onward = None if following not in self.to_fit else segment_between(work, path, paths[following])
        share = None
        if setting.seconds is not None:  # an equal share of what is left
            left = len(self.to_fit) - self.to_fit.index(name)
            share = max(0.0, setting.seconds - (time.perf_counter() - self.started)) / left
        tail = None if tails[0].get(name) is None else (tails[0][name].requires_grad_(False), tails[1])
        labels = [run.depth or plural(run.steps, "step") for run in runs]
        stage_setting = copy.copy(setting)
        stage_setting.seconds = share
        stage_setting.progress = FitProgress(
            title or "", labels, setting.iterations, share, title is not None
        )
        coordinates = SourceCoordinates(work, within=path)
        fit, carried = _fit_stage(
            work.get_submodule(path), coordinates, runs, target, stage_setting, tail, Onward(onward, budget)
        )
        stage_setting.progress.close()
        for rows in (target, *(run.inputs for run in runs)):
            rows.close()
        return fit, carried

    def finish(self, report: CalibrationReport, budget: Budget) -> tuple[fx.GraphModule, CalibrationReport]:
        """The calibrated model: a copy of the model with the fitted tensors, in its train/eval mode,
        each fitted stage recording the step counts it was fitted for; the report completed."""
        del self.reference
        calibrated = copy.deepcopy(self.model)
        for stage in converted_stages(calibrated):
            record_stage_source(stage)
        calibrated.load_state_dict(self.work.state_dict())
        report.memory = (budget.nbytes / MIB, budget.spilled / MIB, self.peak.mib())
        report.seconds = time.perf_counter() - self.started
        fitted = {fit.stage for fit in report.stages if fit.fitted}
        for stage in converted_stages(calibrated):
            if stage.stage_name in fitted:
                stage.fitted_steps = tuple(sorted({depth.steps[stage.stage_name] for depth in self.depths}))
        return calibrated.train(self.model.training), report


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
    depth: Depth,
    name: str,
    x: torch.Tensor,
    chunk: int,
    budget: Budget,
) -> _Run:
    """Stage ``name`` of ``work`` switched to ``depth``, with its inputs there on ``x``."""
    stage = at_depth(work, paths, depth).get_submodule(paths[name])
    inputs = activations(work, {name: paths[name]}, x, chunk, "input", budget)[0][name]
    return _Run(depth.label, stage.steps, stage.unrolled_graph(), inputs, constants(work, paths[name], x))


def _carried(
    work: fx.GraphModule, paths: dict[str, str], depth: Depth, name: str, inputs: Rows, x: torch.Tensor
) -> _Run:
    """Stage ``name`` of ``work`` switched to ``depth``, with the inputs there that the fit of the
    stage before computed (the same values a pass of the model gives, without running its prefix)."""
    stage = at_depth(work, paths, depth).get_submodule(paths[name])
    return _Run(depth.label, stage.steps, stage.unrolled_graph(), inputs, constants(work, paths[name], x))


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
    progress: FitProgress | None = None


def _fit_stage(
    stage: ODEStage,
    coordinates: SourceCoordinates,
    runs: list[_Run],
    target: Rows,
    setting: _Setting,
    tail: Tail | None,
    onward: Onward,
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
        errors = _backward(stage, runs, target, pick, micro, tail)
        coordinates.pull()
        optimizer.step()
        coordinates.push()
        done += 1
        if setting.progress is not None:
            setting.progress.step(errors)
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


def _backward(
    stage: ODEStage, runs: list[_Run], target: Rows, pick: torch.Tensor, micro: int, tail: Tail | None
) -> list[float]:
    """The gradient of the runs' summed objective on the images ``pick``, accumulated micro-batch by
    micro-batch (each divided by the whole batch's target energy); returns each run's error there."""
    parts = pick.split(micro)
    wanted = [target.take(part) for part in parts] if len(parts) == 1 else None
    energy = _energy(wanted or (target.take(part) for part in parts))
    output_energy = _energy([tail[1][pick]]) if tail is not None else None
    errors = [0.0] * len(runs)  # each depth's on this batch, for the progress
    for i, part in enumerate(parts):
        goal = wanted[i] if wanted is not None else target.take(part)
        loss = None
        for j, run in enumerate(runs):  # equal weights on the depths' relative errors (see calibrate)
            h = stage.run_graph(run.graph, (run.inputs.take(part),), inputs=run.constants)
            term = (h - goal).pow(2).sum() / energy
            if tail is not None:
                term = term + (tail[0](h) - tail[1][part]).pow(2).sum() / output_energy
            errors[j] += float(term.detach())
            loss = term if loss is None else loss + term
        loss.backward()
    return errors


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


@torch.no_grad()
def _residuals(
    stage: ODEStage, run: _Run, target: Rows, chunk: int, tail: Tail | None, then: Next | None = None
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
