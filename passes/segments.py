"""Checkpoint the parts of a converted model between its ODE stages: the whole-model memory plan.

A memory-free backward mode makes an ODE stage keep O(1) tensors for backward, but the rest of
the network (the stem, the first block of every stage, which changes the shape, the head) would
still keep every activation. :func:`checkpoint_segments` wraps each maximal run of graph nodes
between stage calls into one :class:`Segment` submodule that runs under
``torch.utils.checkpoint`` (non-reentrant): forward keeps only the segment's inputs, backward
recomputes the segment from them. So a training step keeps about one tensor per segment boundary
plus what each stage's mode keeps.

Why ``torch.utils.checkpoint`` (``use_reentrant=False``) and not a custom autograd Function as for
the stages: it replays the forward's RNG state (CPU and the inputs' device) and autocast state on
recompute, so DropPath masks and mixed precision come out the same; it needs no input to require
grad; and torch.compile traces it (a ``tag_activation_checkpoint`` region that the compiled
backward recomputes), so compiled segments stay compiled. A segment is recomputed as a whole, in
order, so one RNG state per segment is all it needs (the stages, which re-run single steps and
field evaluations out of order, record draws per graph node instead: see ``odeify.runtime.rng_tape``).

Recompute is exact because converted models fold BatchNorm into the convs. A BatchNorm that is
still there and in training mode would update its running statistics a second time on recompute:
a segment refuses to run one (:class:`~odeify.core.errors.ConfigError`).

The segment owns no parameters: the segmented graph fetches the tensors and modules a segment
uses with ``get_attr`` nodes and passes them in, so the model's ``state_dict``, parameter names and
submodules stay as they were, and replacing a submodule (a new head) takes effect.
:func:`inline_segments` restores the original graph exactly (node names, order and meta).
"""

from __future__ import annotations

import operator
import pickle
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from odeify.core.errors import ConfigError
from odeify.ir.meta import node_tag, tag
from odeify.ir.stage_ir import StageIR
from odeify.passes.contract import PassResult, graph_pass, transformation
from odeify.passes.properties import SEGMENTS
from odeify.runtime.batch_slices import batch_slices, probe_sample_bytes
from odeify.runtime.rerun import training_batchnorm
from odeify.runtime.stage import recording

__all__ = ["Segment", "checkpoint_segments", "has_segments", "inline_segments", "without_segments"]

CHECKPOINT_SEGMENTS = transformation("checkpoint_segments", ensures={SEGMENTS})
INLINE_SEGMENTS = transformation("inline_segments", invalidates={SEGMENTS})

SEGMENT_PREFIX = "odeify_segment"


def call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)``: a segment's body calls the modules it is handed with this."""
    return module(*args, **kwargs)


class Segment(nn.Module):
    """A run of a model graph's nodes between ODE stages, recomputed in backward (activation checkpointing).

    ``body`` is the run as it was in the model graph (a placeholder per outside value it reads,
    an output tuple of the values used after it): :func:`inline_segments` copies it back.
    ``runnable`` is the same computation taking ``(inputs..., attributes...)``, where the
    attributes are the tensors and modules the run fetched from the model: the segmented graph
    passes them in, so the segment holds none of them.
    """

    def __init__(self, body: fx.Graph, attributes: list[str], module_args: dict[int, str]) -> None:
        super().__init__()
        self.body = body
        self.attributes = attributes
        self.module_args = module_args  # the call's arguments that are modules: index -> path
        self.runnable = fx.GraphModule(nn.Module(), _runnable_graph(body, attributes))

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled() or (recording() and not self.training):  # as exporters record it
            return self.runnable(*args)
        if recording():
            raise ConfigError(
                "this model is in training mode with a memory-saving backward, whose recompute cannot be "
                "exported or traced. Export it in eval mode (model.eval(): the backward mode matters only "
                "in training), or set odeify.set_backward(model, 'backprop') to export the training graph."
            )
        for index, path in self.module_args.items():
            _refuse_training_batchnorm(args[index], path)
        inputs = len(args) - len(self.attributes)
        batches = [a for a in args[:inputs] if isinstance(a, torch.Tensor)]
        activations = sum(_nbytes(t) for t in batches)
        slices = [slice(None)]
        # each slice's weight gradients meet in autograd's buffers: slicing pays where the batch
        # outweighs the weights (resnet50 at 224: the stem and layer2-3's first blocks; not at 64x64)
        if len(batches) == inputs and activations > _weight_bytes(args[inputs:]):
            attributes = args[inputs:]
            sample = probe_sample_bytes(self, lambda rows: self.runnable(*rows, *attributes), batches)
            slices = batch_slices(*batches, sample_bytes=sample)
        if len(slices) > 1:
            joined = _sliced_checkpoint(self._run, args, inputs, slices)
            if joined is not None:
                return joined
        return checkpoint(self._run, *args, use_reentrant=False)

    def __getstate__(self) -> dict[str, Any]:
        """``body`` pickled on its own at the highest protocol: torch.save's protocol 2 cannot pickle
        an fx.Graph whose nodes call builtins such as ``operator.add`` (they reduce to their module)."""
        return {**self.__dict__, "body": pickle.dumps(self.body, protocol=pickle.HIGHEST_PROTOCOL)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**state, "body": pickle.loads(state["body"])})  # noqa: S301 (our own bytes)

    def _run(self, *args: Any) -> Any:
        with torch.profiler.record_function("odeify.segment"):  # forward and recompute, in traces
            return self.runnable(*args)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _weight_bytes(attributes: tuple[Any, ...]) -> int:
    """Bytes of the trainable tensors a segment is handed (tensors, and modules' parameters)."""
    tensors = [a for a in attributes if isinstance(a, torch.Tensor)]
    tensors += [p for a in attributes if isinstance(a, nn.Module) for p in a.parameters()]
    return sum(_nbytes(t) for t in tensors if t.requires_grad)


def _sliced_checkpoint(run, args: tuple[Any, ...], inputs: int, slices: list[slice]) -> Any:
    """``run`` checkpointed slice by slice of the batch, its outputs joined: backward recomputes one
    slice at a time, so the segment's activations live for one slice, not the batch
    (:mod:`odeify.runtime.batch_slices`). None when an output does not keep the batch first (a value
    whose rows are not the samples'): the caller checkpoints the segment whole."""
    sizes = [len(range(*rows.indices(args[0].shape[0]))) for rows in slices]
    pieces = [a.split(sizes) for a in args[:inputs]]  # one split: its backward is one cat, not a sum of zeros
    parts = []
    for k in range(len(slices)):
        sliced = (*(p[k] for p in pieces), *args[inputs:])
        part = checkpoint(run, *sliced, use_reentrant=False)
        outputs = part if isinstance(part, tuple) else (part,)
        size = sliced[0].shape[0]
        if any(not isinstance(o, torch.Tensor) or not o.dim() or o.shape[0] != size for o in outputs):
            return None
        parts.append(outputs)
    joined = tuple(torch.cat(column) for column in zip(*parts, strict=True))
    return joined if isinstance(part, tuple) else joined[0]


def _refuse_training_batchnorm(module: nn.Module, path: str) -> None:
    name = training_batchnorm(module)
    if name is not None:
        where = f"{path}.{name}" if name else path
        raise ConfigError(
            f"BatchNorm '{where}' is in training mode inside a part of the model that odeify "
            "recomputes in backward (to keep the whole model memory-free): the recompute would "
            "update its running statistics a second time. Fold it into the conv before it "
            "(odeify.convert does), freeze it with .eval(), or train with backward='backprop' "
            "(or a per-stage dict) so that nothing outside the stages is recomputed."
        )


@graph_pass(CHECKPOINT_SEGMENTS)
def checkpoint_segments(gm: fx.GraphModule) -> PassResult:
    """Wrap every maximal run of non-stage nodes of ``gm`` into a :class:`Segment`, in place.

    Stage calls, placeholders and the output stay in the model graph; a run between them becomes
    one ``call_module`` node (plus ``getitem`` nodes when it has several outputs). Applying it to
    a graph that already has segments changes nothing.
    """
    if has_segments(gm):
        return PassResult(gm, modified=False)
    stages = {node for node in gm.graph.nodes if _calls(gm, node, StageIR)}
    runs: list[list[fx.Node]] = [[]]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node in stages:
            runs.append([])
        else:
            runs[-1].append(node)
    members = {node: i for i, run in enumerate(runs) for node in run}
    graph = _empty_like(gm.graph)
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node not in members:
            env[node] = graph.node_copy(node, env.__getitem__)
        elif node is runs[members[node]][-1]:  # the run is complete: emit it as one segment
            _emit_segment(gm, graph, runs[members[node]], env, len(list(_segment_names(gm))))
    _install(gm, graph)
    return PassResult(gm, modified=True)


@graph_pass(INLINE_SEGMENTS)
def inline_segments(gm: fx.GraphModule) -> PassResult:
    """Undo :func:`checkpoint_segments` in place: the graph it started from, node for node."""
    segments = [node.target for node in gm.graph.nodes if _is_segment_call(gm, node)]
    if not segments:
        return PassResult(gm, modified=False)
    _install(gm, _inlined_graph(gm))
    for name in segments:
        delattr(gm, name)
    return PassResult(gm, modified=True)


def without_segments(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule sharing ``gm``'s modules whose graph has the segments inlined; ``gm`` unchanged.

    What reads a segmented model's graph as lowering wrote it (the timm interface's forward_features
    cut) uses this view instead of rewriting the model.
    """
    if not has_segments(gm):
        return gm
    return fx.GraphModule(gm, _inlined_graph(gm), type(gm).__name__)


def _inlined_graph(gm: fx.GraphModule) -> fx.Graph:
    """``gm``'s graph with every segment call replaced by the segment's body."""
    segments = [node for node in gm.graph.nodes if _is_segment_call(gm, node)]
    graph = _empty_like(gm.graph)
    env: dict[fx.Node, fx.Node] = {}
    skip = {a for node in segments for a in node.args if _is_segment_attribute(a)}
    for node in gm.graph.nodes:
        if node in skip or (
            node.op == "call_function" and node.target is operator.getitem and node.args[0] in segments
        ):
            continue
        if node not in segments:
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        segment: Segment = gm.get_submodule(node.target)
        body = segment.body
        placeholders = [n for n in body.nodes if n.op == "placeholder"]
        values = {ph: env[arg] for ph, arg in zip(placeholders, node.args, strict=False)}
        outputs = graph.graph_copy(body, values)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(outputs) == 1:
            env[node] = outputs[0]
        for user in node.users:
            if user.op == "call_function" and user.target is operator.getitem:
                env[user] = outputs[user.args[1]]
    return graph


def has_segments(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` has been through :func:`checkpoint_segments` (and not inlined since)."""
    return any(_is_segment_call(gm, node) for node in gm.graph.nodes)


# -- building a segment ----------------------------------------------------------------------------
def _emit_segment(
    gm: fx.GraphModule, graph: fx.Graph, run: list[fx.Node], env: dict[fx.Node, fx.Node], index: int
) -> None:
    """Write ``run`` into ``graph`` as one segment call; map its used outputs in ``env``."""
    inside = set(run)
    inputs = list(dict.fromkeys(a for node in run for a in node.all_input_nodes if a not in inside))
    outputs = [node for node in run if any(user not in inside for user in node.users)]
    body = fx.Graph()
    body_env: dict[fx.Node, fx.Node] = {}
    for value in inputs:
        body_env[value] = body.placeholder(value.name, type_expr=value.type)
        body_env[value].meta = dict(value.meta)
    for node in run:
        body_env[node] = body.node_copy(node, body_env.__getitem__)
    body.output(tuple(body_env[node] for node in outputs))

    attributes = list(dict.fromkeys(node.target for node in run if node.op in ("get_attr", "call_module")))
    module_args = {
        len(inputs) + i: path
        for i, path in enumerate(attributes)
        if isinstance(_attribute(gm, path), nn.Module)
    }
    name = f"{SEGMENT_PREFIX}{index}"
    gm.add_submodule(name, Segment(body, attributes, module_args).train(gm.training))  # the model's mode
    fetched = []
    for path in attributes:
        node = graph.get_attr(path)
        tag(node, role="segment_attribute")
        fetched.append(node)
    call = graph.call_module(name, (*(env[value] for value in inputs), *fetched))
    tag(call, role="segment")
    if len(outputs) == 1:
        call.meta["tensor_meta"] = outputs[0].meta.get("tensor_meta")
        env[outputs[0]] = call
        return
    for i, node in enumerate(outputs):
        item = graph.call_function(operator.getitem, (call, i))
        item.meta["tensor_meta"] = node.meta.get("tensor_meta")
        env[node] = item


def _runnable_graph(body: fx.Graph, attributes: list[str]) -> fx.Graph:
    """``body`` as a function of ``(inputs..., attributes...)``: fetches and module calls become inputs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    fetched: dict[str, fx.Node] = {}
    for node in body.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
    for i, path in enumerate(attributes):
        fetched[path] = graph.placeholder(f"attribute_{i}")
    for node in body.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            env[node] = fetched[node.target]
        elif node.op == "call_module":
            args = fx.map_arg(node.args, env.__getitem__)
            kwargs = fx.map_arg(node.kwargs, env.__getitem__)
            env[node] = graph.create_node(
                "call_function", call_module, (fetched[node.target], *args), kwargs, name=node.name
            )
        elif node.op == "output":
            values = fx.map_arg(node.args[0], env.__getitem__)
            graph.output(values[0] if len(values) == 1 else values)
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return graph


# -- helpers -----------------------------------------------------------------------------------------
def _attribute(gm: fx.GraphModule, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _calls(gm: fx.GraphModule, node: fx.Node, kind: type[nn.Module]) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), kind)


def _is_segment_call(gm: fx.GraphModule, node: fx.Node) -> bool:
    return _calls(gm, node, Segment)


def _is_segment_attribute(node: object) -> bool:
    return isinstance(node, fx.Node) and node_tag(node).role == "segment_attribute"


def _segment_names(gm: fx.GraphModule):
    return (name for name, module in gm.named_children() if isinstance(module, Segment))


def _empty_like(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    new._codegen = graph._codegen
    return new


def _install(gm: fx.GraphModule, graph: fx.Graph) -> None:
    gm.graph = graph  # the pass contract lints and recompiles
