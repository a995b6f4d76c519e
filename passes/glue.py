"""Layout glue inside a run's periods, as its sub-fields see it (Swin's reshapes between the halves).

A period-p run whose sub-blocks are joined by glue (parameter-free layout nodes, ``Run.glue``)
lifts to a split stage whose *state* is the tensor that flows between periods: the first
sub-block's input. Sub-block i of a period reads the state through the glue before it,
``M_i = G_{i-1} o ... o G_0`` (``G_j`` is the glue after sub-block j; Swin: the reshape from
``(B, H, W, C)`` to tokens ``(B, H*W, C)`` before each MLP half), so its sub-field is

    F_i(t, x) = M_i^-1(f_i(t, M_i(x))),

a same-shape update of the state. ``M_i^-1`` is the glue after the sub-block, up to where the
layout is the state's again: when one period's glue brings the state back to its layout
(``G_{p-1} o ... o G_0`` is the identity), ``G_{k-1} o ... o G_i`` is ``M_i``'s inverse for the
first ``k > i`` with ``M_k`` the identity. Glue only moves entries, so
``x + M^-1(f(M x)) = M^-1(M x + f(M x))`` entry for entry: at native depth the split stage is the
network bit for bit. A sub-block that already sees the state's layout (``M_i`` the identity: Swin's
shifted attention, after a reshape to tokens and back) needs no glue.

Whether a composition of glue is the identity is decided by running it on ``arange`` over the
state's traced shape (layout nodes are data-independent permutations of the entries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from odeify.ir.plan import Run
from odeify.passes.graph_utils import data_nodes, shape_nodes

__all__ = ["FieldGlue", "GlueError", "field_glues", "replay_layout", "run_end", "run_members"]


class GlueError(Exception):
    """A run's glue cannot be read as a map of the stage state (the run stays discrete, with why)."""


@dataclass(frozen=True)
class Segment:
    """One sub-block's place in a period: its input ``state``, its output ``source``, and the layout
    chain ``nodes`` from there to the next sub-block's input."""

    state: fx.Node
    source: fx.Node
    nodes: tuple[fx.Node, ...]


@dataclass(frozen=True)
class FieldGlue:
    """What one sub-field's template applies around its sub-block, per period (all periods alike).

    ``states[k]`` are the nodes of period k that hold the state in its layout: the inputs of its
    sub-blocks with ``M_j`` the identity (the first one's, and Swin's second block's, whose shape
    its glue reads); ``into[k]`` the segments from there to this sub-block's input (``M_i``),
    ``back[k]`` those from its output back to the state's layout (``M_i^-1``). Both empty: the
    sub-block sees the state's layout as it is.
    """

    states: tuple[tuple[fx.Node, ...], ...]
    into: tuple[tuple[Segment, ...], ...]
    back: tuple[tuple[Segment, ...], ...]

    @property
    def empty(self) -> bool:
        return not any(self.into) and not any(self.back)


def field_glues(gm: fx.GraphModule, run: Run) -> list[FieldGlue]:
    """The glue of each of ``run``'s p sub-fields (a :class:`FieldGlue` per sub-field, in order).

    Raises :class:`GlueError` when one period's glue does not bring the state back to its layout,
    or when the run ends in another layout than its state's.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    p = run.period
    segments = _segments(run, nodes)
    periods = [segments[k : k + p] for k in range(0, len(segments), p)]
    identity = _identity_layouts(periods[0], nodes[run.blocks[0].fork], gm)
    if not identity[p]:
        names = ", ".join(n.name for segment in periods[0] for n in segment.nodes)
        raise GlueError(
            f"one period's glue ({names}) does not bring the state back to its layout, so a sub-field "
            "cannot map the stage state to a same-shape update"
        )
    if not identity[p - 1] and not periods[-1][-1].nodes and periods[0][-1].nodes:
        names = ", ".join(n.name for n in periods[0][-1].nodes)
        raise GlueError(
            f"the run's last period does not end in its glue ({names}), so the run would leave in "
            "another layout than its state's"
        )
    states = tuple(tuple(period[j].state for j in range(p) if identity[j]) for period in periods)
    glues = []
    for i in range(p):
        start = max(j for j in range(i + 1) if identity[j])  # i itself when M_i is the identity
        stop = min(k for k in range(i + 1, p + 1) if identity[k])
        into = tuple(tuple(period[start:i]) for period in periods)
        back = tuple(tuple(period[i:stop]) if start < i else () for period in periods)
        glues.append(FieldGlue(states, into, back))
    return glues


def run_end(run: Run, nodes: dict[str, fx.Node]) -> fx.Node:
    """The node a run's value leaves by: its last sub-block's output, or the glue that follows it."""
    glue = set(run.glue)
    node = nodes[run.blocks[-1].output]
    while (follower := _glue_user(node, glue)) is not None:
        node = follower
    return node


def run_members(gm: fx.GraphModule, run: Run, members: set[str]) -> set[str]:
    """``members`` (a run's block nodes) with its glue and the shape reads of them (``x.shape[0]``).

    Shape reads of the run's last value belong to whatever follows the run (Swin's patch merging).
    """
    if not run.glue:
        return members
    graph = gm.graph
    reads = shape_nodes(graph, data_nodes(graph))
    found = set(members) | set(run.glue)
    sources = found - {run_end(run, {n.name: n for n in graph.nodes}).name}
    for node in graph.nodes:
        if node.name in reads and any(inp.name in sources for inp in node.all_input_nodes):
            found.add(node.name)
            sources.add(node.name)
    return found


def _segments(run: Run, nodes: dict[str, fx.Node]) -> list[Segment]:
    """The glue after each block of ``run``, checked to lead to the next block's input."""
    glue = set(run.glue)
    segments, seen = [], 0
    for j, block in enumerate(run.blocks):
        chain, node = [], nodes[block.output]
        while (follower := _glue_user(node, glue)) is not None:
            chain.append(follower)
            node = follower
        if j + 1 < len(run.blocks) and node.name != run.blocks[j + 1].fork:
            raise GlueError(f"the glue after '{block.output}' does not lead to the next sub-block's input")
        segments.append(Segment(nodes[block.fork], nodes[block.output], tuple(chain)))
        seen += len(chain)
    if seen != len(glue):
        raise GlueError(f"the glue of run '{run.name}' is not a chain between its sub-blocks")
    return segments


def _glue_user(node: fx.Node, glue: set[str]) -> fx.Node | None:
    """The glue node that reads ``node``'s value, if any (glue is a chain: at most one)."""
    return next((user for user in node.users if user.name in glue), None)


def _identity_layouts(period: Sequence[Segment], state: fx.Node, gm: fx.GraphModule) -> list[bool]:
    """``[M_0 is the identity, ..., M_p is the identity]`` for one period, run on ``arange``."""
    shape = state.meta.get("tensor_meta")
    if shape is None:
        raise GlueError(f"the run's input '{state.name}' has no traced shape to check its glue on")
    start = torch.arange(shape.shape.numel(), dtype=torch.float64).reshape(shape.shape)
    data = data_nodes(gm.graph)
    env: dict[fx.Node, object] = {state: start}
    value, identity = start, [True]
    for segment in period:
        env[segment.source] = value
        for node in segment.nodes:
            env[node] = replay_layout(node, env, data)
        value = env[segment.nodes[-1]] if segment.nodes else value
        identity.append(value.shape == start.shape and torch.equal(value, start))
    return identity


def _evaluate(node: fx.Node, env: dict[fx.Node, object], data: set[str]) -> object:
    """An argument of a glue node: a value in ``env``, or a shape read computed on it (``x.shape[0]``)."""
    if node in env:
        return env[node]
    if node.op not in ("call_function", "call_method") or node.name in data:
        raise GlueError(f"the glue reads '{node.name}', which is neither the state, glue nor a shape read")
    env[node] = replay_layout(node, env, data)
    return env[node]


def replay_layout(node: fx.Node, env: dict[fx.Node, object], data: set[str]) -> object:
    """Run one glue node or shape read on the values its arguments have in ``env``."""
    args = fx.map_arg(node.args, lambda n: _evaluate(n, env, data))
    kwargs = fx.map_arg(node.kwargs, lambda n: _evaluate(n, env, data))
    try:
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    except (RuntimeError, TypeError, ValueError) as why:
        raise GlueError(f"the glue node '{node.name}' fails on the state's traced shape: {why}") from why
