"""Record and replay the random draws of a graph run, node by node.

A memory-saving backward re-runs steps that drew random numbers in forward (DropPath in train
mode). Forward notes the RNG state before every graph node that drew; a re-run restores it
before the node of the same name, so the re-run sees the same masks. Graphs name their nodes
after the template node and the field evaluation, so a forward run and a re-run of the same
evaluation (even in another graph) match by name.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx

__all__ = ["Generators", "RngState", "Tape", "record", "replay"]

RngState = tuple[torch.Tensor, torch.Tensor | None]
Tape = dict[str, RngState]


class Generators:
    """The generators a stage's random ops draw from: the CPU one, plus x's GPU when x is on one."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None

    def get(self) -> RngState:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.cuda) if self.cuda else None

    def set(self, state: RngState) -> None:
        torch.set_rng_state(state[0])
        if self.cuda is not None:
            torch.cuda.set_rng_state(state[1], self.cuda)


def _same(a: RngState, b: RngState) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


_DRAWS: weakref.WeakSet[fx.GraphModule] = weakref.WeakSet()  # graphs seen drawing random numbers


def record(graph: fx.GraphModule, args: tuple[torch.Tensor, ...], rng: Generators) -> tuple[Any, Tape]:
    """Run ``graph``, noting the RNG state before each node that drew random numbers.

    Recording goes node by node, so a graph runs whole first; only if it moved the RNG does it
    run again, recording, from the same state (and is recorded straight away from then on).
    """
    if graph not in _DRAWS:
        before = rng.get()
        out = graph(*args)
        if _same(rng.get(), before):
            return out, {}
        rng.set(before)
        _DRAWS.add(graph)
    recorder = _Recorder(graph, rng)
    return recorder.run(*args), recorder.tape


def replay(graph: fx.GraphModule, args: tuple[torch.Tensor, ...], tape: Tape, rng: Generators) -> Any:
    """Run ``graph``, restoring the RNG state ``tape`` noted before each drawing node."""
    return graph(*args) if not tape else _Replay(graph, tape, rng).run(*args)


class _Recorder(fx.Interpreter):
    def __init__(self, graph: fx.GraphModule, rng: Generators) -> None:
        super().__init__(graph)
        self.rng, self.tape, self.last = rng, {}, rng.get()

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        now = self.rng.get()
        if not _same(now, self.last):
            self.tape[n.name], self.last = self.last, now
        return out


class _Replay(fx.Interpreter):
    def __init__(self, graph: fx.GraphModule, tape: Tape, rng: Generators) -> None:
        super().__init__(graph)
        self.tape, self.rng = tape, rng

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.tape:
            self.rng.set(self.tape[n.name])
        return super().run_node(n)
