"""Small helpers over fx graphs shared by the passes: data edges, node kinds, parameter lookups,
and the one copy of each small path/name utility (unique names, common prefixes, dotted setattr)."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Container, Sequence

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


METADATA_ATTRIBUTES = frozenset({"shape", "device", "dtype", "ndim", "is_cuda", "layout", "requires_grad"})
METADATA_METHODS = frozenset({"size", "dim", "numel", "nelement", "get_device", "is_floating_point"})


def is_metadata_query(node: fx.Node) -> bool:
    """``x.shape``, ``x.device``, ``x.size()``, ...: a node whose value describes a tensor, not its data."""
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return node.args[1] in METADATA_ATTRIBUTES
    return node.op == "call_method" and node.target in METADATA_METHODS


def data_nodes(graph: fx.Graph) -> set[str]:
    """Names of nodes that carry activations: everything computed from a placeholder's values.

    Nodes computed only from parameters (weight standardization in NF-ResNet and BiT convs) are
    weight expressions, not data: they belong to the block whose branch reads them. So are nodes
    computed from a tensor's shape or device alone (``x.shape[0]``, ``cls_token.expand(B, -1, -1)``,
    LeViT's ``x.device``): their value is the same for every input of that shape, so they neither
    carry the batch nor make an add a residual join.
    """
    data: set[str] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or (
            node.op != "output"
            and not is_metadata_query(node)
            and any(inp.name in data for inp in node.all_input_nodes)
        ):
            data.add(node.name)
    return data


def shape_nodes(graph: fx.Graph, data: set[str]) -> set[str]:
    """Names of the non-data nodes computed from a data node's shape or device (``x.shape[0]``)."""
    found: set[str] = set()
    for node in graph.nodes:
        if node.op == "output" or node.name in data:
            continue
        if any(inp.name in data or inp.name in found for inp in node.all_input_nodes):
            found.add(node.name)
    return found


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


def identity_sources(node: fx.Node, modules: dict[str, nn.Module]) -> list[fx.Node]:
    """``node`` and every node it passes through ``nn.Identity`` calls back to, nearest first.

    A residual shortcut ``shortcut(x)`` with ``shortcut = nn.Identity()`` is ``x`` itself; the fork
    may itself be an ``nn.Identity`` call (ConvNeXt's first stage has an identity ``downsample``),
    so a caller asks whether the fork is *on* this chain, not whether it is at the chain's end.
    """
    chain = [node]
    while node.op == "call_module" and isinstance(modules[node.target], nn.Identity) and node.args:
        node = node.args[0]
        chain.append(node)
    return chain


PASS_THROUGH_MODULES: tuple[type[nn.Module], ...] = (nn.Identity, nn.modules.dropout._DropoutNd)
"""Modules that are the identity in eval mode and a random mask at most in train mode (plus timm's
``DropPath``): timm builds ``nn.Identity`` or nothing where such a module's rate is 0."""


def is_pass_through(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """A single-user call of an identity/dropout/DropPath module on one tensor.

    Blocks that differ only in such calls compute the same function in eval mode; a node with more
    than one user is not treated so (in train mode each use would need its own random draw).
    """
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs or len(node.users) != 1:
        return False
    if not isinstance(node.args[0], fx.Node):
        return False
    from timm.layers import DropPath

    return isinstance(modules[node.target], (*PASS_THROUGH_MODULES, DropPath))


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


def fetch_attr(root: nn.Module, target: str):
    """``getattr`` along a dotted path."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def owner_of(root: nn.Module, target: str) -> tuple[nn.Module, str]:
    """The module that holds a dotted path's last attribute, and that attribute's name."""
    owner_path, _, name = target.rpartition(".")
    return root.get_submodule(owner_path), name


def set_attr(root: nn.Module, target: str, value: object) -> None:
    """``setattr`` along a dotted path ('layer1.0.conv1.weight')."""
    owner, name = owner_of(root, target)
    setattr(owner, name, value)


def unique_name(base: str, taken: Container[str], pattern: str = "{base}_{n}") -> str:
    """``base``, or the first ``pattern`` with n = 2, 3, ... that is not ``taken``."""
    candidate, n = base, 2
    while candidate in taken:
        candidate, n = pattern.format(base=base, n=n), n + 1
    return candidate


def common_prefix(paths: Sequence[Sequence[str]]) -> list[str]:
    """The longest list of leading parts that every path shares (module paths split on '.')."""
    if not paths:
        return []
    prefix = list(paths[0])
    for path in paths[1:]:
        length = 0
        while length < min(len(prefix), len(path)) and prefix[length] == path[length]:
            length += 1
        prefix = prefix[:length]
    return prefix


_NUMBER = re.compile(r"\d+\.\d+(e-?\d+)?")


def module_config(module: nn.Module) -> str:
    """A module's type and configuration with float settings blanked out.

    Blocks whose modules differ only in float settings (DropPath rates that grow with depth) still
    group into one run; the lifted stage keeps each block's module.
    """
    return f"{type(module).__module__}.{type(module).__qualname__}:{_NUMBER.sub('#', repr(module))}"


def describe_arg(arg: object, refer: Callable[[fx.Node], tuple]) -> tuple:
    """A hashable description of a node argument, with node references described by ``refer``.

    Containers and slices are described element by element (Swin's ``x[:, :H]`` holds a node in
    a slice, so its ``repr`` would embed a node name); float literals are wildcards (NF-ResNet's
    per-block ``beta``, DropPath rates: lifting interpolates them like weights).
    """
    if isinstance(arg, fx.Node):
        return refer(arg)
    if isinstance(arg, (tuple, list)):
        return (type(arg).__name__, tuple(describe_arg(a, refer) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, describe_arg(v, refer)) for k, v in sorted(arg.items())))
    if isinstance(arg, slice):
        return ("slice", *(describe_arg(part, refer) for part in (arg.start, arg.stop, arg.step)))
    if isinstance(arg, float):
        return ("float",)
    return ("lit", repr(arg))


def describe_target(node: fx.Node, modules: dict[str, nn.Module]) -> tuple:
    """What a node calls: a module's configuration and tensor shapes, a function's or method's name."""
    if node.op == "call_module":
        module = modules[node.target]
        tensors = [*module.named_parameters(), *module.named_buffers()]
        return ("module", module_config(module), tuple((n, tuple(t.shape)) for n, t in tensors))
    if node.op == "call_function":
        function = node.target
        return ("function", getattr(function, "__module__", ""), getattr(function, "__name__", ""))
    return (node.op, str(node.target))
