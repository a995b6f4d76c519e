"""The manifestations a fine-tuning run moves between: the one it trains, its refinements, its teacher.

:func:`for_training` is the one policy for which backward mode a run trains with, for Python and
command-line users alike: a memory-free mode per stage unless one is asked for.
:func:`source_network` is the teacher: the network the model was converted from, run from the
source tensors the model keeps (:mod:`odeify.ir.source_tensors`), whatever its knots are now.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from safetensors import safe_open
from torch import nn

from odeify.compiler.conversion import converted_stages, retarget
from odeify.compiler.source_network import source_network, unknown_source
from odeify.core.errors import ConfigError
from odeify.ir.stage_ir import StageIR
from odeify.numerics.splitting import SPLITTINGS
from odeify.numerics.tableaus import REVERSIBLE_SCHEMES
from odeify.runtime.split_stage import SplitStage
from odeify.train.progress import LOGGER
from odeify.train.recipe import Recipe, with_lr
from odeify.train.step_peak import training_step_peak

__all__ = [
    "MEMORY_FREE_DEFAULT",
    "PEAK_MARGIN",
    "StepProbe",
    "at_source_manifestation",
    "load_teacher",
    "for_training",
    "memory_free_backward",
    "native_depth",
    "recipe_for",
    "refine",
    "runs_as_converted",
    "source_network",
    "unknown_source",
]


MEMORY_FREE_DEFAULT = {"integrator": "alf", "backward": "reversible"}
"""What a model at its source's manifestation trains with when nothing is asked for, where its
training step peaks lower than checkpointing's (:data:`PEAK_MARGIN`): ALF at its steps,
``backward='reversible'``. Exact gradients at the lowest peak memory of a training step on 224x224
models (benchmarks/results/peak_memory.md, CPU: resnet50 batch 16 peaks at 267 MiB at 1.51x timm
plain's step time, checkpoint at 372 MiB at 1.41x, timm's checkpointing at 507 MiB at 1.75x; on
resnet152 ALF's step is a third above checkpoint's, 1.53x against 1.12x, at 163 MiB against 425);
fine-tuned from there with the default recipe (at ALF's peak learning rate,
:data:`odeify.train.recipe.ALF_LR`), it meets the fine-tuning target on the corpus
(docs/finetuning.md)."""

PEAK_MARGIN = 0.9
"""How far below checkpointing's the measured step peak of :data:`MEMORY_FREE_DEFAULT` must be for
a run to take it by default: a reversible step costs more time (ALF 1.01-1.37x checkpoint's on the
CPU, benchmarks/results/peak_memory.md), so it has to buy memory. Measured ratios of ALF's peak to
checkpoint's: 0.38 (resnet152, 224x224), 0.59-0.72 (ConvNeXt, ViT, resnet50), 0.81 (resnet50 at
batch 8); 1.11-1.61 on the corpus's 32x32 models (resnet18, resnet50, a 6-block ViT), 1.2 on the
digits model."""


@dataclass(frozen=True)
class StepProbe:
    """The batch a run trains on, by shape and device: :func:`for_training` measures its default on it.

    ``announce``: log what was measured (the run's main process)."""

    batch_shape: tuple[int, ...]
    device: torch.device
    announce: bool = True


def for_training(
    model: fx.GraphModule,
    backward: str | Mapping[str, str] | None = None,
    *,
    rebuilds_exactly: bool = True,
    depths: str | None = None,
    probe: StepProbe | None = None,
    **settings: Any,
):
    """``model`` retargeted by ``settings`` (integrator, steps, knots, basis) to train with ``backward``.

    With nothing asked for, a model at its source's manifestation (:func:`at_source_manifestation`)
    trains as :data:`MEMORY_FREE_DEFAULT` where every stage takes it (the run's first log line shows
    each stage's manifestation; on a transformer ALF means its Lie-Trotter splitting), if the run
    ``rebuilds_exactly``: False under autocast, which the lattice does not run, and on a GPU without
    deterministic kernels, whose re-runs may return other bits; not on a transformer with one-block
    stages, such as Swin's first stages; and, given the run's batch (``probe``), where one training
    step on it peaks below :data:`PEAK_MARGIN` times checkpointing's (measured on copies, logged).
    Otherwise, without ``backward``, every stage gets the mode of :func:`memory_free_backward`. A run
    for several ``depths`` (``Recipe.depths``) keeps the model's integrator: ALF runs only at
    multiples of its knots.
    """
    reversible = None
    if (
        backward is None
        and depths is None
        and rebuilds_exactly
        and not any(v is not None for v in settings.values())
        and at_source_manifestation(model)
        and _reversible_pays(model)
    ):
        with contextlib.suppress(ConfigError):  # a stage ALF cannot run (a split stage): as below
            reversible = retarget(model, **MEMORY_FREE_DEFAULT)
        if reversible is not None and probe is None:
            return reversible
    integrator = settings.get("integrator")
    mode = backward if backward is not None else memory_free_backward(model, integrator)
    if backward is None and reversible is None and probe is not None and probe.announce:
        why = _not_measured(model, depths, rebuilds_exactly, settings)
        LOGGER.info(f"default backward mode: {_modes_text(mode)}, not measured against reversible ALF: {why}")
    model = retarget(model, backward=mode, **settings)
    # reversible is still held only with a probe: measure it against the mode it would replace
    return model if reversible is None else _lower_peak(reversible, model, probe)


def _lower_peak(reversible: fx.GraphModule, checkpointed: fx.GraphModule, probe: StepProbe) -> fx.GraphModule:
    """``reversible`` where one training step on the probe's batch peaks below :data:`PEAK_MARGIN`
    times ``checkpointed``'s, else ``checkpointed``; the log says what was measured and chosen."""
    peaks = [training_step_peak(m, probe.batch_shape, probe.device) for m in (reversible, checkpointed)]
    takes_reversible = peaks[0] <= PEAK_MARGIN * peaks[1]
    if probe.announce:
        batch, *sample = probe.batch_shape
        chosen = "reversible ALF" if takes_reversible else "checkpoint"
        LOGGER.info(
            f"default backward mode, measured on one training step (batch {batch} of "
            f"{'x'.join(map(str, sample))}): reversible ALF peaks at {peaks[0] / 2**20:.1f} MiB, checkpoint "
            f"at {peaks[1] / 2**20:.1f} MiB; training with {chosen} (ALF where its peak is below "
            f"{PEAK_MARGIN:g}x checkpoint's: its step takes longer). --backward checkpoint, or --integrator "
            "alf --backward reversible, picks one."
        )
    return reversible if takes_reversible else checkpointed


def _not_measured(model: fx.GraphModule, depths: str | None, rebuilds_exactly: bool, settings: dict) -> str:
    """Why a run's default backward mode was not measured against reversible ALF's (the first reason)."""
    asked = [f"--{name}" for name, value in settings.items() if value is not None]
    if asked:
        return f"{', '.join(asked)} set the manifestation, which keeps its integrator's memory-free mode"
    if depths is not None:
        return "--depths keeps the model's integrator (ALF runs only at multiples of its knots)"
    if not rebuilds_exactly:
        return "under --amp, or on a GPU without --deterministic, ALF's reversal cannot rebuild exactly"
    if not at_source_manifestation(model):
        return (
            "the model is not at its source's manifestation (retargeted or trained): it keeps its integrator"
        )
    if not _reversible_pays(model):
        return "its one-block transformer stages keep their input under reversible as under checkpoint"
    return "a stage cannot integrate with ALF"


def _modes_text(mode: str | Mapping[str, str]) -> str:
    """'checkpoint', or 'layer1 checkpoint, layer2 reversible'."""
    return mode if isinstance(mode, str) else ", ".join(f"{name} {m}" for name, m in mode.items())


def recipe_for(model: fx.GraphModule, recipe: Recipe) -> Recipe:
    """``recipe`` as a run trains ``model`` with it: a peak learning rate left None set for the model's
    integrators (:func:`odeify.train.recipe.default_lr`: lower where a stage integrates with ALF)."""
    return with_lr(recipe, (stage.integrator for stage in converted_stages(model)))


def runs_as_converted(stage: StageIR) -> bool:
    """Whether ``stage`` computes its blocks as converted, whatever its backward mode: Euler
    (Lie-Trotter on a split stage), one step and one constant knot per block."""
    return (
        stage.integrator.name in ("euler", "lie_trotter") and stage.basis == "constant"
        and stage.steps == stage.depth == stage.num_knots
    )  # fmt: skip


def at_source_manifestation(model: fx.GraphModule) -> bool:
    """Whether every stage runs as converted (:func:`runs_as_converted`) with backprop: the model
    computes its source network."""
    stages = converted_stages(model)
    return bool(stages) and all(runs_as_converted(s) and s.backward == "backprop" for s in stages)


def _reversible_pays(model: fx.GraphModule) -> bool:
    """Whether :data:`MEMORY_FREE_DEFAULT` is worth it over checkpointing: not on a transformer with
    stages of one block, which keep their input under reversible as under checkpointing. Measured
    (benchmarks/results/peak_memory.md, one training step's peak and time against timm plain's):
    swin_tiny, whose first two stages convert to eight one-block stages, reversible ALF 121 MiB at
    1.99x against checkpoint's 184 MiB at 1.48x (the time a third as much again); vit_small 60 MiB at
    1.44x against 97 MiB at 1.39x."""
    stages = converted_stages(model)
    has_split = any(isinstance(s, SplitStage) for s in stages)
    return not (has_split and any(s.depth == 1 for s in stages))


def memory_free_backward(model: fx.GraphModule, integrator: str | None = None) -> str | dict[str, str]:
    """A memory-free backward mode per stage: the one a stage has (unless ``integrator`` changes it),
    else reversible for a reversible integrator (ALF, reversible Heun) and checkpoint for any other.

    One mode for every stage comes back as a string: odeify's whole-model plan, which also
    recomputes the parts between the stages in backward.
    """
    modes = {}
    for stage in converted_stages(model):
        name = integrator or stage.integrator.name
        if stage.backward != "backprop" and integrator is None:
            modes[stage.stage_name] = stage.backward
        else:
            modes[stage.stage_name] = "reversible" if _reversible(name) else "checkpoint"
    return modes.popitem()[1] if len(set(modes.values())) == 1 else modes


def _reversible(name: str) -> bool:
    """Whether the integrator ``name`` is a reversible scheme, or a splitting whose every sub-step is one."""
    return name in REVERSIBLE_SCHEMES or (name in SPLITTINGS and SPLITTINGS[name].reversible)


def refine(model: fx.GraphModule) -> fx.GraphModule:
    """A new model with every stage's knots and steps doubled (the current weight path, resampled)."""
    stages = converted_stages(model)
    return retarget(
        model,
        knots={s.stage_name: 2 * s.num_knots for s in stages},
        steps={s.stage_name: 2 * s.steps for s in stages},
    )


def native_depth(model: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``model`` run as Euler at native depth (one step per block): the distillation teacher.

    With one knot per block, as converted, this is the source network itself.
    """
    return retarget(model, integrator="euler", steps="native", backward="backprop").eval()


def load_teacher(path: str | os.PathLike[str]) -> nn.Module:
    """The model in the file at ``path``: a converted model as saved, or a checkpoint odeify reads
    without further arguments (timm's train.py output, a Hugging Face folder, an odeify digits file)."""
    from odeify.models.loading import load_model
    from odeify.serialization.io import RECIPE_KEY, load

    target = Path(path).expanduser()
    if target.is_file() and target.suffix == ".safetensors":
        with safe_open(str(target), framework="pt") as handle:
            if RECIPE_KEY in (handle.metadata() or {}):
                return load(target)
    return load_model(target)
