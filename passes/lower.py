"""Transformation passes between the two forms of a converted model.

``lower_stages`` inlines each ``StageIR`` call into an unrolled graph for its integrator and
steps; stages trained with a memory-saving backward mode stay one node, which calls the adjoint.
``raise_stages`` is the inverse: it collapses inlined stages back into single calls, so a
converted model can be re-emitted for another manifestation without the original network. It
forbids checkpointed segments (:mod:`odeify.passes.segments`): a pipeline inlines them first, so
that retarget, save and set_backward see the graph as lowering wrote it.
"""

from __future__ import annotations

import torch.fx as fx

from odeify.codegen.emit import StageWriter, write_stage
from odeify.ir.meta import node_tag, tag
from odeify.ir.stage_ir import StageIR
from odeify.passes.contract import PassResult, graph_pass, transformation
from odeify.passes.properties import LOWERED, SEGMENTS, SHAPES, STAGE_CALLS

LOWER_STAGES = transformation(
    "lower_stages",
    requires={STAGE_CALLS},
    ensures={LOWERED},
    invalidates={STAGE_CALLS, SHAPES},  # emitted nodes carry no tensor_meta
    forbids={SEGMENTS},
)
RAISE_STAGES = transformation(
    "raise_stages",
    requires={LOWERED},
    ensures={STAGE_CALLS},
    invalidates={LOWERED},
    forbids={SEGMENTS},  # inline them first: passes.segments.inline_segments
)


def stage_nodes(gm: fx.GraphModule) -> list[tuple[fx.Node, StageIR]]:
    """The ``call_module`` nodes of ``gm`` that call an StageIR."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if isinstance(module, StageIR):
                found.append((node, module))
    return found


@graph_pass(LOWER_STAGES)
def lower_stages(gm: fx.GraphModule) -> PassResult:
    """Unroll every ``backprop`` stage of ``gm`` in place; modified if there was one."""
    lowered = False
    for node, stage in stage_nodes(gm):
        if stage.backward != "backprop":
            continue
        with gm.graph.inserting_before(node):
            inputs = dict(zip(stage.inputs, node.args[1:], strict=True))
            out = write_stage(StageWriter(stage, gm.graph, node.target, inputs=inputs), node.args[0])
        out.meta["tensor_meta"] = node.meta.get("tensor_meta")
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        stage.inlined = True
        lowered = True
    return PassResult(gm, modified=lowered)


@graph_pass(RAISE_STAGES)
def raise_stages(gm: fx.GraphModule) -> PassResult:
    """Collapse every inlined stage of ``gm`` back into one ``call_module`` node, in place."""
    stages = {m.stage_name: name for name, m in gm.named_children() if isinstance(m, StageIR)}
    for stage_name, attribute in stages.items():
        members = [n for n in gm.graph.nodes if _inlined(n, stage_name)]
        gm.get_submodule(attribute).inlined = False
        if not members:
            continue  # already a single call (non-backprop stage)
        inside = set(members)
        inputs = {a.name: a for n in members for a in n.all_input_nodes if a not in inside}
        constants = [inputs.pop(name, None) for name in gm.get_submodule(attribute).inputs]
        outputs = [n for n in members if any(u not in inside for u in n.users)]
        if len(inputs) != 1 or len(outputs) != 1 or None in constants:
            raise RuntimeError(f"stage '{stage_name}' is not a single-entry, single-exit region of the graph")
        (x,), (out,) = tuple(inputs.values()), outputs
        with gm.graph.inserting_before(out):
            call = gm.graph.call_module(attribute, (x, *constants))
        tag(call, stage=stage_name, role="stage")
        call.meta["tensor_meta"] = out.meta.get("tensor_meta")
        out.replace_all_uses_with(call)
        for node in reversed(members):
            gm.graph.erase_node(node)
    _fresh_namespace(gm)
    return PassResult(gm, modified=True)


def _fresh_namespace(gm: fx.GraphModule) -> None:
    """Copy the graph so names freed by erased nodes can be reused (fx never releases a name)."""
    graph = fx.Graph(owning_module=gm)
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    gm.graph = graph


def _inlined(node: fx.Node, stage_name: str) -> bool:
    meta = node_tag(node)
    return meta.stage == stage_name and meta.role != "stage"
