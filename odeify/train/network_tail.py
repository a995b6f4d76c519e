"""The rest of a network after its last stage: the model's output as a function of that stage's output.

Calibration's ``objective="output"`` fits the last stage to what the network outputs, not only to
the stage's activation: a ViT's head reads the class token alone, so a stage loss spends 64 of its
65 tokens' worth of effort on what the output never sees. This module cuts the graph that computes
the output from the stage's output (the final norm, pooling and head), and nothing else.
"""

from __future__ import annotations

import torch.fx as fx

from odeify.runtime.stage import ODEStage

__all__ = ["graph_from", "network_tail"]


def network_tail(model: fx.GraphModule, path: str) -> fx.GraphModule | None:
    """A graph module ``h -> model output`` for the stage called at module ``path``, where ``h`` is
    that stage's output; None where the output depends on more than ``h`` (a value from before the
    stage other than a parameter or buffer, or another stage after it: the tail would then run
    stages, and calibration keeps a stage's fit local to it).

    ``model`` must call the stage as a module (calibration's copy with ``checkpoint`` stages)."""
    nodes = list(model.graph.nodes)
    calls = [i for i, n in enumerate(nodes) if n.op == "call_module" and n.target == path]
    if len(calls) != 1:
        return None
    stage_node, after = nodes[calls[0]], nodes[calls[0] + 1 :]
    if any(n.op == "call_module" and isinstance(model.get_submodule(n.target), ODEStage) for n in after):
        return None
    copy = graph_from(stage_node, after)  # the output node included
    return None if copy is None else fx.GraphModule(model, copy[0])


def graph_from(start: fx.Node, nodes: list[fx.Node]) -> tuple[fx.Graph, dict[fx.Node, fx.Node]] | None:
    """A new graph that takes ``start``'s value as its input (``stage_output``) and computes ``nodes``,
    with the copy of each node; None where a value from before ``start`` other than a parameter or
    buffer crosses into them."""
    graph = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {start: graph.placeholder("stage_output")}
    for node in nodes:
        for used in node.all_input_nodes:
            if used not in copied:
                if used.op != "get_attr":
                    return None  # a value from before the stage crosses it
                copied[used] = graph.node_copy(used)
        copied[node] = graph.node_copy(node, lambda used: copied[used])
    return graph, copied
