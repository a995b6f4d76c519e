"""A fine-tuning run from the command line's settings: what ``odeify finetune`` does once parsed.

The settings are an ``argparse.Namespace`` whose names are the flags' dests. :func:`with_recorded`
fills a resumed run's settings from its record (the record was checked on reading:
:mod:`odeify.train.state_schema`, which lists the recorded settings as ``RECORDED``);
:func:`recipe_from` makes the recipe (given, else recorded, else default); :func:`finetune_with`
builds the manifestation to train and runs :func:`odeify.train.finetune.finetune`, recording the
settings with the run.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import fields, replace
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn

from odeify.compiler.conversion import converted_stages
from odeify.models.data_config import TRAIN_AUGMENTATION_KEYS
from odeify.train.calibration_store import MIB
from odeify.train.datasets import Augmentation, LabelledData, check_data, open_data, recorded_augmentation
from odeify.train.distributed import Processes
from odeify.train.finetune import FineTuneResult, check_arguments, finetune
from odeify.train.manifestations import MEMORY_FREE_DEFAULT, StepProbe, for_training
from odeify.train.progress import DEFAULT_LOG_INTERVAL
from odeify.train.recipe import DEFAULT_RECIPE, Recipe, uses_alf
from odeify.train.state_schema import RECORDED
from odeify.train.torch_compile import torch_compile

__all__ = ["RECIPE_FLAGS", "augmentation", "finetune_with", "recipe_from", "with_recorded"]

RECIPE_FLAGS = (
    "epochs", "lr", "weight_decay", "batch_size", "distill", "ema_decay", "optimizer", "label_smoothing",
    "clip_grad_norm", "amp", "channels_last", "mixup", "cutmix", "warmup", "opt_eps", "depths",
)  # fmt: skip
"""The command-line settings that are Recipe fields (argparse dests named as the fields)."""
_TRAINED_MANIFESTATION = ("integrator", "steps", "knots", "basis")
"""The settings :func:`~odeify.train.manifestations.for_training` retargets by (backward apart)."""


def with_recorded(settings: argparse.Namespace, run: dict) -> argparse.Namespace:
    """A copy of ``settings`` with every one not given taken from the recorded ``run`` (as
    :func:`~odeify.train.state.read_run` returns it, checked); the given ones must match later."""
    merged = argparse.Namespace(**vars(settings))
    recorded = run.get("cli", {})
    for key in RECORDED:
        value = getattr(merged, key, None)
        if (value is None or value is False or value == []) and recorded.get(key) is not None:
            setattr(merged, key, recorded[key])
    recipe = run.get("recipe", {})
    for key in RECIPE_FLAGS:
        if getattr(merged, key) is None:
            setattr(merged, key, recipe.get(key))
    for key in ("refine_at", "seed", "max_batches"):
        if getattr(merged, key) is None:
            setattr(merged, key, run.get(key))
    return merged


def recipe_from(settings: argparse.Namespace, run: dict) -> Recipe:
    """The recipe: each field as given, else as ``run`` recorded it, else the default's
    (``clip_grad_norm`` 0 is --clip-grad none)."""
    given = {k: getattr(settings, k) for k in RECIPE_FLAGS if getattr(settings, k) is not None}
    if given.get("clip_grad_norm") == 0:
        given["clip_grad_norm"] = None
    names = {f.name for f in fields(DEFAULT_RECIPE)}
    recorded = {k: v for k, v in run.get("recipe", {}).items() if k in names}
    return replace(replace(DEFAULT_RECIPE, **recorded), **given)


def augmentation(settings: argparse.Namespace, model: nn.Module) -> Augmentation | None:
    """The training augmentation the settings ask for, or None (open_data's default) when none is given.

    A setting not given is the one the model's file recorded for its source (train.py's ``args``),
    else timm's default."""
    given = {k: getattr(settings, k) for k in TRAIN_AUGMENTATION_KEYS if getattr(settings, k) is not None}
    if not given:
        return None
    for key in ("scale", "ratio"):
        if key in given:
            given[key] = tuple(given[key])
    return Augmentation(**{**recorded_augmentation(model), **given})


def finetune_with(
    loaded: fx.GraphModule, settings: argparse.Namespace, recipe: Recipe, out: Path, processes: Processes
) -> FineTuneResult:
    """``loaded`` in the manifestation ``settings`` ask for, fine-tuned on their data with ``recipe``
    into ``out`` (the default manifestation measured on a batch of the recipe's size and the data's
    input shape); the settings of :data:`~odeify.train.state_schema.RECORDED` are recorded with the run."""
    manifestation = {
        k: getattr(settings, k) for k in _TRAINED_MANIFESTATION if getattr(settings, k) is not None
    }
    exact = recipe.amp is None and (processes.device.type == "cpu" or bool(settings.deterministic))
    data = open_data(settings.data, loaded, augmentation(settings, loaded))
    seed = 0 if settings.seed is None else settings.seed
    # refused before the default's training step is measured, not after
    check_arguments(loaded, recipe, settings.refine_at or [], settings.max_batches, seed)
    torch_compile(settings.torchcompile, settings.torchcompile_mode, processes.device, cli=True)
    check_data(data, loaded)
    given_none = not manifestation and settings.backward is None
    # a run recorded before the default was measured resumes with the default it was trained with; a
    # split without one full batch per process is refused by finetune, before any step
    fits = len(data.train) // processes.world_size >= recipe.batch_size
    probe = None
    if fits and not (settings.resume and given_none):
        batch = (recipe.batch_size, *_sample_shape(data))
        probe = StepProbe(batch, processes.device, announce=processes.is_main)
    model = for_training(
        loaded, settings.backward, rebuilds_exactly=exact, depths=recipe.depths, probe=probe, **manifestation
    )
    if given_none and not settings.resume:
        _record_default(settings, model)
    return finetune(
        model,
        data,
        recipe,
        out=out,
        resume=settings.resume,
        refine_at=settings.refine_at or [],
        seed=seed,
        max_batches=settings.max_batches,
        workers=settings.workers,
        processes=processes,
        teacher=settings.teacher,
        run_info={"cli": {k: getattr(settings, k) for k in RECORDED}},
        deterministic=settings.deterministic,
        log_interval=settings.log_interval or DEFAULT_LOG_INTERVAL,
        calibrate_first=settings.calibrate,
        calibrate_objective=settings.calibrate_objective,
        calibrate_memory=settings.calibrate_memory * MIB,
        torchcompile=settings.torchcompile,
        torchcompile_mode=settings.torchcompile_mode,
    )


def _sample_shape(data: LabelledData) -> tuple[int, ...]:
    """One training input's shape, read without moving the RNGs the run draws from (an image
    folder's augmentation draws from torch's and Python's)."""
    state = random.getstate()
    with torch.random.fork_rng():
        shape = tuple(data.train[0][0].shape)
    random.setstate(state)
    return shape


def _record_default(settings: argparse.Namespace, model: fx.GraphModule) -> None:
    """Record the manifestation a run given none trains with as if given (``--integrator alf --backward
    reversible``, or ``--backward checkpoint``): a resume then trains the same, wherever it runs,
    whatever the measurement would choose there."""
    stages = converted_stages(model)
    backward = {stage.backward for stage in stages}
    if backward == {"reversible"} and all(uses_alf([stage.integrator]) for stage in stages):
        settings.integrator, settings.backward = MEMORY_FREE_DEFAULT["integrator"], "reversible"
    elif backward == {"checkpoint"}:
        settings.backward = "checkpoint"
