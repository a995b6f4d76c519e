"""Read-only census of a traced graph's adds: which became residual blocks, and why each other did not.

A refusal that says "the graph has no residual add" must be true: DPN and ReXNet have many adds of
two same-shape, batch-computed tensors, on channel slices of wider tensors; HRNet has identity
blocks that lie inside one wide block's branch. :func:`add_census` sorts every live add of two
tensors into the classes below, from the graph (with ``tensor_meta``) and the blocks
:func:`~odeify.passes.residual_blocks.find_blocks` returned; :meth:`AddCensus.describe` says it in
a sentence. It changes nothing, so a refusal can run it after the analysis has failed.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx
import torch.fx as fx

from odeify.ir.plan import Block
from odeify.passes.graph_utils import data_graph, data_nodes, identity_sources, is_add_join, live_nodes
from odeify.passes.tracing import node_shape

__all__ = ["AddCensus", "NestedAdds", "add_census"]


@dataclass(frozen=True)
class NestedAdds:
    """The same-shape adds inside one found block's branch, which the outer block keeps as its own."""

    block: Block
    adds: tuple[str, ...]
    x_plus_f: int
    """How many of them add a tensor to the input they are computed from (x + f(x)), as identity blocks do."""


@dataclass(frozen=True)
class AddCensus:
    """Every live add of two tensors in a graph, sorted by what it is (node names in graph order)."""

    adds: int
    """Adds of two tensors that reach the output."""
    not_residual: tuple[str, ...]
    """Broadcast adds and adds of a tensor not computed from the batch (biases, position embeddings)."""
    blocks: tuple[Block, ...]
    """The blocks found (their joins are same-shape adds of batch-computed tensors)."""
    nested: tuple[NestedAdds, ...]
    partial_channel: tuple[str, ...]
    """Adds with a side that is a slice of a wider tensor (ReXNet's ``x[:, :C] + shortcut``, DPN)."""
    tuple_item: tuple[str, ...]
    """Adds with a side that is one item of a module's or function's tuple result."""
    no_fork: tuple[str, ...]
    """Adds whose two sides part at a tuple (Res2Net's split), not at one tensor."""
    open_region: tuple[str, ...] = field(default=())
    """Adds whose sides close no single-entry, single-exit region (a tensor between is read elsewhere)."""

    @property
    def residual(self) -> int:
        """Adds of two same-shape tensors, both computed from the batch: what a residual join is."""
        return self.adds - len(self.not_residual)

    def describe(self) -> str:
        """What the graph's adds are, in one clause, for a graph with no identity block."""
        if self.adds == 0:
            return "the graph has no residual add"
        if self.residual == 0:
            return (
                f"none of the graph's {_count(self.adds, 'add')} is a residual add of two same-shape "
                "tensors computed from the input: each is a broadcast add or adds a tensor not computed "
                "from the input (a bias, a position embedding)"
            )
        kinds = Counter(block.kind for block in self.blocks)
        became = "none became a block"
        if self.blocks:
            listed = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
            noun = "a block" if len(self.blocks) == 1 else "blocks"
            became = f"{len(self.blocks)} became {noun} ({listed}), none an identity block"
        parts = [
            f"the trace has {_count(self.residual, 'add')} of two same-shape tensors computed from the "
            f"input; {became}"
        ]
        for nested in self.nested:
            block = nested.block
            of_form = f", {nested.x_plus_f} of them of the form x + f(x)" if nested.x_plus_f else ""
            parts.append(
                f"{len(nested.adds)} lie inside the branch of the {block.kind} block that joins at "
                f"'{block.join}' (from '{block.fork}', {len(block.nodes)} nodes, module scope "
                f"'{block.scope or '<root>'}'){of_form}: odeify reads that whole region as one block, "
                "so they are not blocks of their own"
            )
        if self.partial_channel:
            parts.append(
                f"{_count(len(self.partial_channel), 'add')} on a channel slice of a wider tensor "
                f"(x[:, :C] + y, e.g. node '{self.partial_channel[0]}'): partial-channel adds, whose two "
                "sides are not a block's input and output, so not identity blocks"
            )
        if self.tuple_item:
            parts.append(
                f"{_count(len(self.tuple_item), 'add')} with a side that is one item of a tuple result "
                f"(e.g. node '{self.tuple_item[0]}'): the block's input is not one tensor, so not identity "
                "blocks"
            )
        if self.no_fork:
            parts.append(
                f"{_count(len(self.no_fork), 'add')} whose two sides start from no single tensor: they "
                f"part at a tuple, such as a split's (e.g. node '{self.no_fork[0]}')"
            )
        if self.open_region:
            parts.append(
                f"{_count(len(self.open_region), 'add')} whose sides do not close a region with one "
                "input and one output (a tensor in between is also read elsewhere, e.g. node "
                f"'{self.open_region[0]}')"
            )
        return "; ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def add_census(gm: fx.GraphModule, blocks: Sequence[Block]) -> AddCensus:
    """Sort the live adds of two tensors in ``gm`` (annotated with shapes) given the blocks found in it."""
    graph = gm.graph
    data = data_nodes(graph)
    live = live_nodes(graph)
    idom = nx.immediate_dominators(data_graph(graph, data), "__root__")
    nodes = {n.name: n for n in graph.nodes}
    modules = dict(gm.named_modules())
    joins = {block.join for block in blocks}
    adds = [n for n in graph.nodes if is_add_join(n) and n.name in live]
    sorted_into: dict[str, list[str]] = {
        key: [] for key in ("not_residual", "partial", "tuple", "no_fork", "open")
    }
    nested: dict[int, list[fx.Node]] = {}
    for add in adds:
        operands = [a for a in add.args if isinstance(a, fx.Node)]
        shape = node_shape(add)
        if shape is None or any(node_shape(a) != shape or a.name not in data for a in operands):
            sorted_into["not_residual"].append(add.name)
        elif add.name in joins:
            continue
        elif (outer := next((b for b in blocks if add.name in b.nodes), None)) is not None:
            nested.setdefault(outer.index, []).append(add)
        elif any(_is_slice_of_wider(a) for a in operands):
            sorted_into["partial"].append(add.name)
        elif any(_is_tuple_item(a) for a in operands):
            sorted_into["tuple"].append(add.name)
        elif (fork := nodes.get(idom.get(add.name, "__root__"))) is None or node_shape(fork) is None:
            sorted_into["no_fork"].append(add.name)
        else:
            sorted_into["open"].append(add.name)
    by_index = {block.index: block for block in blocks}
    return AddCensus(
        adds=len(adds),
        not_residual=tuple(sorted_into["not_residual"]),
        blocks=tuple(blocks),
        nested=tuple(
            NestedAdds(by_index[i], tuple(a.name for a in inside), _x_plus_f(inside, idom, nodes, modules))
            for i, inside in sorted(nested.items())
        ),
        partial_channel=tuple(sorted_into["partial"]),
        tuple_item=tuple(sorted_into["tuple"]),
        no_fork=tuple(sorted_into["no_fork"]),
        open_region=tuple(sorted_into["open"]),
    )


def _x_plus_f(adds: list[fx.Node], idom: dict[str, str], nodes: dict[str, fx.Node], modules: dict) -> int:
    """How many of ``adds`` have a side that is (an identity of) the tensor dominating the add."""
    count = 0
    for add in adds:
        fork = nodes.get(idom.get(add.name, "__root__"))
        operands = [a for a in add.args if isinstance(a, fx.Node)]
        count += fork is not None and any(fork in identity_sources(a, modules) for a in operands)
    return count


def _is_getitem(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and len(node.args) == 2
        and isinstance(node.args[0], fx.Node)
    )


def _is_slice_of_wider(node: fx.Node) -> bool:
    """``t[..., a:b, ...]`` of a tensor with another shape than the slice."""
    if not _is_getitem(node):
        return False
    whole, index = node_shape(node.args[0]), node.args[1]
    slices = index if isinstance(index, tuple) else (index,)
    return whole is not None and whole != node_shape(node) and any(isinstance(s, slice) for s in slices)


def _is_tuple_item(node: fx.Node) -> bool:
    """``r[i]`` of a result that is not one tensor (a tuple or list of tensors)."""
    return _is_getitem(node) and node_shape(node.args[0]) is None and isinstance(node.args[1], int)
