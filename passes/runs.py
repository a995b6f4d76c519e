"""Analysis pass: group identity blocks into runs of same-shape, isomorphic blocks.

A run is a maximal chain of identity blocks, each fed by the previous block's output (and that
output used by nothing else), with equal shapes, the same form and activation, isomorphic branch
graphs and equal parameter shapes, including tensors read directly through ``get_attr``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.fx as fx
from odeify.passes.graph_utils import fetch_attr, module_config
from odeify.passes.residual_blocks import META_KEY

from odeify.plan import Block, Discrete, Run


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
    """Chain identity blocks into runs; every other block stays discrete, with the reason.

    Where a block lacks the ``DropPath`` its neighbours have (timm builds none for a block whose
    drop rate is 0), a ``DropPath(0.)`` copy, an exact no-op in eval and train mode, is inserted
    into ``gm`` so the blocks line up node for node.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    signatures = {b.index: block_signature(b, gm) for b in blocks if b.kind == "identity"}
    chains: list[list[Block]] = []
    discrete: list[Discrete] = []
    for block in blocks:
        if block.kind != "identity":
            discrete.append(Discrete(block, "projection shortcut: the block changes shape or transforms x"))
            continue
        chain = chains[-1] if chains else None
        candidates = [block]
        if chain is not None and chain[-1].form == "pre" and block.form == "post":
            # The last pre-activation block of a stage looks post-activation when the next stage
            # starts with an activation (NF-ResNet): read it as its neighbours are read.
            candidates.insert(0, as_pre_activation(block, nodes))
        for candidate in candidates if chain is not None else ():
            signatures[candidate.index] = block_signature(candidate, gm)
            if _continues(chain[-1], candidate, signatures, nodes):
                chain.append(candidate)
                break
            aligned = _align_drop_path(gm, chain, candidate, signatures, nodes)
            if aligned is not None:
                chains[-1] = aligned
                break
        else:
            signatures[block.index] = block_signature(block, gm)
            chains.append([block])
    runs = [Run(name, tuple(chain)) for name, chain in zip(_run_names(chains), chains, strict=True)]
    for run in runs:
        for block in run.blocks:
            for name in (*block.nodes, block.join, block.output):
                nodes[name].meta.setdefault(META_KEY, {})["run"] = run.name
    return runs, discrete


def _drop_path_of(block: Block, nodes: dict[str, fx.Node], gm: fx.GraphModule) -> fx.Node | None:
    """The ``DropPath`` call that feeds the block's join as its branch operand, if there is one."""
    from timm.layers import DropPath

    for operand in nodes[block.join].args:
        if (
            isinstance(operand, fx.Node)
            and operand.name in block.nodes
            and operand.op == "call_module"
            and isinstance(gm.get_submodule(operand.target), DropPath)
        ):
            return operand
    return None


def _align_drop_path(
    gm: fx.GraphModule, chain: list[Block], block: Block, signatures: dict, nodes: dict[str, fx.Node]
) -> list[Block] | None:
    """``chain + [block]`` after giving the side without a DropPath a ``DropPath(0.)``; None if no match.

    On no match the graph is left as it was.
    """
    if block.fork != chain[-1].output:
        return None
    reference, mine = _drop_path_of(chain[-1], nodes, gm), _drop_path_of(block, nodes, gm)
    if (reference is None) == (mine is None):
        return None
    if reference is None:
        lacking, reference, owner = list(chain), mine, block
    else:
        lacking, owner = [block], chain[-1]
    saved = {b.index: signatures[b.index] for b in lacking}
    inserted: list[fx.Node] = []
    fixed: dict[int, Block] = {}
    for b in lacking:
        node = _insert_no_drop(gm, b, reference, owner.scope, nodes)
        inserted.append(node)
        fixed[b.index] = replace(b, nodes=(*b.nodes, node.name))
        signatures[b.index] = block_signature(fixed[b.index], gm)
    candidate = [fixed.get(b.index, b) for b in chain]
    new_block = fixed.get(block.index, block)
    if _continues(candidate[-1], new_block, signatures, nodes):
        gm.recompile()
        return [*candidate, new_block]
    for node in inserted:  # undo
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        del nodes[node.name]
        gm.delete_submodule(node.target)
    signatures.update(saved)
    return None


def _insert_no_drop(
    gm: fx.GraphModule, block: Block, reference: fx.Node, reference_scope: str, nodes: dict[str, fx.Node]
) -> fx.Node:
    """Insert a ``DropPath(0.)`` copy of ``reference`` on the block's branch, just before its join."""
    module = copy.deepcopy(gm.get_submodule(reference.target))
    module.drop_prob = 0.0
    base = _mirrored_path(reference.target, reference_scope, block.scope)
    target, n = base, 2
    while _has_submodule(gm, target):
        target, n = f"{base}_{n}", n + 1
    gm.add_submodule(target, module)
    join = nodes[block.join]
    branch = next(a for a in join.args if isinstance(a, fx.Node) and a.name in block.nodes)
    with gm.graph.inserting_before(join):
        node = gm.graph.call_module(target, (branch,))
    join.replace_input_with(branch, node)
    node.meta["tensor_meta"] = branch.meta.get("tensor_meta")
    node.meta[META_KEY] = {"block": block.index, "role": "branch"}
    nodes[node.name] = node
    return node


def _mirrored_path(target: str, reference_scope: str, scope: str) -> str:
    """``target``, a module path in the block at ``reference_scope``, moved to the block at ``scope``.

    'layer1.1.drop_path' with scopes 'layer1.1' -> 'layer1.0' becomes 'layer1.0.drop_path'.
    """
    ref, own, parts = reference_scope.split("."), scope.split("."), target.split(".")
    i = 0
    while i < min(len(ref), len(own)) and ref[i] == own[i]:
        i += 1
    if i < min(len(ref), len(own)) and parts[: i + 1] == ref[: i + 1]:
        return ".".join([*own[: i + 1], *parts[i + 1 :]])
    return f"{scope}.{parts[-1]}" if scope else parts[-1]


def _has_submodule(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_submodule(target)
    except AttributeError:
        return False
    return True


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
