"""Analysis pass: find residual blocks in a shape-annotated fx graph, from the graph alone.

A block is a *join* (an add of two same-shape tensors) and its *fork*, the join's immediate
dominator among data nodes. The region between them must be single-entry/single-exit, apart from
side chains that never reach the output (``torch._assert``). An add inside another block's branch
is part of that branch, not a block of its own (ConvNeXt-V2's GlobalResponseNorm computes
``x + f(x)`` inside every block). Results go to each node's :class:`odeify.ir.meta.NodeTag`.
"""

from __future__ import annotations

import dataclasses
import operator

import networkx as nx
import torch
import torch.fx as fx

from odeify.ir.meta import tag, untag
from odeify.ir.plan import Block, BlockKind
from odeify.passes.contract import PassResult, analysis, graph_pass
from odeify.passes.graph_utils import (
    activation_of,
    common_prefix,
    data_graph,
    data_nodes,
    identity_sources,
    is_add_join,
    live_nodes,
    node_tensors,
    shape_nodes,
    weight_expressions,
)
from odeify.passes.properties import BLOCKS, SHAPES
from odeify.passes.tracing import node_shape

FIND_BLOCKS = analysis("find_blocks", requires={SHAPES}, ensures={BLOCKS})


@graph_pass(FIND_BLOCKS)
def find_blocks(gm: fx.GraphModule) -> PassResult:
    """Every residual block in ``gm`` (which must carry ``tensor_meta``), in graph order: the ``value``."""
    graph = gm.graph
    data = data_nodes(graph)
    shapes = shape_nodes(graph, data)
    dg = data_graph(graph, data)
    idom = nx.immediate_dominators(dg, "__root__")
    live = live_nodes(graph)
    nodes = {n.name: n for n in graph.nodes}
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    modules = dict(gm.named_modules())

    blocks: list[Block] = []
    for join in graph.nodes:
        if not is_add_join(join) or join.name not in live:
            continue
        out_shape = node_shape(join)
        operands = [a for a in join.args if isinstance(a, fx.Node)]
        if out_shape is None or any(node_shape(a) != out_shape for a in operands):
            continue  # broadcast add (biases, position embeddings): not a block
        if any(a.name not in data for a in operands):
            continue  # a tensor not computed from the batch (a position embedding at batch 1)
        fork = nodes.get(idom.get(join.name, "__root__"))
        if fork is None or node_shape(fork) is None:
            continue  # fork is a tuple (Res2Net's split) or the virtual root
        region = _region(dg, fork.name, join.name)
        expressions = {w.name for name in region for w in weight_expressions(nodes[name], data)}
        expressions -= _side_inputs(region, expressions & shapes, nodes, live, data)
        if not _single_entry_exit(region, expressions & shapes, fork, join, nodes, live, data):
            continue
        region |= expressions
        kind = _shortcut_kind(operands, fork, modules, data)
        output, activation = _closing_activation(join, modules)
        branch = tuple(sorted(region, key=order.__getitem__))
        blocks.append(
            Block(
                index=len(blocks),
                fork=fork.name,
                join=join.name,
                output=output.name,
                kind=kind,
                form="post" if activation or kind == "scaled" else "pre",
                activation=activation,
                in_shape=node_shape(fork),
                out_shape=node_shape(output),
                nodes=branch,
                parameters=_parameter_count(branch, nodes, gm),
                scope=_scope(branch, nodes),
            )
        )
    blocks = _outermost(blocks)
    _annotate(graph, blocks)
    return PassResult(gm, modified=False, value=blocks)


def _outermost(blocks: list[Block]) -> list[Block]:
    """The blocks whose join lies in no other block's branch, renumbered in order.

    A projection block around other blocks gives way to them: HRNet fuses its branches with adds
    whose region spans the identity blocks of every branch, and a projection block stays a discrete
    layer anyway, while the blocks inside can become stages.
    """
    joins = {block.join for block in blocks}
    blocks = [b for b in blocks if b.kind != "projection" or not joins.intersection(b.nodes)]
    inside = {name for block in blocks for name in block.nodes}
    kept = [block for block in blocks if block.join not in inside]
    return [dataclasses.replace(block, index=i) for i, block in enumerate(kept)]


def _region(dg: nx.DiGraph, fork: str, join: str) -> set[str]:
    """Nodes strictly between fork and join: reachable from the fork and reaching the join."""
    return (nx.descendants(dg, fork) & nx.ancestors(dg, join)) - {fork, join}


def _single_entry_exit(
    region: set[str],
    shape_reads: set[str],
    fork: fx.Node,
    join: fx.Node,
    nodes: dict[str, fx.Node],
    live: set[str],
    data: set[str],
) -> bool:
    """No data enters the region but the fork's, and nothing leaves it but through the join.

    ``shape_reads`` are the region's reads of tensor shapes (``B, N, C = h.shape`` in an attention
    branch): part of the block, so their users must be inside it too.
    """
    inside = region | {fork.name}
    for name in region:
        node = nodes[name]
        if any(inp.name not in inside for inp in node.all_input_nodes if inp.name in data):
            return False
    owned = region | shape_reads
    for name in owned:
        for user in nodes[name].users:
            if user.name not in owned and user is not join and user.name in live:
                return False
    return True


def _side_inputs(
    region: set[str],
    shape_reads: set[str],
    nodes: dict[str, fx.Node],
    live: set[str],
    data: set[str],
) -> set[str]:
    """The region's shape expressions that nodes outside the block read too, computed from no shape
    of the block's own nodes: inputs the block reads, not part of it.

    A rotary ViT computes its position table once from the patch grid's shape (``H, W`` of the
    patch embedding) and every attention half reads it: the same for every block, a lifted stage
    takes it as a constant input. SAM's ``B, H, W, C = x.shape`` of a block's input is read again by
    the reshapes after the block: a template reads it on its own ``x``. The expressions such a value
    is computed from go with it. Shape reads of the block's own nodes stay the block's, as before.
    """
    owned = region | shape_reads
    shared = {
        name for name in shape_reads if any(u.name not in owned and u.name in live for u in nodes[name].users)
    }
    side: set[str] = set()
    for name in shared:
        chain = {name} | {w.name for w in weight_expressions(nodes[name], data)}
        reads = {inp.name for c in chain for inp in nodes[c].all_input_nodes if inp.name in data}
        if not reads & region:
            side |= chain
    return side


MUL_TARGETS = {operator.mul, torch.mul}


def _shortcut_kind(operands: list[fx.Node], fork: fx.Node, modules: dict, data: set[str]) -> BlockKind:
    """``identity`` when an operand is the fork (through ``nn.Identity``), ``scaled`` when it is the
    fork times a tensor not computed from the batch (PoolFormerV2's ``res_scale``), else ``projection``."""
    if any(fork in identity_sources(a, modules) for a in operands):
        return "identity"
    for operand in operands:
        is_mul = (operand.op == "call_function" and operand.target in MUL_TARGETS) or (
            operand.op == "call_method" and operand.target == "mul"
        )
        if is_mul and len(operand.args) == 2 and not operand.kwargs:
            on_fork = [isinstance(a, fx.Node) and fork in identity_sources(a, modules) for a in operand.args]
            scale = operand.args[on_fork.index(False)] if on_fork.count(True) == 1 else None
            if isinstance(scale, float) or (isinstance(scale, fx.Node) and scale.name not in data):
                return "scaled"
    return "projection"


def _closing_activation(join: fx.Node, modules: dict) -> tuple[fx.Node, str | None]:
    """The pointwise activation that closes a post-activation block, if the join's only user is one."""
    users = list(join.users)
    if len(users) == 1:
        name = activation_of(users[0], modules)
        if name is not None and users[0].args and users[0].args[0] is join:
            return users[0], name
    return join, None


def _parameter_count(branch: tuple[str, ...], nodes: dict[str, fx.Node], gm: fx.GraphModule) -> int:
    seen: dict[str, int] = {}
    for name in branch:
        node = nodes[name]
        for inp in _own_attributes(node):
            for qualified, tensor in node_tensors(inp, gm):
                if tensor.requires_grad:
                    seen[qualified] = tensor.numel()
    return sum(seen.values())


def _scope(branch: tuple[str, ...], nodes: dict[str, fx.Node]) -> str:
    """The module path the block lives under (for display and stage names), from its parameter paths.

    Tensors fx made constants of (``_tensor_constant0``: Swin's relative position index) belong to
    no module and are left out.
    """
    paths = []
    for name in branch:
        node = nodes[name]
        owned = (inp.target for inp in _own_attributes(node) if not inp.target.startswith("_tensor_constant"))
        paths.extend(target.split(".") for target in owned)
    return ".".join(common_prefix(paths))


def _own_attributes(node: fx.Node) -> list[fx.Node]:
    """The node itself when it calls a module, plus the get_attr nodes it reads."""
    own = [node] if node.op == "call_module" else []
    return own + [inp for inp in node.all_input_nodes if inp.op == "get_attr"]


def _annotate(graph: fx.Graph, blocks: list[Block]) -> None:
    for node in graph.nodes:
        untag(node)
    by_name = {n.name: n for n in graph.nodes}
    for block in blocks:
        for name in block.nodes:
            tag(by_name[name], block=block.index, role="branch")
        for role, name in (("join", block.join), ("output", block.output)):
            tag(by_name[name], block=block.index, role=role)
