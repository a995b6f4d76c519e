"""Analysis pass: group identity blocks into runs of same-shape, isomorphic blocks, or of periods.

A run of period 1 is a maximal chain of identity (or scaled-shortcut) blocks, each fed by the
previous block's output (and that output used by nothing else live), with equal shapes, the same
form and activation, isomorphic branch graphs and equal parameter shapes, including tensors read
directly through ``get_attr``. Blocks left alone by that (a transformer's attention and MLP halves
alternate) are grouped by :mod:`odeify.passes.periods` into runs of period p > 1.

Pass-through calls (``nn.Identity``, dropout, timm's ``DropPath``) are not part of the comparison:
timm builds a ``DropPath`` only where a block's drop rate is above 0 and ``nn.Identity`` (or
nothing) elsewhere, so the blocks of one stage differ in them although they compute the same
function. ``lift`` keeps each block's own pass-through modules as per-block variants. The pass
only reads the graph; its results are the returned runs and the ``run`` field of each node's tag.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.fx as fx
from torch import nn

from odeify.ir.meta import tag
from odeify.ir.plan import Block, Discrete, Run
from odeify.passes.contract import PassResult, analysis, graph_pass
from odeify.passes.graph_utils import (
    common_prefix,
    data_nodes,
    describe_arg,
    describe_target,
    fetch_attr,
    is_pass_through,
    live_nodes,
    unique_name,
)
from odeify.passes.periods import find_periods
from odeify.passes.properties import BLOCKS, RUNS
from odeify.passes.tracing import node_shape

GROUP_RUNS = analysis("group_runs", requires={BLOCKS}, ensures={RUNS})
SHAPE_DEPTH = 8
"""How many calls deep a block's signature describes a value it reads from outside that is no data
(a shape read of its input, which the block shares with the reshapes after it); deeper, by name."""


def block_node_list(block: Block, nodes: dict[str, fx.Node]) -> list[fx.Node]:
    """The nodes a block computes, in graph order: branch, join, and the closing activation."""
    names = [*block.nodes, block.join]
    if block.output != block.join:
        names.append(block.output)
    return [nodes[name] for name in names]


def core_nodes(block: Block, nodes: dict[str, fx.Node], modules: dict[str, nn.Module]) -> list[fx.Node]:
    """The block's nodes without its pass-through calls: what isomorphic blocks share node for node."""
    members = block_node_list(block, nodes)
    ends = {block.join, block.output}
    return [n for n in members if n.name in ends or not is_pass_through(n, modules)]


def pass_through_source(
    node: fx.Node, members: set[str], modules: dict[str, nn.Module]
) -> tuple[fx.Node, tuple[fx.Node, ...]]:
    """The node a block value comes from once pass-through calls are skipped, and those calls in order.

    ``drop_path(conv(h))`` gives ``(conv, (drop_path,))``; ``members`` bounds the walk to one block.
    """
    chain: list[fx.Node] = []
    while node.name in members and is_pass_through(node, modules):
        chain.append(node)
        node = node.args[0]
    return node, tuple(reversed(chain))


def block_signature(block: Block, gm: fx.GraphModule) -> tuple:
    """A hashable description of a block's computation that is equal for isomorphic blocks.

    Node references become positions among the block's core nodes (pass-through calls skipped),
    the fork becomes ``x``, tensors read through ``get_attr`` become their shape and dtype, and
    float literals are wildcards (NF-ResNet's per-block ``beta`` differs; the lifted stage
    interpolates such constants like weights).
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    modules = dict(gm.named_modules())
    members = {n.name for n in block_node_list(block, nodes)}
    core = core_nodes(block, nodes, modules)
    position = {n.name: i for i, n in enumerate(core)}
    data = data_nodes(gm.graph)

    def refer(arg: fx.Node, depth: int = 0) -> tuple:
        arg, _ = pass_through_source(arg, members, modules)
        if arg.name == block.fork:
            return ("x",)
        if arg.name in position:
            return ("n", position[arg.name])
        if arg.op == "get_attr":
            value = fetch_attr(gm, arg.target)
            if isinstance(value, torch.Tensor):
                return ("attr", tuple(value.shape), str(value.dtype))
        elif arg.name not in data and depth < SHAPE_DEPTH:  # SAM's H = x.shape[1], read outside too
            args = describe_arg(arg.args, lambda a: refer(a, depth + 1))
            return ("shape", describe_target(arg, modules), args)
        elif depth > 0:  # the shape of a value before the block (DaViT's B, C, H, W of its pair's input)
            return ("shape of", node_shape(arg))
        return ("outside", arg.name)

    signature = [
        (describe_target(node, modules), describe_arg(node.args, refer), describe_arg(node.kwargs, refer))
        for node in core
    ]
    return tuple(signature)


@graph_pass(GROUP_RUNS)
def group_runs(gm: fx.GraphModule, blocks: Sequence[Block]) -> PassResult:
    """Chain identity blocks into runs of period 1 or p; every other block stays discrete, with why.

    The result's ``value`` is ``(runs, discrete)``.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    live = live_nodes(gm.graph)
    memo: dict[tuple[int, str], tuple] = {}

    def signature(block: Block) -> tuple:
        key = (block.index, block.output)  # a block may be read as pre-activation: another output
        if key not in memo:
            memo[key] = block_signature(block, gm)
        return memo[key]

    chains: list[list[Block]] = []
    discrete: list[Discrete] = []
    for block in blocks:
        if block.kind == "projection":
            discrete.append(Discrete(block, "projection shortcut: the block changes shape or transforms x"))
            continue
        previous = chains[-1][-1] if chains else None
        candidates = [block]
        if previous is not None and previous.form == "pre" and block.activation is not None:
            # The last pre-activation block of a stage looks post-activation when the next stage
            # starts with an activation (NF-ResNet): read it as its neighbours are read.
            candidates.insert(0, as_pre_activation(block, nodes))
        joined = previous is not None and _extend(chains[-1], candidates, signature, nodes, live)
        if not joined:
            chains.append([block])
    groups = find_periods(gm, chains, signature)
    runs = [
        Run(name, group.blocks, group.period, group.glue)
        for name, group in zip(_run_names([list(g.blocks) for g in groups]), groups, strict=True)
    ]
    for run in runs:
        for block in run.blocks:
            for name in (*block.nodes, block.join, block.output):
                tag(nodes[name], run=run.name)
    return PassResult(gm, modified=False, value=(runs, discrete))


def _extend(
    chain: list[Block],
    candidates: list[Block],
    signature: Callable[[Block], tuple],
    nodes: dict[str, fx.Node],
    live: set[str],
) -> bool:
    """Append the first candidate reading of a block that continues ``chain``; False if none does."""
    for candidate in candidates:
        if _continues(chain[-1], candidate, signature, nodes, live):
            chain.append(candidate)
            return True
    return False


def as_pre_activation(block: Block, nodes: dict[str, fx.Node]) -> Block:
    """The same block read as pre-activation: the join is its output, the activation is outside."""
    return replace(
        block, output=block.join, form="pre", activation=None, out_shape=node_shape(nodes[block.join])
    )


def _continues(
    previous: Block,
    block: Block,
    signature: Callable[[Block], tuple],
    nodes: dict[str, fx.Node],
    live: set[str],
) -> bool:
    """``block`` reads ``previous``'s output, which nothing else uses (dead side chains aside), and
    computes the same function: it extends ``previous``'s period-1 run."""
    if block.fork != previous.output or block.in_shape != previous.out_shape:
        return False
    allowed = set(block.nodes) | {block.join}
    if any(user.name not in allowed and user.name in live for user in nodes[previous.output].users):
        return False  # the intermediate state is used elsewhere (a feature tap): cannot be integrated away
    return signature(block) == signature(previous)


def _run_names(chains: list[list[Block]]) -> list[str]:
    """Names from the blocks' common module path ('layer3', 'stages.2'), made unique."""
    names: list[str] = []
    for i, chain in enumerate(chains):
        common = common_prefix([b.scope.split(".") for b in chain])
        if len(chain) == 1 and common and common[-1].isdigit():
            common = common[:-1]  # a lone block 'layer2.1' names its stage 'layer2'
        names.append(unique_name(".".join(common) or f"run{i}", names, "{base}.run{n}"))
    return names
