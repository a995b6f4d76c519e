"""``odeify.analyze``: trace a model, find its residual blocks and runs, return the Plan."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn

from odeify.compiler.pipeline import Job
from odeify.compiler.pipelines import ANALYZE, ANALYZE_GRAPH, TRACE_SHAPES
from odeify.core.budget import check_input_bytes
from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError, OdeifyError
from odeify.ir.plan import Plan


def resolve_model(source: str | os.PathLike | nn.Module, **load_kwargs) -> tuple[nn.Module, str]:
    """An eval-mode module and a display name, from a module, a timm name or a checkpoint path."""
    from odeify.models.loading import load_model

    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    model = load_model(source, **load_kwargs)
    name = Path(source).name if isinstance(source, str) and os.sep in source else source
    if not isinstance(name, str):
        name = type(source).__name__
    return model, name


def input_shape_for(model: nn.Module, input_size: Sequence[int] | None) -> tuple[int, ...]:
    """Validate a user-given input size; default to the model's pretrained config."""
    from odeify.models.timm_interface import default_input_size

    shape = tuple(default_input_size(model) if input_size is None else input_size)
    if not shape or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
        raise OdeifyError(
            "input_size must be positive integers such as (1, 3, 224, 224) or (3, 224, 224); "
            f"got {input_size!r}."
        )
    if len(shape) == 3:
        shape = (1, *shape)
    check_input_bytes("input_size", shape, model_dtype(model).itemsize)  # traced on meta; the
    return shape  # verification input and probes are real, so the size is bounded where it enters


def validate_leaf_modules(leaf_modules: object) -> None:
    """``leaf_modules`` must be nn.Module subclasses (classes, not names or instances)."""
    if isinstance(leaf_modules, (str, bytes)) or not isinstance(leaf_modules, Sequence):
        raise ConfigError(f"leaf_modules must be a list of nn.Module classes; got {leaf_modules!r}.")
    bad = [m for m in leaf_modules if not (isinstance(m, type) and issubclass(m, nn.Module))]
    if bad:
        raise ConfigError(
            f"leaf_modules must hold nn.Module classes (e.g. [MyAttention]), not {bad!r}: tracing keeps "
            "modules of these classes as single calls instead of tracing through them."
        )


def analysis_copy(model: nn.Module, copy_tensors: bool = False) -> nn.Module:
    """A copy of ``model`` to analyse: tracing and loading may change a module, the caller's never.

    Tracing runs the model's Python code with symbolic values, and that code may keep them: LeViT's
    attention caches its position biases per device in a dict, and a trace would leave fx Proxies
    there; loading puts a module in eval mode. The copy has its own modules and Python state but
    shares the parameter and buffer tensors (no memory for the weights, which nothing here
    writes), unless ``copy_tensors`` (a checkpoint is about to be loaded into it).
    """
    if copy_tensors:
        return copy.deepcopy(model)
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared)


def trace_and_annotate(
    model: nn.Module, input_shape: Sequence[int], leaf_modules: Sequence[type[nn.Module]] = ()
) -> fx.GraphModule:
    """The traced graph module of ``model``, each node annotated with its shape (TRACE_SHAPES)."""
    job = Job(source=model, input_shape=tuple(input_shape), leaf_modules=leaf_modules)
    return TRACE_SHAPES.run(job).gm


def analyze_graph(gm: fx.GraphModule, name: str, input_shape: Sequence[int]) -> Plan:
    """Blocks and runs of an already traced and annotated graph module (ANALYZE_GRAPH)."""
    return ANALYZE_GRAPH.run(Job(gm=gm, name=name, input_shape=tuple(input_shape))).plan


def analyze(
    model: str | nn.Module,
    input_size: Sequence[int] | None = None,
    *,
    leaf_modules: Sequence[type[nn.Module]] = (),
    **load_kwargs,
) -> Plan:
    """Trace ``model`` (a module, timm name or checkpoint path) and return its residual Plan.

    ``input_size`` is ``(N, C, H, W)`` or ``(C, H, W)``; by default the model's pretrained config.
    A module is never changed: it is analysed as a copy (see :func:`analysis_copy`).
    """
    validate_leaf_modules(leaf_modules)
    if isinstance(model, nn.Module):
        model = analysis_copy(model, copy_tensors=load_kwargs.get("checkpoint") is not None)
    module, name = resolve_model(model, **load_kwargs)
    shape = input_shape_for(module, input_size)
    job = Job(source=module, name=name, input_shape=shape, leaf_modules=leaf_modules)
    with torch.no_grad():
        return ANALYZE.run(job).plan
