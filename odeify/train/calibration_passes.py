"""Calibration's passes without gradients: each stage called as a module, the activations taken at
stages by hooks within a memory budget, the graph between two stages, and the sizes of the passes."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn

from odeify.compiler.conversion import converted_stages, retarget
from odeify.runtime.stage import ODEStage
from odeify.train.calibration_store import MIB, Budget, Rows
from odeify.train.network_tail import graph_from

__all__ = [
    "Next",
    "Onward",
    "Stop",
    "activations",
    "chunk_size",
    "constants",
    "memory_line",
    "segment_between",
    "stage_paths",
    "with_stage_calls",
]

WORKING_SET = 4
"""Activations of one image alive at once in a forward pass without gradients, in units of the
largest one (an input, its output, a shortcut, the allocator's slack): sizes the passes' chunks."""


def with_stage_calls(model: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``model`` whose graph calls each stage as a module (``checkpoint`` stages), so that a
    hook sees the stage's input and output; the same function as ``model``."""
    return retarget(model, backward={s.stage_name: "checkpoint" for s in converted_stages(model)})


def stage_paths(model: nn.Module) -> dict[str, str]:
    """Each stage's module path, by stage name, in graph order."""
    paths = {id(m): path for path, m in model.named_modules() if isinstance(m, ODEStage)}
    return {s.stage_name: paths[id(s)] for s in converted_stages(model)}


class Stop(Exception):
    """Raised by a hook once the activations wanted are taken: the rest of the forward is not needed."""


@torch.no_grad()
def activations(
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
                raise Stop

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
            except Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return taken, (torch.cat(outputs) if output else None)


def segment_between(model: fx.GraphModule, path: str, following: str) -> fx.GraphModule | None:
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


class Onward:
    """What the next stage's inputs are taken with: the graph from the stage's output to them
    (:func:`segment_between`; None: not taken), and the budget they are held in."""

    def __init__(self, segment: fx.GraphModule | None, budget: Budget) -> None:
        self.segment, self.budget = segment, budget

    def rows(self, n: int) -> Next:
        return Next(self, n)


class Next:
    """The next stage's inputs at one depth, taken batch by batch from the stage's outputs."""

    def __init__(self, onward: Onward, n: int) -> None:
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


def constants(work: fx.GraphModule, path: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The constant inputs the stage at ``path`` is called with (a rotary ViT's position table), taken
    from a pass of one image: they depend on the images' size, not on the images."""
    if not work.get_submodule(path).inputs:
        return ()
    taken: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple) -> None:
        taken.extend(value.detach() for value in args[1:])
        raise Stop

    handle = work.get_submodule(path).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            work(x[:1])
    except Stop:
        pass
    finally:
        handle.remove()
    return tuple(taken)


@torch.no_grad()
def chunk_size(model: nn.Module, x: torch.Tensor, memory: int, batch_size: int) -> int:
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


def memory_line(budget: Budget, chunk: int, images: int) -> str:
    spilled = f"; {budget.spilled / MIB:.1f} MiB of targets in a temporary file" if budget.spilled else ""
    return (
        f"calibration holds at most {budget.nbytes / MIB:g} MiB of activations in memory (memory=), the "
        f"rest in a temporary file{spilled}; passes of {chunk} of the {images} images"
    )
