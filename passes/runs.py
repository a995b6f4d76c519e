"""Analysis pass: group identity blocks into runs of same-shape, isomorphic blocks.

A run is a maximal chain of identity blocks, each fed by the previous block's output (and that
output used by nothing else), with equal shapes, the same form and activation, isomorphic branch
graphs and equal parameter shapes, including tensors read directly through ``get_attr``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.fx as fx

from odeify.plan import Block, Discrete, Run
from passes.graph_utils import fetch_attr, module_config
from passes.residual_blocks import META_KEY


def block_node_list(block: Block, nodes: dict[str, fx.Node]) -> list[fx.Node]:
    """The nodes a block computes, in graph order: branch, join, and the closing activation."""
    names = [*block.nodes, block.join]
    if block.output != block.join:
        names.append(block.output)
    return [nodes[name] for name in names]


def block_signature(block: Block, gm: fx.GraphModule) -> tuple:
    """A hashable description of a block's computation that is equal for isomorphic blocks.

    Node references become positions in the block, the fork becomes ``x``, tensors read through
    ``get_attr`` become their shape and dtype, and float literals are wildcards (NF-ResNet's
    per-block ``beta`` differs; the lifted stage interpolates such constants like weights).
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    members = block_node_list(block, nodes)
    position = {n.name: i for i, n in enumerate(members)}

    def describe(arg):
        if isinstance(arg, fx.Node):
            if arg.name == block.fork:
                return ("x",)
            if arg.name in position:
                return ("n", position[arg.name])
            if arg.op == "get_attr":
                value = fetch_attr(gm, arg.target)
                if isinstance(value, torch.Tensor):
                    return ("attr", tuple(value.shape), str(value.dtype))
            return ("outside", arg.name)
        if isinstance(arg, (tuple, list)):
            return (type(arg).__name__, tuple(describe(a) for a in arg))
        if isinstance(arg, dict):
            return ("dict", tuple((k, describe(v)) for k, v in sorted(arg.items())))
        if isinstance(arg, float):
            return ("float",)
        return ("lit", repr(arg))

    signature = []
    for node in members:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            tensors = [*module.named_parameters(), *module.named_buffers()]
            shapes = tuple((n, tuple(t.shape)) for n, t in tensors)
            target = ("module", module_config(module), shapes)
        elif node.op == "call_function":
            function = node.target
            target = ("function", getattr(function, "__module__", ""), getattr(function, "__name__", ""))
        else:
            target = (node.op, str(node.target))
        signature.append((target, describe(node.args), describe(node.kwargs)))
    return tuple(signature)


def group_runs(gm: fx.GraphModule, blocks: Sequence[Block]) -> tuple[list[Run], list[Discrete]]:
    """Chain identity blocks into runs; every other block stays discrete, with the reason."""
    nodes = {n.name: n for n in gm.graph.nodes}
    signatures = {b.index: block_signature(b, gm) for b in blocks if b.kind == "identity"}
    chains: list[list[Block]] = []
    discrete: list[Discrete] = []
    for block in blocks:
        if block.kind != "identity":
            discrete.append(Discrete(block, "projection shortcut: the block changes shape or transforms x"))
            continue
        previous = chains[-1][-1] if chains else None
        if previous is not None and previous.form == "pre" and block.form == "post":
            # The last pre-activation block of a stage looks post-activation when the next stage
            # starts with an activation (NF-ResNet): read it as its neighbours are read.
            demoted = as_pre_activation(block, nodes)
            signatures[demoted.index] = block_signature(demoted, gm)
            if _continues(previous, demoted, signatures, nodes):
                chains[-1].append(demoted)
                continue
            signatures[block.index] = block_signature(block, gm)
        if previous is not None and _continues(previous, block, signatures, nodes):
            chains[-1].append(block)
        else:
            chains.append([block])
    runs = [Run(name, tuple(chain)) for name, chain in zip(_run_names(chains), chains, strict=True)]
    for run in runs:
        for block in run.blocks:
            for name in (*block.nodes, block.join, block.output):
                nodes[name].meta.setdefault(META_KEY, {})["run"] = run.name
    return runs, discrete


def as_pre_activation(block: Block, nodes: dict[str, fx.Node]) -> Block:
    """The same block read as pre-activation: the join is its output, the activation is outside."""
    from odeify.tracing import node_shape

    return replace(
        block, output=block.join, form="pre", activation=None, out_shape=node_shape(nodes[block.join])
    )


def _continues(previous: Block, block: Block, signatures: dict, nodes: dict[str, fx.Node]) -> bool:
    if block.fork != previous.output or block.in_shape != previous.out_shape:
        return False
    allowed = set(block.nodes) | {block.join}
    if any(user.name not in allowed for user in nodes[previous.output].users):
        return False  # the intermediate state is used elsewhere (a feature tap): cannot be integrated away
    return signatures[block.index] == signatures[previous.index]


def _run_names(chains: list[list[Block]]) -> list[str]:
    """Names from the blocks' common module path ('layer3', 'stages.2'), made unique."""
    names: list[str] = []
    for i, chain in enumerate(chains):
        scopes = [b.scope.split(".") for b in chain]
        common = _common_prefix(scopes)
        if len(chain) == 1 and common and common[-1].isdigit():
            common = common[:-1]  # a lone block 'layer2.1' names its stage 'layer2'
        name = ".".join(common) or f"run{i}"
        candidate, n = name, 2
        while candidate in names:
            candidate, n = f"{name}.run{n}", n + 1
        names.append(candidate)
    return names


def _common_prefix(paths: list[list[str]]) -> list[str]:
    prefix = paths[0]
    for path in paths[1:]:
        length = 0
        while length < min(len(prefix), len(path)) and prefix[length] == path[length]:
            length += 1
        prefix = prefix[:length]
    return prefix
