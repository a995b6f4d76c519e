"""Fine-tune a converted model: the default recipe and the training loop behind ``odeify finetune``.

A converted model run coarser than native (fewer steps or knots, another integrator) loses some
accuracy; a few epochs of training get it back, memory-free when its stages use a memory-free
backward mode. :data:`DEFAULT_RECIPE` was chosen from the measurements of
``benchmarks/finetune.py`` (docs/finetuning.md has them).

The loop, :func:`finetune`:

- trains every parameter (knots, stem, downsampling blocks, head) with timm's
  ``create_optimizer_v2`` and a per-step learning rate (linear warm-up, then cosine);
- with ``recipe.ema_decay``, keeps an exponential moving average of the weights (timm's
  ``ModelEmaV3`` with its warm-up, updated after every optimizer step) and returns and saves the
  average, which is less noisy than the last step's weights; the history records both accuracies;
- trains the source's tensors of every folded BatchNorm layer, not the folded ones
  (:mod:`odeify.train.parametrization`), so a step changes the model as it would change the source;
- distills, by default, from the source network (:func:`source_network`), which the model keeps
  through retargeting, compression and fine-tuning; when it is not known, says so and trains on the
  labels;
- evaluates on the validation split before training and after every epoch;
- with ``out``: after every epoch writes, atomically and in this order, the training state
  (``train_state.safetensors``: model, weight average, optimizer, epoch, step, history; resumable),
  the model (``last.safetensors``, readable by ``odeify.load``; the weight average when the recipe
  keeps one), ``best.safetensors`` when validation accuracy improved, and ``history.json``. A crash
  or kill leaves the previous epoch's files intact; one killed after the state and before the
  other files is finished by the resume. The run holds a lock on ``out`` (a second run into the
  same folder is refused, naming the first's pid; a killed run's lock is taken over);
- ``resume=True`` continues the run recorded in ``out`` exactly: the global RNGs are reseeded from
  (seed, epoch, rank) at every epoch start and the batch order depends only on (seed, epoch), so
  the resumed epochs draw what an uninterrupted run draws. It refuses a damaged state, other
  settings, and a model, teacher or data other than the run began with (their fingerprints are
  recorded with the state);
- refuses data that cannot train the model (labels out of range or not int64, another channel
  count, NaN or inf inputs) before any work;
- with data of other classes than the model's, resets the classifier (its new weights follow
  ``seed``) and trains on the labels alone (the teacher predicts the old classes);
- stops with :class:`TrainingDiverged` (naming the epoch, step and stage) at the first non-finite
  loss or gradient, before the optimizer applies it and without writing anything;
- ``refine_at``: at the start of those epochs doubles every stage's knots and steps (refinement
  evaluates the current weight path, so the function barely changes); the optimizer is rebuilt
  for the new knot tensors, keeping the state of every parameter whose shape did not change; the
  weight average is refined the same way;
- runs unchanged under ``torchrun``: DistributedDataParallel (gloo on CPU, nccl on GPU), a
  DistributedSampler shard per rank, progress, evaluation and saving on rank 0;
- logs one line per epoch and per event to ``logging.getLogger("odeify")`` (rank 0 only).

The pieces live in their own modules: the recipe (:mod:`odeify.train.recipe`), the schedule
(:mod:`odeify.train.schedule`), the process set-up (:mod:`odeify.train.distributed`), one epoch
(:mod:`odeify.train.trainer`), the run's record and resumable state (:mod:`odeify.train.state`),
what the run says (:mod:`odeify.train.progress`), and which manifestation trains
(:mod:`odeify.train.manifestations`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from odeify.compiler.conversion import converted_stages
from odeify.core.errors import ConfigError, TrainingDiverged
from odeify.core.lock import folder_lock
from odeify.core.paths import output_folder
from odeify.ir.source_tensors import record_source
from odeify.serialization.io import save
from odeify.train.calibration import calibrate, check_objective
from odeify.train.calibration_store import MIB
from odeify.train.datasets import LabelledData, check_data, make_loader
from odeify.train.depth_corrections import adopt_corrections, hold_corrections
from odeify.train.depths import (
    DepthPlan,
    batch_depths,
    depths_line,
    mark_trained_depths,
    validation_at_depths,
)
from odeify.train.distributed import Processes, start_processes, stop_processes
from odeify.train.fingerprint import check_fingerprint, run_fingerprint
from odeify.train.manifestations import (
    for_training,
    load_teacher,
    native_depth,
    recipe_for,
    refine,
    source_network,
    unknown_source,
)
from odeify.train.progress import (
    DEFAULT_LOG_INTERVAL,
    LOGGER,
    compile_line,
    epoch_line,
    extension_note,
    finished_note,
    header,
    loss_name,
    option,
    refine_message,
    run_summary,
    teacher_line,
)
from odeify.train.recipe import (
    CALIBRATION_MEMORY_MIB,
    CALIBRATION_OBJECTIVE,
    DEFAULT_RECIPE,
    EMA_WARMUP_POWER,
    Recipe,
)
from odeify.train.schedule import learning_rate_factor
from odeify.train.state import (
    BEST_FILE,
    HISTORY_FILE,
    LAST_FILE,
    STATE_FILE,
    STATE_KEY,
    EpochRecord,
    check_same_run,
    finish_epoch_outputs,
    read_run,
    read_state,
    require_folder,
    write_state,
)
from odeify.train.state_schema import StateError, check_tensors
from odeify.train.torch_compile import torch_compile
from odeify.train.trainer import Trainer, reseed, stage_shape, validate

__all__ = [
    "BEST_FILE",
    "DEFAULT_RECIPE",
    "EMA_WARMUP_POWER",
    "HISTORY_FILE",
    "LAST_FILE",
    "STATE_FILE",
    "STATE_KEY",
    "EpochRecord",
    "FineTuneResult",
    "Processes",
    "Recipe",
    "TrainingDiverged",
    "check_arguments",
    "finetune",
    "for_training",
    "learning_rate_factor",
    "native_depth",
    "read_run",
    "recipe_for",
    "refine",
    "source_network",
    "start_processes",
    "stop_processes",
    "use_deterministic_algorithms",
]
"""The names a user of fine-tuning needs, in one place (each defined in its own module)."""


@dataclass
class FineTuneResult:
    """The trained model (the last epoch's, not the best), the history, and the best epoch.

    ``model`` is the weight average when the recipe keeps one (``Recipe.ema_decay``).
    """

    model: fx.GraphModule
    history: list[EpochRecord]

    @property
    def best(self) -> EpochRecord:
        """The record with the highest validation accuracy (the earliest among equals)."""
        return max(self.history, key=lambda r: (r.val_accuracy, -r.epoch))


def finetune(
    model: fx.GraphModule,
    data: LabelledData,
    recipe: Recipe = DEFAULT_RECIPE,
    *,
    out: str | os.PathLike[str] | None = None,
    resume: bool = False,
    refine_at: Sequence[int] = (),
    seed: int = 0,
    max_batches: int | None = None,
    workers: int = 0,
    processes: Processes | None = None,
    teacher: nn.Module | str | os.PathLike[str] | None = None,
    run_info: Mapping[str, Any] | None = None,
    progress: bool = True,
    deterministic: bool = False,
    log_interval: int = DEFAULT_LOG_INTERVAL,
    calibrate_first: bool = True,
    calibrate_objective: str = CALIBRATION_OBJECTIVE,
    calibrate_memory: int = CALIBRATION_MEMORY_MIB * MIB,
    torchcompile: str | None = None,
    torchcompile_mode: str | None = None,
) -> FineTuneResult:
    """Fine-tune ``model`` (a converted model) on ``data`` with ``recipe``; see the module docstring.
    ``recipe.lr`` None trains at the peak :func:`odeify.train.recipe.default_lr` picks for the model.

    ``teacher``: what the recipe distills from (``recipe.distill > 0``), a module or the path of a
    model file (converted, or a checkpoint odeify loads by itself); default: the source network the
    model keeps (:func:`source_network`), unchanged by retargeting, compression or earlier
    fine-tuning; when it is not known, the run says so and trains on the labels. ``max_batches``
    cuts each epoch short (quick tries). ``run_info`` is recorded with the run and must match on
    resume, with every other setting (a resumed run continues the recorded one), except
    ``recipe.epochs``, which may grow: a finished run then trains further; a ``"cli"`` entry (the
    command line's) makes the log name its flags, not Python's arguments. ``deterministic`` makes
    torch use deterministic kernels (on GPUs: what an exact resume and the reversible backward's
    bit-exact rebuild need). ``progress``: a bar on a terminal, else a log line every
    ``log_interval`` batches. ``calibrate_first``: a new run of a coarse manifestation (fewer steps
    or knots than blocks) whose source is known, not already fitted for its depths, starts from
    :func:`odeify.calibrate` on its training images (docs/calibration.md), with that calibration's
    ``objective`` and ``memory`` (bytes) ``calibrate_objective`` and ``calibrate_memory``.
    ``torchcompile``: train and validate through ``torch.compile`` with this backend (and
    ``torchcompile_mode``), timm train.py's ``--torchcompile`` (:mod:`odeify.train.torch_compile`);
    it does not change the weights, so a resume may drop or add it.
    """
    refine_epochs = check_arguments(model, recipe, refine_at, max_batches, seed)
    cli = "cli" in (run_info or {})  # the command line's run: the log names its flags, not Python's
    check_objective(calibrate_objective, "calibrate_objective")
    recipe = recipe_for(model, recipe)
    check_data(data, model)
    procs = processes or Processes()
    compiled = torch_compile(torchcompile, torchcompile_mode, procs.device, cli)
    folder = _run_folder(out, resume)
    with _folder_lock(folder, procs):
        if deterministic:
            use_deterministic_algorithms()
        # before anything changes the model: what it holds now is its source where nothing else is kept
        record_source(model, [name for name, p in model.named_parameters() if p.requires_grad])
        recipe = _match_classes(model, data, recipe, seed)
        teacher, recipe = _teacher(model, recipe, teacher, cli)
        started_from = run_fingerprint(model, teacher, data) if folder is not None else {}
        run = _run_record(recipe, refine_epochs, seed, max_batches, procs, run_info)
        loader, val_loader, batches = _loaders(data, recipe, seed, procs, workers, max_batches)
        _log_start(model, data, procs)
        model = model.to(procs.device)
        plan = DepthPlan.of(model, recipe.depths) if recipe.depths is not None else None
        calibrated = (
            calibrate_first
            and not resume
            and _calibrate_in_place(
                model, data, seed, procs, (calibrate_objective, calibrate_memory), plan, val_loader, cli
            )
        )
        if plan is not None:  # each depth trains a correction of its own, native the knots
            hold_corrections(model, plan.steps)
        mark_trained_depths(model, plan)
        trainer = Trainer(model, recipe, procs, batches * recipe.epochs, teacher, compiled)
        if compiled is not None and procs.is_main:
            LOGGER.info(compile_line(compiled, trainer))
        if resume:
            history = _resume(trainer, require_folder(folder), run, refine_epochs, started_from)
        else:
            history = _begin(trainer, val_loader, folder, plan, calibrated, cli)
        epochs = _Epochs(loader, val_loader, batches, plan, refine_epochs, seed, folder, run, started_from)
        _train_epochs(trainer, history, epochs, progress and procs.is_main, log_interval)
        if procs.is_main:
            LOGGER.info(run_summary(history, folder))
    return FineTuneResult(trainer.output, history)


@dataclass
class _Epochs:
    """What the epochs of a run read: the loaders and batches per epoch, the depth plan, the epochs
    that refine, the seed, and where and what the run records (no folder: nothing is written)."""

    loader: Any
    val_loader: Any
    batches: int
    plan: DepthPlan | None
    refine_epochs: list[int]
    seed: int
    folder: Path | None
    run: dict[str, Any]
    started_from: dict


def _train_epochs(
    trainer: Trainer, history: list[EpochRecord], epochs: _Epochs, progress: bool, log_interval: int
) -> None:
    """Train the epochs after those in ``history`` up to the recipe's, appending each one's record;
    each is validated, saved (with a folder) and logged."""
    for epoch in range(len(history), trainer.recipe.epochs + 1):
        if epoch in epochs.refine_epochs:
            _refine(trainer, epoch)
        reseed(epochs.seed, epoch, trainer.procs.rank)
        epochs.loader.sampler.set_epoch(epoch)
        switch = batch_depths(trainer, epochs.plan, epochs.seed, epoch, epochs.batches)
        record = trainer.train_epoch(
            epochs.loader, epochs.batches, epoch, progress, log_interval, before_batch=switch
        )
        _validate_epoch(trainer, record, epochs.val_loader, epochs.plan)
        history.append(record)
        if epochs.folder is not None:
            trainer.save(epochs.folder, epoch, history, epochs.run, epochs.started_from)
        _log_epoch(trainer, history, epochs.folder)


def _run_record(
    recipe: Recipe, refine_epochs: list[int], seed: int, max_batches: int | None, procs: Processes,
    run_info: Mapping[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """The run's settings as recorded with its state, which a resume must match."""
    return {
        "recipe": asdict(recipe),
        "refine_at": refine_epochs,
        "seed": seed,
        "max_batches": max_batches,
        "world_size": procs.world_size,
        **(run_info or {}),
    }


def _log_start(model: fx.GraphModule, data: LabelledData, procs: Processes) -> None:
    """The run's first lines (on rank 0): the model, the processes and the training augmentation."""
    if not procs.is_main:
        return
    LOGGER.info(header(model, procs))
    if data.augmentation != "none":
        LOGGER.info(f"training augmentation: {data.augmentation}")


def _refine(trainer: Trainer, epoch: int) -> None:
    """Double every stage's knots and steps at the start of ``epoch``, and say so."""
    before = stage_shape(trainer.model)
    kept = trainer.replace_model(refine(trainer.model))
    mark_trained_depths(trainer.model, None)  # refined knots: the new steps are the ones trained
    if trainer.ema is not None:
        mark_trained_depths(trainer.ema.module, None)
    if trainer.procs.is_main:
        optimizer = type(trainer.optimizer).__name__
        LOGGER.info(refine_message(epoch, before, stage_shape(trainer.model), kept, optimizer))


def _log_epoch(trainer: Trainer, history: list[EpochRecord], folder: Path | None) -> None:
    """The line (on rank 0) of the epoch just trained, the last of ``history``, against the best before it."""
    if not trainer.procs.is_main:
        return
    recipe, best_before = trainer.recipe, max(h.val_accuracy for h in history[:-1])
    loss = loss_name(recipe, trainer.teacher is not None)
    LOGGER.info(epoch_line(history[-1], recipe.epochs, best_before, folder, loss))
    if history[-1].depth_accuracy:
        LOGGER.info(depths_line(history[-1]))


def _calibrate_in_place(
    model: fx.GraphModule, data: LabelledData, seed: int, procs: Processes, fit: tuple[str, int],
    plan: DepthPlan | None, val_loader, cli: bool,
) -> bool:  # fmt: skip
    """Calibrate ``model`` on its training images when it is coarse (at a depth trained for) and its
    source known; for every depth of ``plan`` when there is one. Logs the model's accuracy as given
    first (the run's epoch 0 is measured after); returns whether it calibrated."""
    stages = converted_stages(model)
    steps = [{s.stage_name: s.steps for s in stages}] if plan is None else list(plan.steps)
    coarse = [s for s in stages if min(s.num_knots, *(d[s.stage_name] for d in steps)) < s.depth]
    if not coarse:
        return False
    why = unknown_source(model)
    if why is not None:
        if procs.is_main:
            LOGGER.info(f"note: not calibrated before fine-tuning: the source network is not known ({why})")
        return False
    if all(
        s.fitted_steps is not None and {d[s.stage_name] for d in steps} <= set(s.fitted_steps) for s in coarse
    ):
        if procs.is_main:
            LOGGER.info(_fitted_already(coarse))
        return False
    _, _, at_depths = given = validation_at_depths(model, val_loader, procs, plan)
    if procs.is_main:
        LOGGER.info(f"the model as given (before calibration): {_accuracy_text(given[0], at_depths)}")
    objective, memory = fit
    torch.manual_seed(seed)  # a split whose transform cannot be swapped for the evaluation one may draw
    depths = {} if plan is None else {"steps": list(plan.labels)}
    calibrated, report = calibrate(
        model, data, seed=seed, progress=procs.is_main, objective=objective, memory=memory, **depths
    )
    adopt_corrections(model, calibrated)  # in place: the caller's model (and its hooks) trains
    if procs.is_main:
        setting = option(f"calibrate_objective={objective!r}", f"--calibrate-objective {objective}", cli)
        without = option("calibrate_first=False", "--no-calibrate", cli)
        LOGGER.info(
            f"the coarse stages are fitted to the source network before fine-tuning ({setting}; {without} "
            f"starts from the retargeted knots); {report}"
        )
    return True


def _fitted_already(stages: Sequence) -> str:
    """The line of a run whose file is already fitted for its depths: it is not calibrated again."""
    fitted = "; ".join(f"{s.stage_name} {', '.join(map(str, s.fitted_steps))}" for s in stages)
    return (
        f"the file is already calibrated or trained for the run's depths (steps fitted per stage: {fitted}): "
        "fine-tuning starts from the file's fit, without calibrating again"
    )


def _accuracy_text(worst: float, at_depths: Mapping[str, float]) -> str:
    """'val accuracy 98.33%', or each depth's: 'val accuracy at native 98.33%, x0.5 97.21%'."""
    if not at_depths:
        return f"val accuracy {worst:.2%}"
    return "val accuracy at " + ", ".join(f"{label} {accuracy:.2%}" for label, accuracy in at_depths.items())


def _run_folder(out: str | os.PathLike[str] | None, resume: bool) -> Path | None:
    """The run's folder, checked before anything is written: a folder (or none yet), not a file, a
    FIFO or an empty path; without ``resume``, not already holding a run."""
    if out is None:
        return None
    folder = output_folder(out, "out (the run's folder)", error=ConfigError)
    if not resume and (folder / STATE_FILE).exists():
        raise ConfigError(
            f"{folder} already holds a fine-tuning run. Continue it with resume=True (CLI: --resume), or "
            "pass another out folder (--out)."
        )
    return folder


def _folder_lock(folder: Path | None, procs: Processes):
    """The lock of the run's folder, held by rank 0 for the whole run (nothing when there is no folder)."""
    if folder is None or not procs.is_main:
        return contextlib.nullcontext()

    def took_over(previous: dict) -> None:
        LOGGER.info(
            f"note: {folder} was locked by pid {previous.get('pid')} on {previous.get('host')}, which no "
            "longer holds the lock (a run that was killed); this run takes it over"
        )

    return folder_lock(folder, on_takeover=took_over)


def _loaders(data: LabelledData, recipe: Recipe, seed: int, procs: Processes, workers: int,
             max_batches: int | None):  # fmt: skip
    """The training loader (this rank's shard), the validation loader, and batches per epoch."""
    loader = make_loader(
        data.train, recipe.batch_size, train=True, seed=seed, rank=procs.rank, world_size=procs.world_size,
        workers=workers,
    )  # fmt: skip
    val_loader = make_loader(data.val, max(recipe.batch_size, 256), train=False, workers=workers)
    batches = min(len(loader), max_batches or len(loader))
    if batches == 0:
        raise ConfigError(
            f"the training split has {len(data.train)} samples per {procs.world_size} process(es): not one "
            f"full batch of {recipe.batch_size}. Lower --batch-size."
        )
    return loader, val_loader, batches


def _validate_epoch(trainer: Trainer, record: EpochRecord, val_loader, plan: DepthPlan | None) -> None:
    """Fill in ``record``'s accuracies: the returned model's and, with a weight average, the raw weights';
    with a depth plan, at every depth (the worst one is the record's)."""
    record.val_accuracy, record.val_loss, record.depth_accuracy = validation_at_depths(
        trainer.validated_output, val_loader, trainer.procs, plan
    )
    if trainer.ema is not None:
        record.val_accuracy_raw = validation_at_depths(trainer.running, val_loader, trainer.procs, plan)[0]


def check_arguments(
    model: nn.Module, recipe: Recipe, refine_at: Sequence[int], max_batches: int | None, seed: object
) -> list[int]:
    """Refuse what cannot be trained before any work; returns the refinement epochs, sorted."""
    if not converted_stages(model):
        raise ConfigError(
            "finetune takes a converted model (odeify.convert / odeify.load); this one has no ODE stages."
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("finetune got a model without trainable parameters (every requires_grad is False).")
    refine_epochs = sorted(set(refine_at))
    if any(not 2 <= e <= recipe.epochs for e in refine_epochs):
        raise ConfigError(
            f"refine_at epochs must lie in 2..{recipe.epochs} (refining happens at the start of an epoch, "
            f"after at least one epoch at the coarse depth); got {list(refine_at)}."
        )
    if refine_epochs and recipe.depths is not None:
        raise ConfigError(
            f"refine_at doubles every stage's steps, which would move the depths the recipe trains for "
            f"({recipe.depths}); give one or the other."
        )
    if max_batches is not None and (
        isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
    ):
        raise ConfigError(f"max_batches must be a positive integer or None; got {max_batches!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"seed must be an integer in [0, 2^63); got {seed!r}.")
    return refine_epochs


def _teacher(
    model: fx.GraphModule, recipe: Recipe, teacher: nn.Module | str | os.PathLike[str] | None, cli: bool
) -> tuple[nn.Module | None, Recipe]:
    """The model to distill from, in eval mode, and the recipe to train with.

    None (and no distillation) when the recipe does not distill, or when no teacher is given and the
    model's source network is not known (said once, in the log).
    """
    if recipe.distill == 0:
        return None, recipe
    if teacher is not None:
        found = load_teacher(teacher) if isinstance(teacher, (str, os.PathLike)) else teacher
        return found.eval(), recipe
    why = unknown_source(model)
    if why is None:
        return source_network(model), recipe
    LOGGER.warning(
        f"note: no teacher: the source network of this model is not known ({why}), so it trains on the "
        f"labels alone. Pass the source as a teacher ({option('teacher=...', '--teacher FILE', cli)}) to "
        "distill from it."
    )
    return None, replace(recipe, distill=0.0)


def _match_classes(model: nn.Module, data: LabelledData, recipe: Recipe, seed: int) -> Recipe:
    """Give ``model`` a new classifier for ``data``'s classes when they differ; returns the recipe to
    train with (without distillation then: the teacher predicts the old classes)."""
    have = getattr(model, "num_classes", None)
    if have is None or have == data.num_classes:
        return recipe
    if not hasattr(model, "reset_classifier"):
        raise ConfigError(
            f"the model predicts {have} classes but {data.name} has {data.num_classes}, and it has no "
            f"reset_classifier; convert it with num_classes={data.num_classes} (CLI: --num-classes)."
        )
    torch.manual_seed(seed)  # the new classifier's initial weights follow the run's seed
    model.reset_classifier(data.num_classes)
    LOGGER.info(
        f"note: the model had {have} classes, {data.name} has {data.num_classes}: its classifier was "
        "reset (new weights) and it trains on the labels, without distillation"
    )
    return replace(recipe, distill=0.0)


def use_deterministic_algorithms() -> None:
    """Deterministic kernels everywhere (cuBLAS needs its workspace setting for that)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def _begin(
    trainer: Trainer, val_loader, folder: Path | None, plan: DepthPlan | None, calibrated: bool, cli: bool
) -> list[EpochRecord]:
    """Evaluate the model (and the teacher) before training: the history's epoch 0 (after calibration,
    when the run calibrated)."""
    procs = trainer.procs
    accuracy, loss, at_depths = validation_at_depths(trainer.running, val_loader, procs, plan)
    start = EpochRecord(
        0, accuracy, val_loss=loss, depth_accuracy=at_depths, torchcompile=trainer.compile_label,
        **stage_shape(trainer.model),
    )  # fmt: skip
    if folder is not None and procs.is_main:
        save(trainer.model, folder / BEST_FILE)
    teacher = validate(trainer.teacher, val_loader, procs) if trainer.teacher is not None else None
    if procs.is_main:
        when = "after calibration, before fine-tuning" if calibrated else "before fine-tuning"
        worst = " (the worst depth's)" if start.depth_accuracy else ""
        LOGGER.info(f"epoch 0 ({when}): val accuracy {start.val_accuracy:.2%}{worst}")
        if start.depth_accuracy:
            LOGGER.info(depths_line(start))
        if teacher is not None:
            LOGGER.info(teacher_line(teacher, start.val_accuracy, trainer.recipe, cli))
    return [start]


def _resume(
    trainer: Trainer, folder: Path, run: dict, refine_epochs: list[int], started_from: dict
) -> list[EpochRecord]:
    """Restore the run recorded in ``folder`` (refinements, weights, optimizer) and finish the write
    sequence of its last epoch, which a kill may have cut short; returns its history."""
    state = read_state(folder / STATE_FILE)
    check_fingerprint(state.get("started_from"), started_from, folder)  # first: the cause, when data changed
    check_same_run(state["run"], run, folder, growing=("recipe.epochs",), free=("cli.log_interval",))
    for epoch in refine_epochs:
        if epoch <= state["epoch"]:
            trainer.replace_model(refine(trainer.model))
    try:
        average = trainer.ema.module if trainer.ema else None
        check_tensors(state, trainer.model, trainer.optimizer, average, trainer.sources)
    except StateError as exc:
        raise ConfigError(
            f"cannot resume {folder}: its training state does not fit this run: {exc}."
        ) from None
    trainer.load(state)
    history = [EpochRecord(**r) for r in state["history"]]
    if trainer.procs.is_main:
        removed = finish_epoch_outputs(folder, trainer.output, history)
        cleaned = f"; removed {len(removed)} temporary file(s) of a killed write" if removed else ""
        LOGGER.info(f"resumed {folder} after epoch {state['epoch']} (optimizer step {trainer.step}){cleaned}")
        recorded_epochs, epochs = state["run"]["recipe"]["epochs"], trainer.recipe.epochs
        if epochs > recorded_epochs:
            LOGGER.info(extension_note(recorded_epochs, epochs, trainer.step, trainer.total_steps))
            # the extension is recorded now: a kill in its first epoch must not end the run at the old count
            write_state(folder / STATE_FILE, trainer, state["epoch"], history, run, started_from)
        elif state["epoch"] >= epochs:
            LOGGER.info(finished_note(folder, epochs))
    if trainer.procs.world_size > 1:
        torch.distributed.barrier()
    return history
