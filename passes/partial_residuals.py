"""Transformation pass: a residual add on part of a tensor becomes an add on the whole of it.

CoaT's conv position encoding updates a stream's image tokens and passes its class token through:

    cls, img = x[:, :1], x[:, 1:]
    out = cat((cls, L'(conv(L(img)) + L(img))), dim=1)     # L: tokens -> (B, C, H, W), L' back

It is no residual block of the stream (its add is on a slice, in another layout), and no layout
glue either, so the attention and MLP blocks around it never chained into a run. It computes
exactly

    out = x + pad(L'(conv(L(img))))                          # zeros where the class token is

(the class token plus zero is itself; each image entry is the same one sum, moved), a block of the
stream. The pass rewrites every such concatenation so: the blocks of a CoaT stage then form one run
of period 3 (position encoding, attention, MLP), a deep stage. Its field at another depth updates
the image tokens alone, as the source's does.

The match: ``cat((x[<slice k along d>], L'(u + L(x[<the rest along d>]))), d)`` (either order), where
``L'`` and ``L`` are chains of layout nodes (:data:`~odeify.passes.periods.LAYOUT_OPS`), ``L' o L`` is
the identity (checked by running both on ``arange`` over the slice's traced shape), the add's two
sides have one shape, ``u`` is computed from ``x`` (so the result is a residual of ``x``), and nothing
else reads the add or ``L'``'s nodes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from odeify.passes.contract import PassResult, graph_pass, transformation
from odeify.passes.glue import GlueError, replay_layout
from odeify.passes.graph_utils import data_nodes, is_add_join
from odeify.passes.periods import layout_source
from odeify.passes.properties import BLOCKS, RUNS, SHAPES
from odeify.passes.tracing import node_shape

__all__ = ["WHOLE_RESIDUALS", "whole_residuals"]

WHOLE_RESIDUALS = transformation(
    "whole_residuals",
    requires={SHAPES},
    ensures={SHAPES},
    invalidates={BLOCKS, RUNS},  # the erased concatenations may be named by block tags
)


@dataclass(frozen=True)
class _PartialResidual:
    """One match: ``cat`` joins ``kept`` (a slice of ``whole``) and ``back`` applied to ``join``."""

    cat: fx.Node
    whole: fx.Node
    join: fx.Node
    update: fx.Node
    back: tuple[fx.Node, ...]
    dim: int
    before: int
    after: int


@graph_pass(WHOLE_RESIDUALS)
def whole_residuals(gm: fx.GraphModule) -> PassResult:
    """Rewrite each residual add on part of a tensor, concatenated back, as an add on the whole."""
    data = data_nodes(gm.graph)
    matches = [m for node in list(gm.graph.nodes) if (m := _match(node, data)) is not None]
    for match in matches:
        _rewrite(gm.graph, match)
    if matches:
        gm.recompile()
    return PassResult(gm, bool(matches))


def _match(cat: fx.Node, data: set[str]) -> _PartialResidual | None:
    """The partial residual ``cat`` concatenates, or None."""
    parts, dim = _cat_parts(cat)
    if parts is None or len(parts) != 2:
        return None
    for kept, updated in (parts, parts[::-1]):
        match = _match_order(cat, kept, updated, dim, data)
        if match is not None:
            return match
    return None


def _match_order(
    cat: fx.Node, kept: fx.Node, updated: fx.Node, dim: int, data: set[str]
) -> _PartialResidual | None:
    """The match with ``kept`` passed through and ``updated`` the slice the add changed, or None."""
    whole, kept_range = _slice_along(kept, dim)
    back = _layout_chain(updated, data)
    join = layout_source(back[0], data) if back else updated
    if whole is None or not is_add_join(join) or any(len(n.users) != 1 for n in (join, *back[:-1])):
        return None
    shape = node_shape(join)
    if shape is None or any(node_shape(side) != shape for side in join.args):
        return None
    kept_first = kept is cat.args[0][0]
    for update, side in (join.args, join.args[::-1]):
        into = _layout_chain(side, data)
        start = layout_source(into[0], data) if into else side
        source, rest = _slice_along(start, dim)
        if source is not whole or not _complementary(kept_range, rest, node_shape(whole)[dim], kept_first):
            continue
        if not _reads(update, whole, data) or not _round_trip(whole, start, into, join, back, data):
            continue
        width = kept_range[1] - kept_range[0]
        return _PartialResidual(
            cat, whole, join, update, back, dim, width * kept_first, width * (not kept_first)
        )
    return None


def _cat_parts(cat: fx.Node) -> tuple[tuple[fx.Node, ...] | None, int]:
    """The tensors ``cat`` concatenates and its dimension (non-negative), or (None, 0)."""
    if cat.op != "call_function" or cat.target not in (torch.cat, torch.concat) or not cat.args:
        return None, 0
    parts = cat.args[0]
    dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    shape = node_shape(cat)
    if shape is None or not isinstance(dim, int) or not isinstance(parts, (list, tuple)):
        return None, 0
    if not all(isinstance(p, fx.Node) for p in parts):
        return None, 0
    return tuple(parts), dim % len(shape)


def _slice_along(node: fx.Node, dim: int) -> tuple[fx.Node | None, tuple[int, int] | None]:
    """``(x, (start, stop))`` when ``node`` is ``x[..., start:stop, ...]`` sliced along ``dim`` alone."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return None, None
    whole, index = node.args
    shape = node_shape(whole) if isinstance(whole, fx.Node) else None
    index = index if isinstance(index, tuple) else (index,)
    if shape is None or len(index) > len(shape) or dim >= len(index):
        return None, None
    if not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
        return None, None
    if any(i != slice(None) for k, i in enumerate(index) if k != dim):
        return None, None
    start, stop, _ = index[dim].indices(shape[dim])
    return whole, (start, stop)


def _complementary(kept: tuple[int, int], rest: tuple[int, int] | None, size: int, kept_first: bool) -> bool:
    """``kept`` and ``rest`` split ``[0, size)`` in the concatenation's order, neither empty."""
    if rest is None:
        return False
    first, second = (kept, rest) if kept_first else (rest, kept)
    return first[0] == 0 and first[1] == second[0] and second[1] == size and 0 < first[1] < size


def _reads(node: fx.Node, source: fx.Node, data: set[str]) -> bool:
    """``node``'s value is computed from ``source``'s: ``whole + pad(u)`` is then a residual of ``whole``
    (ReXNet's channel-slice add, a slice of a block's output plus the block's input, is not one)."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current is source:
            return True
        seen.add(current)
        stack.extend(i for i in current.all_input_nodes if i.name in data and i not in seen)
    return False


def _layout_chain(node: fx.Node, data: set[str]) -> tuple[fx.Node, ...]:
    """The layout nodes ending at ``node``, first to last, each reading the one before."""
    chain: list[fx.Node] = []
    while (source := layout_source(node, data)) is not None:
        chain.append(node)
        node = source
    return tuple(reversed(chain))


def _round_trip(
    whole: fx.Node,
    start: fx.Node,
    into: tuple[fx.Node, ...],
    join: fx.Node,
    back: tuple[fx.Node, ...],
    data: set[str],
) -> bool:
    """``back o into`` is the identity on the slice ``start`` of ``whole``, run on ``arange`` over
    ``whole``'s traced shape (the layout nodes may read its shape)."""
    shape = node_shape(whole)
    if shape is None:
        return False
    env: dict[fx.Node, object] = {
        whole: torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    }
    try:
        env[start] = replay_layout(start, env, data)
        for node in into:
            env[node] = replay_layout(node, env, data)
        env[join] = env[into[-1]] if into else env[start]
        for node in back:
            env[node] = replay_layout(node, env, data)
    except GlueError:
        return False
    result, sliced = env[back[-1]] if back else env[join], env[start]
    return isinstance(result, torch.Tensor) and result.shape == sliced.shape and torch.equal(result, sliced)


def _rewrite(graph: fx.Graph, match: _PartialResidual) -> None:
    """``cat(kept, L'(u + v))`` -> ``whole + pad(L'(u))``; the old nodes go where nothing else reads them."""
    cat = match.cat
    rank = len(node_shape(cat))
    widths = (0, 0) * (rank - 1 - match.dim) + (match.before, match.after)
    copies: dict[fx.Node, fx.Node] = {match.join: match.update}
    with graph.inserting_before(cat):
        for node in match.back:
            copies[node] = graph.node_copy(node, lambda arg: copies.get(arg, arg))
            copies[node].meta["tensor_meta"] = node.meta.get("tensor_meta")
        padded = graph.call_function(F.pad, (copies[match.back[-1]] if match.back else match.update, widths))
        whole = graph.call_function(operator.add, (match.whole, padded))
    for node in (padded, whole):
        node.meta["tensor_meta"] = cat.meta.get("tensor_meta")
    old = [cat, *reversed(match.back), match.join, *cat.args[0]]
    cat.replace_all_uses_with(whole)
    erased: set[fx.Node] = set()
    for node in old:
        if not node.users and node not in erased:
            graph.erase_node(node)
            erased.add(node)
