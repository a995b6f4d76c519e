"""Graphviz DOT of an analysed fx graph: each run of identity blocks drawn as one cluster.

The picture answers "what will become an ODE stage": run members sit in a ``cluster_run_*``
subgraph labelled with the run name and block count, blocks that stay discrete are shaded, and
each residual skip (fork -> join) is dashed. Parameter reads (``get_attr``) are left out; the
consuming node names the module they belong to.

Why not ``torch.fx.passes.graph_drawer.FxGraphDrawer``: it needs ``pydot`` (not a dependency of
odeify) to build the graph, has no notion of clusters, so runs and stages cannot be grouped, and
labels every node with its full target, args and tensor metadata, which makes a resnet152 picture
unreadable. The DOT text here is a few lines of string formatting with no extra dependency.
"""

from __future__ import annotations

import torch.fx as fx

from odeify.core.words import plural
from odeify.ir.meta import node_tag
from odeify.ir.plan import Plan
from odeify.passes.tracing import node_shape


def plan_to_dot(gm: fx.GraphModule, plan: Plan) -> str:
    """The DOT source for ``gm`` after ``analyze_graph`` annotated it with ``plan``."""
    blocks = {block.index: block for block in plan.blocks}
    discrete = {item.block.index for item in plan.discrete}
    drawn = [n for n in gm.graph.nodes if n.op != "get_attr"]
    members: dict[str, list[fx.Node]] = {run.name: [] for run in plan.runs}
    outside: list[fx.Node] = []
    for node in drawn:
        run = node_tag(node).run
        (members[run] if run in members else outside).append(node)

    lines = [
        f"digraph {_quote(plan.model)} {{",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica", fontsize=10];',
        '  edge [color="#555555"];',
    ]
    for node in outside:
        block = node_tag(node).block
        fill = "#dddddd" if block in discrete else None
        lines.append("  " + _node_line(gm, node, fill))
    for index, run in enumerate(plan.runs):
        label = f"{run.name} ({run.length} block{'s' if run.length != 1 else ''})"
        if run.period > 1:  # a transformer's attention and MLP halves: length periods of p blocks
            label = f"{run.name} ({run.length} x {run.period} blocks)"
        lines.append(f"  subgraph cluster_run_{index} {{")
        lines.append(f'    label={_quote(label)}; style=rounded; bgcolor="#e8f0fe"; color="#4a72c4";')
        lines.extend("    " + _node_line(gm, node, None) for node in members[run.name])
        lines.append("  }")
    shown = {n.name for n in drawn}
    for node in drawn:
        node_meta = node_tag(node)
        fork = blocks[node_meta.block].fork if node_meta.role == "join" else None
        for source in node.all_input_nodes:
            if source.name in shown:
                style = " [style=dashed]" if source.name == fork else ""
                lines.append(f"  {_quote(source.name)} -> {_quote(node.name)}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def converted_to_dot(gm: fx.GraphModule, title: str) -> str:
    """The DOT source of a converted model: each ODE stage's nodes (its unrolled steps, or the one
    call a memory-free stage makes) in a cluster labelled with the stage's manifestation."""
    from odeify.compiler.conversion import converted_stages

    stages = {stage.stage_name: stage for stage in converted_stages(gm)}
    drawn = [n for n in gm.graph.nodes if n.op != "get_attr"]
    members: dict[str, list[fx.Node]] = {name: [] for name in stages}
    outside: list[fx.Node] = []
    for node in drawn:
        stage = node_tag(node).stage
        (members[stage] if stage in members else outside).append(node)
    lines = [
        f"digraph {_quote(title)} {{",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica", fontsize=10];',
        '  edge [color="#555555"];',
    ]
    lines.extend("  " + _node_line(gm, node, None) for node in outside)
    for index, (name, stage) in enumerate(stages.items()):
        label = (
            f"{name}: {stage.integrator.name}, {plural(stage.steps, 'step')}, "
            f"{plural(stage.num_knots, stage.basis + ' knot')}, backward {stage.backward}"
        )
        lines.append(f"  subgraph cluster_stage_{index} {{")
        lines.append(f'    label={_quote(label)}; style=rounded; bgcolor="#e8f0fe"; color="#4a72c4";')
        lines.extend("    " + _node_line(gm, node, None) for node in members[name])
        lines.append("  }")
    shown = {n.name for n in drawn}
    for node in drawn:
        for source in node.all_input_nodes:
            if source.name in shown:
                lines.append(f"  {_quote(source.name)} -> {_quote(node.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node_line(gm: fx.GraphModule, node: fx.Node, fill: str | None) -> str:
    """One node statement: name, short op name and shape."""
    shape = node_shape(node)
    op = _short_op(gm, node)
    parts = [node.name, op if op != node.name else "", "x".join(map(str, shape[1:])) if shape else ""]
    label = "\n".join(part for part in parts if part)
    extra = f", fillcolor={_quote(fill)}" if fill else ""
    return f"{_quote(node.name)} [label={_quote(label)}{extra}];"


def _short_op(gm: fx.GraphModule, node: fx.Node) -> str:
    """'Conv2d', 'conv2d(layer1.0.conv1)', 'add', 'mean' ...: what the node computes, briefly."""
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        params = [a.target.rsplit(".", 1)[0] for a in node.all_input_nodes if a.op == "get_attr"]
        return f"{name}({params[0]})" if params else name
    if node.op == "call_method":
        return f".{node.target}()"
    return node.op


def _quote(text: str) -> str:
    """A DOT double-quoted string; newlines become DOT line breaks."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\n").replace("\n", "\\n")
    return f'"{escaped}"'
