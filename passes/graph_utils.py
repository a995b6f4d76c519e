"""Small helpers over fx graphs shared by the passes: data edges, node kinds, parameter lookups."""

from __future__ import annotations

import operator
import re

import networkx as nx
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

ADD_TARGETS = {operator.add, operator.iadd, torch.add}
ADD_METHODS = {"add", "add_", "__iadd__", "__add__"}

ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.SiLU,
    nn.GELU,
    nn.LeakyReLU,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
)
ACTIVATION_FUNCTIONS = {
    F.relu,
    torch.relu,
    torch.relu_,
    F.relu6,
    F.silu,
    F.gelu,
    F.leaky_relu,
    F.elu,
    F.hardswish,
    F.mish,
    torch.tanh,
    torch.sigmoid,
    F.softplus,
}
ACTIVATION_METHODS = {"relu", "relu_", "sigmoid", "tanh"}


def data_nodes(graph: fx.Graph) -> set[str]:
    """Names of nodes that carry activations: everything computed from a placeholder.

    Nodes computed only from parameters (weight standardization in NF-ResNet and BiT convs) are
    weight expressions, not data: they belong to the block whose branch reads them.
    """
    data: set[str] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or (
            node.op != "output" and any(inp.name in data for inp in node.all_input_nodes)
        ):
            data.add(node.name)
    return data


def data_graph(graph: fx.Graph, data: set[str]) -> nx.DiGraph:
    """The graph of data nodes with a single virtual root feeding every placeholder."""
    g = nx.DiGraph()
    g.add_node("__root__")
    for node in graph.nodes:
        if node.name not in data:
            continue
        g.add_node(node.name)
        if node.op == "placeholder":
            g.add_edge("__root__", node.name)
        for inp in node.all_input_nodes:
            if inp.name in data:
                g.add_edge(inp.name, node.name)
    return g


def weight_expressions(node: fx.Node, data: set[str]) -> list[fx.Node]:
    """The non-data call nodes (computations on parameters) that feed ``node``, transitively."""
    found: list[fx.Node] = []
    stack = [inp for inp in node.all_input_nodes if inp.name not in data and inp.op != "get_attr"]
    while stack:
        inp = stack.pop()
        if inp in found:
            continue
        found.append(inp)
        stack.extend(i for i in inp.all_input_nodes if i.name not in data and i.op != "get_attr")
    return found


def live_nodes(graph: fx.Graph) -> set[str]:
    """Names of nodes that can reach the graph output (side chains such as torch._assert cannot)."""
    live: set[str] = set()
    stack = [n for n in graph.nodes if n.op == "output"]
    while stack:
        node = stack.pop()
        for inp in node.all_input_nodes:
            if inp.name not in live:
                live.add(inp.name)
                stack.append(inp)
    return live


def is_add_join(node: fx.Node) -> bool:
    """An elementwise add of exactly two tensors with unit alpha."""
    if node.op == "call_function" and node.target in ADD_TARGETS:
        pass
    elif node.op == "call_method" and node.target in ADD_METHODS:
        pass
    else:
        return False
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if len(node.args) != 2 or len(tensors) != 2:
        return False
    return node.kwargs.get("alpha", 1) == 1


def activation_of(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """The activation's display name when ``node`` applies a pointwise activation, else None."""
    if node.op == "call_module":
        module = modules[node.target]
        if isinstance(module, ACTIVATION_MODULES) or _is_timm_activation(module):
            return type(module).__name__
    elif node.op == "call_function" and node.target in ACTIVATION_FUNCTIONS:
        return getattr(node.target, "__name__", str(node.target))
    elif node.op == "call_method" and node.target in ACTIVATION_METHODS:
        return node.target
    return None


def _is_timm_activation(module: nn.Module) -> bool:
    from_timm = type(module).__module__.startswith("timm.layers.activations")
    return from_timm and not any(True for _ in module.parameters())


def skip_identity(node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node:
    """Follow ``nn.Identity`` calls back to the node they pass through."""
    while node.op == "call_module" and isinstance(modules[node.target], nn.Identity):
        node = node.args[0]
    return node


def node_tensors(node: fx.Node, gm: fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers a node reads directly: its own for get_attr, its module's for call_module."""
    if node.op == "get_attr":
        value = fetch_attr(gm, node.target)
        return [(node.target, value)] if isinstance(value, torch.Tensor) else []
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        named = list(module.named_parameters()) + list(module.named_buffers())
        return [(f"{node.target}.{name}", t) for name, t in named]
    return []


def fetch_attr(gm: nn.Module, target: str):
    """``getattr`` along a dotted path."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


_NUMBER = re.compile(r"\d+\.\d+(e-?\d+)?")


def module_config(module: nn.Module) -> str:
    """A module's type and configuration with float settings blanked out.

    Blocks whose modules differ only in float settings (DropPath rates that grow with depth) still
    group into one run; the lifted stage keeps each block's module.
    """
    return f"{type(module).__module__}.{type(module).__qualname__}:{_NUMBER.sub('#', repr(module))}"
