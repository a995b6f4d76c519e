"""The properties a graph can have, as named constants, each with a cheap check that it holds.

A pass declares which properties it requires, which it forbids, which it ensures and which it
invalidates (:class:`odeify.passes.contract.PassSpec`); the contract's runner checks ``requires``
and ``forbids`` against the properties recorded on the graph before the pass, and runs each ensured
property's check after it. The checks look at the graph itself (node tags, submodules), so a pass
that claims a property it did not establish is caught where it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx
from torch.nn.modules.batchnorm import _BatchNorm

from odeify.ir.meta import node_tag
from odeify.ir.stage_ir import StageIR

__all__ = [
    "BLOCKS",
    "BN_FOLDED",
    "LOWERED",
    "PROPERTIES",
    "RUNS",
    "SEGMENTS",
    "SHAPES",
    "STAGE_CALLS",
    "Property",
]


@dataclass(frozen=True)
class Property:
    """A fact about a graph: its name (recorded on ``gm.meta``), what it means, and its check."""

    name: str
    meaning: str
    holds: Callable[[fx.GraphModule], bool]

    def __str__(self) -> str:
        return self.name


def _has_shapes(gm: fx.GraphModule) -> bool:
    """The model's inputs carry tensor_meta: what annotation writes first. (Nodes whose value is no
    tensor, such as ``x.size()``, get none, so the check cannot ask it of every node.)"""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return bool(placeholders) and all("tensor_meta" in n.meta for n in placeholders)


def _bn_folded(gm: fx.GraphModule) -> bool:
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    return not any(isinstance(gm.get_submodule(t), _BatchNorm) for t in called)


def _blocks_tagged(gm: fx.GraphModule) -> bool:
    """Every node with a block role names its block."""
    tags = [node_tag(n) for n in gm.graph.nodes]
    return all(t.block is not None for t in tags if t.role in ("branch", "join", "output"))


def _runs_tagged(gm: fx.GraphModule) -> bool:
    """Every node tagged with a run belongs to a block."""
    return all(node_tag(n).block is not None for n in gm.graph.nodes if node_tag(n).run is not None)


def _stage_calls(gm: fx.GraphModule) -> dict[str, int]:
    """How many ``call_module`` nodes call each ODE stage submodule."""
    calls = {name: 0 for name, m in gm.named_children() if isinstance(m, StageIR)}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in calls:
            calls[node.target] += 1
    return calls


def _inlined_stages(gm: fx.GraphModule) -> set[str]:
    """Stage names that nodes of the graph implement inline (written by the code generator)."""
    return {t.stage for t in map(node_tag, gm.graph.nodes) if t.stage is not None and t.role != "stage"}


def _one_call_per_stage(gm: fx.GraphModule) -> bool:
    return all(count == 1 for count in _stage_calls(gm).values()) and not _inlined_stages(gm)


def _backprop_stages_inlined(gm: fx.GraphModule) -> bool:
    calls, inlined = _stage_calls(gm), _inlined_stages(gm)
    for attribute, count in calls.items():
        stage = gm.get_submodule(attribute)
        unrolled = stage.backward == "backprop"
        if count != (0 if unrolled else 1) or (stage.stage_name in inlined) != unrolled:
            return False
    return True


def _has_segments(gm: fx.GraphModule) -> bool:
    return any(node_tag(n).role == "segment" for n in gm.graph.nodes)


SHAPES = Property("shapes", "nodes carry tensor_meta (passes.tracing.annotate_shapes)", _has_shapes)
BN_FOLDED = Property("bn_folded", "no BatchNorm module is called (passes.fold_bn)", _bn_folded)
BLOCKS = Property(
    "blocks", "residual blocks are tagged in node.meta (passes.residual_blocks)", _blocks_tagged
)
RUNS = Property("runs", "runs of blocks are tagged in node.meta (passes.runs)", _runs_tagged)
STAGE_CALLS = Property(
    "stage_calls",
    "every ODE stage is one call_module node (passes.lift.lift_runs, passes.lower.raise_stages)",
    _one_call_per_stage,
)
LOWERED = Property(
    "lowered",
    "every backprop stage is unrolled into the graph, the others are calls (passes.lower.lower_stages)",
    _backprop_stages_inlined,
)
SEGMENTS = Property(
    "segments",
    "the parts between stages are checkpointed segments (passes.segments.checkpoint_segments)",
    _has_segments,
)

PROPERTIES: dict[str, Property] = {
    p.name: p for p in (SHAPES, BN_FOLDED, BLOCKS, RUNS, STAGE_CALLS, LOWERED, SEGMENTS)
}
"""Every property a pass may name, by name: the registry a declaration is checked against."""
