"""Trace a model with torch.fx and annotate every node with its shape, without a real forward.

Leaf policy (which modules stay opaque ``call_module`` nodes):

* timm's registry of untraceable modules, minus ``NormFreeBlock`` (kept opaque it would hide
  NF-ResNet's residual structure);
* plus timm's ``DropPath``: traced through, its ``self.training`` test would be frozen at trace
  time (traced in eval mode, the module would vanish from the graph);
* torch.nn modules, as fx does by default, so norm layers that branch on ``self.training`` never
  have the training flag frozen into the graph;
* except the parameterised layers in :data:`TRACE_THROUGH`, which are traced into functional calls
  so their weights appear as ``get_attr`` nodes that later passes can rewrite.

Optional forward arguments are traced at their defaults (timm's ``VisionTransformer.forward(x,
attn_mask=None, is_causal=False)``): traced as placeholders they would be symbolic values that every
attention reads (``if attn_mask is not None`` takes the masked path), so each attention's residual
add would be dominated by two inputs and not be found. The traced module takes the input alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch import nn

from odeify.core.dtypes import model_dtype
from odeify.core.errors import TraceError
from odeify.passes.contract import PassResult, analysis, graph_pass, transformation
from odeify.passes.devices import read_input_device, tracing_device
from odeify.passes.graph_utils import data_nodes, is_add_join, live_nodes
from odeify.passes.properties import SHAPES

TRACE_THROUGH: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.Linear,
    nn.GroupNorm,
    nn.LayerNorm,
)
"""torch.nn layers traced into ``torch.conv2d(x, self.weight, ...)`` and the like."""


def _timm_leaves() -> tuple[set[type[nn.Module]], tuple]:
    """timm's untraceable modules and functions, adjusted as the module docstring says."""
    from timm.layers import DropPath
    from timm.layers import _fx as timm_fx

    leaves = set(timm_fx.get_notrace_modules())
    try:
        from timm.models.nfnet import NormFreeBlock

        leaves.discard(NormFreeBlock)
    except ImportError:  # pragma: no cover - older timm without NF nets
        pass
    leaves.add(DropPath)
    return leaves, tuple(timm_fx.get_notrace_functions())


class ResidualTracer(fx.Tracer):
    """An fx tracer with odeify's leaf policy; ``extra_leaves`` lets users keep more modules opaque."""

    def __init__(self, extra_leaves: Sequence[type[nn.Module]] = ()) -> None:
        leaves, functions = _timm_leaves()
        super().__init__(autowrap_functions=functions)
        self.leaf_types = leaves | set(extra_leaves)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if type(m) in self.leaf_types:
            return True
        if isinstance(m, TRACE_THROUGH) and type(m).__module__.startswith("torch.nn"):
            return False
        return super().is_leaf_module(m, module_qualified_name)


TRACE = transformation("trace")
"""The graph's creation: a transformation from a model to a new graph module, which requires nothing."""


@graph_pass(TRACE)
def trace(model: nn.Module, extra_leaves: Sequence[type[nn.Module]] = ()) -> PassResult:
    """Symbolically trace ``model`` into a new graph module; on failure say which code FX choked on
    and what to do. A device read while tracing runs on the input's device (:mod:`odeify.passes.devices`)."""
    tracer = ResidualTracer(extra_leaves)
    attributes = set(vars(model))
    try:
        try:
            graph = tracer.trace(model, concrete_args=optional_defaults(model) or None)
        except Exception as exc:  # fx raises many types; all mean "this code is not traceable"
            raise TraceError(_untraceable_message(model, exc, extra_leaves)) from exc
        _drop_unused_inputs(graph)
        _skip_identities(graph, model)
        read_input_device(graph, tracing_device(model))
        return PassResult(fx.GraphModule(tracer.root, graph, type(model).__name__), modified=True)
    finally:
        _forget_constants(model, attributes)


def _skip_identities(graph: fx.Graph, model: nn.Module) -> None:
    """Erase every call of an ``nn.Identity``: its users read its input.

    timm puts ``nn.Identity`` where an optional layer is off (Swin-V2-CR's ``norm3`` after most
    blocks, Next-ViT's patch embedding of a block that keeps its width, a DropPath at rate 0). A call
    of one between two blocks is no layout glue, so the blocks on either side did not chain into a
    run; the call computes nothing, so no analysis or emitted graph needs it. A classifier that is
    an ``nn.Identity`` (``num_classes=0``) stays a call: ``reset_classifier`` replaces that module.
    """
    classifier = model.get_classifier() if hasattr(model, "get_classifier") else None
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        module = model.get_submodule(node.target)
        if type(module) is nn.Identity and module is not classifier:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _forget_constants(model: nn.Module, attributes: set[str]) -> None:
    """Remove the tensor constants fx set on ``model`` while tracing it (``_tensor_constant0``).

    fx keeps a tensor the code makes (DINOv3's rotary periods) as an attribute of the traced root,
    named by the first free number: left there, the model is changed by a conversion that promises to
    leave it as it is, and its next trace names the same tensor ``_tensor_constant1``, so a file saved
    from it no longer matches the model load rebuilds (a fresh trace, ``_tensor_constant0``).
    """
    for name in set(vars(model)) - attributes:
        if name.startswith("_tensor_constant"):
            delattr(model, name)


def optional_defaults(model: nn.Module) -> dict[str, object]:
    """The default of every optional ``forward`` argument after the input: what tracing fixes them to."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature (C extension)
        return {}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p.default for p in parameters[1:] if p.kind in named and p.default is not p.empty}


def _drop_unused_inputs(graph: fx.Graph) -> None:
    """Erase the placeholders after the first that reach no output, with their dead users.

    fx keeps a placeholder for an argument traced at a fixed value and checks it with a
    ``torch._assert`` side chain; the traced module computes the model at that value, so both go.
    """
    live = live_nodes(graph)
    order = {node: i for i, node in enumerate(graph.nodes)}
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    doomed: set[fx.Node] = set()
    stack = [node for node in placeholders[1:] if node.name not in live]
    while stack:
        node = stack.pop()
        if node not in doomed:
            doomed.add(node)
            stack.extend(node.users)
    for node in sorted(doomed, key=order.__getitem__, reverse=True):
        graph.erase_node(node)


def _untraceable_message(
    model: nn.Module, exc: Exception, extra_leaves: Sequence[type[nn.Module]] = ()
) -> str:
    where = _innermost_module_frame(exc, model)
    location = f" in module '{where[0]}' ({type(where[1]).__name__})" if where else ""
    return (
        f"torch.fx could not trace {type(model).__name__}{location}: {type(exc).__name__}: {exc}. "
        "This usually means data-dependent Python control flow (an `if` or loop on tensor values) "
        f"or a call FX cannot symbolize. {_leaf_advice(model, where, extra_leaves)}"
    )


_LEAF_TRIES = 3
"""How many module classes :func:`_leaf_advice` makes leaves, one per failed trace, before giving up."""


def _leaf_advice(
    model: nn.Module, where: tuple[str, nn.Module] | None, extra_leaves: Sequence[type[nn.Module]]
) -> str:
    """A ``leaf_modules`` suggestion checked by tracing the model with it, or why none is made.

    Each try makes the module the trace failed in a leaf and traces again (up to :data:`_LEAF_TRIES`
    classes). A suggestion is made only when the trace then succeeds and still has adds of two
    tensors computed from the input for odeify to read as residual blocks: making a model's encoder
    a leaf (Gemma 4's ViT branches in the encoder's own forward) traces, but hides every block.
    """
    leaves = list(extra_leaves)
    while where is not None and where[0] != "<root>" and len(leaves) < len(extra_leaves) + _LEAF_TRIES:
        leaves.append(type(where[1]))
        try:
            graph = ResidualTracer(leaves).trace(model, concrete_args=optional_defaults(model) or None)
        except Exception as exc:  # the next module fx chokes on, if any
            where = _innermost_module_frame(exc, model)
            continue
        names = ", ".join(cls.__name__ for cls in leaves)
        adds = _input_adds(graph)
        if adds == 0:
            added = ", ".join(cls.__name__ for cls in leaves[len(extra_leaves) :])
            return (
                f"Keeping {added} opaque does not help: traced with leaf_modules=[{names}], the model keeps "
                "no add of two tensors computed from the input (the leaves hold every residual block), so "
                "odeify would find nothing to turn into an ODE stage. odeify cannot convert this model as "
                "it is."
            )
        flags = " ".join(f"--leaf {cls.__name__}" for cls in leaves)
        return (
            f"Keep that code opaque with leaf_modules=[{names}] (odeify.convert(model, leaf_modules="
            f"[{names}]), or `{flags}` on the CLI): traced so, the model keeps {adds} adds of two tensors "
            "computed from the input for odeify to read as residual blocks; a leaf's weights stay "
            "outside the ODE stages."
        )
    tried = f" with leaf_modules=[{', '.join(c.__name__ for c in leaves)}]" if leaves else ""
    if where is not None and where[0] == "<root>":
        return (
            f"The trace fails{tried} in the model's own forward, which no leaf module can hide: odeify "
            "cannot trace this model as it is."
        )
    if where is None:
        return f"The trace fails{tried} in code outside any module's forward, which no leaf module can hide."
    return (
        f"The trace still fails{tried}, in module '{where[0]}' ({type(where[1]).__name__}); no leaf "
        f"list of at most {_LEAF_TRIES} more classes was found that traces."
    )


def _input_adds(graph: fx.Graph) -> int:
    """Adds of two tensors computed from the input that reach the output: candidate residual joins."""
    data, live = data_nodes(graph), live_nodes(graph)
    return sum(
        1
        for n in graph.nodes
        if is_add_join(n) and n.name in live and all(a.name in data for a in n.all_input_nodes)
    )


def _innermost_module_frame(exc: Exception, model: nn.Module) -> tuple[str, nn.Module] | None:
    """The deepest submodule whose forward appears in the traceback, as (qualified name, module)."""
    by_code = {}
    for qualified, sub in model.named_modules():
        code = getattr(type(sub).forward, "__code__", None)
        if code is not None:
            by_code.setdefault(code, (qualified or "<root>", sub))
    found = None
    tb = exc.__traceback__
    while tb is not None:
        hit = by_code.get(tb.tb_frame.f_code)
        if hit is not None:
            found = hit
        tb = tb.tb_next
    return found


def opaque_weights_reason(path: str, module: nn.Module) -> str:
    """Why a leaf module that holds parameters keeps its run from being lifted, and what would help.

    Its weights are not ``get_attr`` nodes a stage can take per block, so the run stays discrete.
    Whether anything helps is checked here, by tracing the module's own forward with the
    module's class not a leaf: only a module that then traces, with no weights left in a leaf
    inside, could become part of a stage, and only a user's ``leaf_modules`` entry can be dropped.
    """
    cls = type(module)
    if cls in _timm_leaves()[0]:
        why = f"timm registers {cls.__name__} as a module fx must not trace into"
    elif cls.__module__.startswith("torch.nn"):
        kept = ", ".join(t.__name__ for t in TRACE_THROUGH)
        why = f"odeify traces into the torch.nn layers {kept} alone and keeps torch.nn's {cls.__name__} whole"
    else:
        why = f"{cls.__name__} is in leaf_modules"
    lead = (
        f"module '{path}' ({cls.__name__}) holds parameters but is one opaque call in the trace ({why}), "
        "so a stage cannot take its weights; the run stays discrete layers. "
    )
    try:
        inner = ResidualTracer().trace(module, concrete_args=optional_defaults(module) or None)
    except Exception as exc:  # fx raises many types; all mean "this code is not traceable"
        return lead + f"fx cannot trace {cls.__name__}'s forward ({type(exc).__name__}), so nothing lifts it."
    inside = [module.get_submodule(n.target) for n in inner.nodes if n.op == "call_module"]
    held = sorted(
        {
            type(sub).__name__
            for sub in inside  # a BatchNorm is folded before lifting: its weights are no obstacle
            if not isinstance(sub, nn.modules.batchnorm._BatchNorm) and any(True for _ in sub.parameters())
        }
    )
    if held:
        return lead + (
            f"Traced through, {cls.__name__} would still keep {', '.join(held)} whole, weights and all, "
            "so nothing lifts it."
        )
    if why.endswith("leaf_modules"):
        return lead + (
            f"{cls.__name__}'s forward traces on its own with every weight visible: leave it out of "
            "leaf_modules to let the run lift."
        )
    return lead + f"{cls.__name__}'s forward would trace, but odeify has no option to trace into it."


ANNOTATE_SHAPES = analysis("annotate_shapes", ensures={SHAPES})


@graph_pass(ANNOTATE_SHAPES)
def annotate_shapes(
    gm: fx.GraphModule, input_shape: Sequence[int], dtype: torch.dtype | None = None
) -> PassResult:
    """Record ``node.meta["tensor_meta"]`` for every node, running the graph on meta tensors.

    Meta tensors carry shapes and dtypes but no data, so a resnet152 costs no real forward and no
    copy of its weights. An input the model rejects raises a :class:`TraceError` naming the node.

    Why not torch's own propagators: ``torch.fx.passes.shape_prop.ShapeProp`` runs the real
    forward (a full resnet152 pass on real weights); ``FakeTensorProp`` needs the module's weights
    converted to fake tensors first, which meant a deep copy of the model (0.9 s against 0.34 s
    here for resnet152's analysis) and fails on leaves that branch on values, which this
    interpreter runs for real on zeros instead. The metadata format is ShapeProp's
    (``_extract_tensor_metadata``), so ``node.meta["tensor_meta"]`` reads the same either way.
    """
    if dtype is None:
        dtype = model_dtype(gm)
    example = torch.empty(tuple(input_shape), dtype=dtype, device="meta")
    try:
        with torch.no_grad():
            _MetaShapeProp(gm).run(example)
    except _NodeFailed as failed:
        raise TraceError(
            f"The model rejects an input of shape {tuple(input_shape)}: node '{failed.node.name}' "
            f"({failed.node.format_node()}) failed with {failed.cause}. Pass the input size the model "
            "was built for (a model built with img_size=N takes N x N): `--img-size N` or "
            "`--input-size C H W` on the command line, input_size=(1, C, H, W) in Python. Without one, the "
            "size is the model's pretrained_cfg['input_size'] (timm leaves the architecture's default there)."
        ) from failed.cause
    return PassResult(gm, modified=False)


class _NodeFailed(Exception):
    def __init__(self, node: fx.Node, cause: Exception) -> None:
        super().__init__(str(cause))
        self.node = node
        self.cause = cause


def _to_meta(value):
    return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value


def _keeps_shape(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """A norm layer (with timm's act/drop parts) applied to a tensor with its number of channels.

    Its output has the input's shape and dtype; answering directly skips torch's meta batch_norm,
    a Python decomposition that costs more than the rest of a small model's annotation.
    """
    if not isinstance(module, nn.modules.batchnorm._NormBase) or kwargs or len(args) != 1:
        return False
    x = args[0]
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == module.num_features


class _MetaShapeProp(fx.Interpreter):
    """Runs a graph on meta tensors, swapping weights for meta copies as nodes read them.

    A node meta tensors cannot run (a leaf that branches on values, ``if x.sum() > 0``) runs for
    real on zeros of its inputs' shapes; if that fails too, the node really rejects its input.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.real = False
        self._meta_attrs: dict[str, torch.Tensor] = {}

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if self.real:
            return value
        if target not in self._meta_attrs:
            self._meta_attrs[target] = _to_meta(value)
        return self._meta_attrs[target]

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        if self.real:
            return module(*args, **kwargs)
        if _keeps_shape(module, args, kwargs):
            return torch.empty_like(args[0])
        tensors = {name: _to_meta(t) for name, t in [*module.named_parameters(), *module.named_buffers()]}
        return torch.func.functional_call(module, tensors, tuple(args), kwargs)

    def run_node(self, n: fx.Node):
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        try:
            result = super().run_node(n)
        except Exception:
            result = self._run_on_zeros(n)
        if isinstance(result, torch.Tensor):
            n.meta["tensor_meta"] = _extract_tensor_metadata(result)
        elif isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
            n.meta["tensor_meta"] = type(result)(_extract_tensor_metadata(r) for r in result)
        return result

    def _run_on_zeros(self, n: fx.Node):
        def real(a):
            return torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a

        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args, kwargs = fx.node.map_aggregate((args, kwargs), real)
        self.real = True
        try:
            result = getattr(self, n.op)(n.target, args, kwargs)
        except Exception as exc:
            raise _NodeFailed(n, exc) from exc
        finally:
            self.real = False
        return fx.node.map_aggregate(result, _to_meta)


def node_shape(node: fx.Node) -> tuple[int, ...] | None:
    """The annotated tensor shape of a node, or None when it does not produce one tensor."""
    from torch.fx.passes.shape_prop import TensorMetadata

    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if isinstance(meta, TensorMetadata) else None
