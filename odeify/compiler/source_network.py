"""The source network a converted model keeps: whether it can be run, and running it.

A converted model at native depth computes its source network. Compressing, refining or fine-tuning
changes its tensors; the source's values are kept as ``source_`` buffers
(:mod:`odeify.ir.source_tensors`), so the model can still run the network it was converted from: the
teacher of fine-tuning, the target of calibration, and what a saved file's probe checks.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from odeify.compiler.conversion import converted_stages, retarget
from odeify.compiler.fitted_depths import UnfittedDepthWarning
from odeify.core.errors import ConfigError
from odeify.ir.source_tensors import drop_sources, source_values, stage_source

__all__ = ["source_network", "unknown_source"]


def unknown_source(model: fx.GraphModule) -> str | None:
    """Why ``model``'s source network cannot be run from what it keeps; None when it can."""
    for stage in converted_stages(model):
        if stage_source(stage) is None:
            return (
                f"stage '{stage.stage_name}' has {stage.num_knots} knots for its {stage.depth} blocks and "
                "keeps no source knots (a file saved before odeify kept them)"
            )
    current = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, value in source_values(model).items():
        tensor = current.get(name)
        if tensor is None or tensor.shape != value.shape:
            shape = None if tensor is None else tuple(tensor.shape)
            return (
                f"its source's {name} has shape {tuple(value.shape)}, the model's {shape} (a new classifier?)"
            )
    return None


def source_network(model: fx.GraphModule) -> fx.GraphModule:
    """The network ``model`` was converted from, as a converted model at native depth, in eval mode
    (``odeify.source_network(model)``: what a calibrated or fine-tuned file gives back of its source).

    Built from the source tensors ``model`` keeps (its blocks' knots while its own are compressed
    or refined, the values fine-tuning started from), so retargeting, compressing or fine-tuning the
    model leaves it unchanged. Raises ConfigError when they are not all known (:func:`unknown_source`).
    """
    why = unknown_source(model)
    if why is not None:
        raise ConfigError(f"the model's source network is not known: {why}. Pass a teacher, or distill=0.")
    with warnings.catch_warnings():  # its knots are about to become the source's: fitted at native
        warnings.simplefilter("ignore", UnfittedDepthWarning)
        teacher = retarget(model, integrator="euler", steps="native", knots="native", backward="backprop")
    sources = {stage.stage_name: stage_source(stage) for stage in converted_stages(model)}
    values = source_values(model)
    with torch.no_grad():
        for stage in converted_stages(teacher):
            for slot in stage.slots:
                if slot.kind != "shared":
                    stage.slot_tensor(slot).copy_(sources[stage.stage_name][slot.name])
        tensors = dict(teacher.named_parameters()) | dict(teacher.named_buffers())
        for name, value in values.items():
            tensors[name].copy_(value)
    drop_sources(teacher)
    for stage in converted_stages(teacher):
        stage.fitted_steps = None  # the blocks' own knots
        stage.drop_corrections()  # never read at native steps
    return teacher.eval().requires_grad_(False)
