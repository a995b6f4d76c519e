"""Record and replay the random draws of a graph run, node by node.

A memory-saving backward re-runs steps that drew random numbers in forward (DropPath in train
mode). Forward notes the RNG state before every graph node that drew; a re-run restores it
before the node of the same name, so the re-run sees the same masks. Graphs name their nodes
after the template node and the field evaluation, so a forward run and a re-run of the same
evaluation (even in another graph) match by name.

Which nodes draw is found once per graph, by a run that compares the RNG state after every node
(:class:`_Discovery`). From then on a graph runs as generated code, in a copy with a note inserted
before and after each drawing node (:func:`_noting`): two RNG reads per drawing node instead of a
read and a compare per node of an interpreted run (swin_tiny, batch 8, one thread: its reversible
step with timm's DropPath 4.35 s, as without DropPath, 4.36 s; the interpreted run cost 2-3%). A
copy that sees the stream move between its notes (a node that did not draw before draws now) is run
again from the same state by the discovery run, which then names the drawing nodes anew.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
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


_DRAWING: weakref.WeakKeyDictionary[fx.GraphModule, frozenset[str]] = weakref.WeakKeyDictionary()
"""The nodes of each graph seen drawing random numbers (a graph that never drew is not here)."""

_COPIES: weakref.WeakKeyDictionary[fx.GraphModule, dict[tuple, fx.GraphModule]] = weakref.WeakKeyDictionary()
"""Each graph's copies with notes inserted, by (what the notes do, the nodes they surround)."""


def record(graph: fx.GraphModule, args: tuple[torch.Tensor, ...], rng: Generators) -> tuple[Any, Tape]:
    """Run ``graph``, noting the RNG state before each node that drew random numbers.

    A graph not seen drawing runs whole first; only if it moved the RNG does it run again, from
    the same state, to find the nodes that drew.
    """
    before = rng.get()
    drawing = _DRAWING.get(graph)
    if drawing is None:
        out = graph(*args)
        if _same(rng.get(), before):
            return out, {}
    else:
        notes = _Recording(rng)
        out = _run_noting(graph, "record", drawing, notes, args)
        if notes.consistent:
            return out, notes.tape
    rng.set(before)
    discovery = _Discovery(graph, rng)
    out = discovery.run(*args)
    _DRAWING[graph] = frozenset(discovery.tape)
    return out, discovery.tape


def replay(graph: fx.GraphModule, args: tuple[torch.Tensor, ...], tape: Tape, rng: Generators) -> Any:
    """Run ``graph``, restoring the RNG state ``tape`` noted before each drawing node."""
    if not tape:
        return graph(*args)
    return _run_noting(graph, "replay", frozenset(tape), _Replaying(rng, tape), args)


class _Recording:
    """A recording copy's notes: the state before each drawing node, and whether anything else drew."""

    def __init__(self, rng: Generators) -> None:
        self.rng, self.tape = rng, {}
        self.last: RngState | None = None
        self.consistent = True

    def before(self, name: str) -> None:
        now = self.rng.get()
        if self.last is not None and not _same(now, self.last):
            self.consistent = False  # a node between two drawing nodes drew
        self.tape[name] = now

    def after(self, name: str) -> None:
        self.last = self.rng.get()
        if _same(self.last, self.tape[name]):
            del self.tape[name]  # it drew nothing this time: nothing to replay

    def end(self) -> None:
        if self.last is not None and not _same(self.rng.get(), self.last):
            self.consistent = False  # a node after the last drawing node drew


class _Replaying:
    """A replaying copy's notes: the RNG set to the tape's state before each node it names."""

    def __init__(self, rng: Generators, tape: Tape) -> None:
        self.rng, self.tape = rng, tape

    def before(self, name: str) -> None:
        self.rng.set(self.tape[name])

    def after(self, name: str) -> None:
        pass

    def end(self) -> None:
        pass


_ACTIVE: ContextVar[_Recording | _Replaying] = ContextVar("odeify_rng_notes")


def _note_before(name: str) -> None:
    _ACTIVE.get().before(name)


def _note_after(name: str) -> None:
    _ACTIVE.get().after(name)


def _run_noting(
    graph: fx.GraphModule, kind: str, names: frozenset[str], notes: _Recording | _Replaying, args: tuple
) -> Any:
    copies = _COPIES.setdefault(graph, {})
    key = (kind, names)
    if key not in copies:
        copies[key] = _noting(graph, names, after=kind == "record")
    token = _ACTIVE.set(notes)
    try:
        out = copies[key](*args)
    finally:
        _ACTIVE.reset(token)
    notes.end()
    return out


def _noting(graph: fx.GraphModule, names: frozenset[str], after: bool) -> fx.GraphModule:
    """A copy of ``graph`` calling :func:`_note_before` before each of its nodes named in ``names``
    (and :func:`_note_after` after it when ``after``); it shares the original's modules and parameters."""
    copy = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.graph.nodes:
        if node.name in names:
            copy.call_function(_note_before, (node.name,))
        env[node] = copy.node_copy(node, env.__getitem__)
        if after and node.name in names:
            copy.call_function(_note_after, (node.name,))
    return fx.GraphModule(graph, copy)


class _Discovery(fx.Interpreter):
    """An interpreted run that compares the RNG state after every node, noting the nodes that drew."""

    def __init__(self, graph: fx.GraphModule, rng: Generators) -> None:
        super().__init__(graph)
        self.rng, self.tape, self.last = rng, {}, rng.get()

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        now = self.rng.get()
        if not _same(now, self.last):
            self.tape[n.name], self.last = self.last, now
        return out
