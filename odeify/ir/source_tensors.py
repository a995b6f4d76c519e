"""The source network's tensors that a converted model keeps once it no longer holds them itself.

A converted model at native depth computes its source network. Compressing or refining a stage's
knots, and fine-tuning, change its tensors; just before they do, odeify keeps the source's value of
each one as a buffer beside it, so that the model can still run its source function (the teacher
of fine-tuning, ``odeify.train.manifestations.source_network``) and a saved file carries it:

- a stage's knot stacks: ``<stage>.source_<slot>``, one knot per block (the run's own blocks), every
  time-dependent slot of the stage at once;
- any other tensor ``<module>.<name>``: ``<module>.source_<name>``.

A tensor without such a buffer still holds its source value, except in a stage whose knot count
is not its depth and that has no ``source_`` buffers (a file saved before they existed): its source
is not known.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from odeify.ir.stage_ir import StageIR

__all__ = [
    "SOURCE_PREFIX",
    "attach_sources",
    "drop_sources",
    "record_source",
    "record_stage_source",
    "source_values",
    "stage_source",
]

SOURCE_PREFIX = "source_"


def stage_source(stage: StageIR) -> dict[str, torch.Tensor] | None:
    """Each time-dependent slot's source knots (one per block), by slot name; None when not known.

    A stage that recorded none holds them itself when it has one knot per block.
    """
    slots = [slot for slot in stage.slots if slot.kind != "shared"]
    recorded = {slot.name: getattr(stage, SOURCE_PREFIX + slot.name, None) for slot in slots}
    if all(value is not None for value in recorded.values()):
        return recorded  # type: ignore[return-value]
    if stage.num_knots == stage.depth:
        return {slot.name: stage.slot_tensor(slot) for slot in slots}
    return None


def record_stage_source(stage: StageIR) -> None:
    """Keep the stage's knots as its source before they change, unless it has recorded them already.

    Only a stage with one knot per block can record: other knots are not the source's blocks.
    """
    if stage.num_knots != stage.depth:
        return
    for slot in stage.slots:
        name = SOURCE_PREFIX + slot.name
        if slot.kind != "shared" and not hasattr(stage, name):
            stage.register_buffer(name, stage.slot_tensor(slot).detach().clone())


def record_source(model: nn.Module, names: Iterable[str]) -> None:
    """Keep the current value of each named parameter or buffer of ``model`` as its source.

    A stage's knots are recorded with :func:`record_stage_source`; a tensor whose source is
    recorded already keeps that record.
    """
    stages = {id(m.knots): m for m in model.modules() if isinstance(m, StageIR)}
    corrections = {id(c) for m in model.modules() if isinstance(m, StageIR) for c in m.corrections.values()}
    for name in names:
        path, _, attr = name.rpartition(".")
        owner = model.get_submodule(path)
        if id(owner) in corrections:
            continue  # a per-depth correction stands for no source tensor: native reads the knots
        stage = stages.get(id(owner), owner if isinstance(owner, StageIR) else None)
        if stage is not None:
            record_stage_source(stage)
        elif not hasattr(owner, SOURCE_PREFIX + attr):
            owner.register_buffer(SOURCE_PREFIX + attr, getattr(owner, attr).detach().clone())


def source_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """The recorded source of every tensor outside the stages, by the name of the tensor it stands for."""
    stages = [path for path, m in model.named_modules() if isinstance(m, StageIR)]
    found = {}
    for path, module in model.named_modules():
        if any(path == p or path.startswith(f"{p}.") for p in stages):
            continue
        for attr, value in module.named_buffers(recurse=False):
            if attr.startswith(SOURCE_PREFIX):
                found[".".join(filter(None, (path, attr.removeprefix(SOURCE_PREFIX))))] = value
    return found


def attach_sources(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Register as buffers of ``model`` the ``source_`` tensors among ``tensors`` (a saved state dict).

    A stage's source of a slot must be that slot's knots, one per block; any other source must have
    the dtype and rank of the tensor it stands for (its classifier may predict other classes).
    Returns the problems found (nothing is registered for those); an empty list when all fit.
    """
    stages = {path: m for path, m in model.named_modules() if isinstance(m, StageIR)}
    problems = []
    for key, value in tensors.items():
        path, _, attr = key.rpartition(".")
        if not attr.startswith(SOURCE_PREFIX):
            continue
        name = attr.removeprefix(SOURCE_PREFIX)
        try:
            owner = model.get_submodule(path)
        except AttributeError:
            problems.append(f"{key} belongs to no module of the model")
            continue
        if path in stages:
            slot = next((s for s in stages[path].slots if s.name == name and s.kind != "shared"), None)
            current = stages[path].slot_tensor(slot) if slot is not None else None
            shape = None if current is None else (stages[path].depth, *current.shape[1:])
        else:
            current = getattr(owner, name, None)
            current = current if isinstance(current, torch.Tensor) else None
            shape = None if current is None or value.dim() != current.dim() else tuple(value.shape)
        if current is None or tuple(value.shape) != shape or value.dtype != current.dtype:
            problems.append(f"{key} {tuple(value.shape)} {value.dtype} does not fit what it is the source of")
            continue
        owner.register_buffer(attr, torch.empty_like(value))
    return problems


def drop_sources(model: nn.Module) -> None:
    """Remove every ``source_`` buffer of ``model`` (a model that holds its source itself, or one
    rebuilt from random weights, whose recorded sources would be those weights)."""
    for module in model.modules():
        for name in [n for n in module._buffers if n.startswith(SOURCE_PREFIX)]:
            del module._buffers[name]
