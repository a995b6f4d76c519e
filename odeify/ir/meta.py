"""The one schema of ``node.meta["odeify"]``: a typed, frozen :class:`NodeTag` per fx node.

Analyses (``find_blocks``, ``group_runs``) tag the nodes of a traced model with the residual
block, role and run they belong to; the code generator and the ``lift``/``lower``/``segments``
passes tag the nodes they write with the stage (or segment) they implement. Every writer and
reader goes through :func:`tag` and :func:`node_tag`, so the fields are checked names, not string
keys spread over modules. A frozen dataclass survives ``copy.deepcopy`` of the graph module.

The graph module's own record (``gm.meta["odeify"]``: what rebuilds a converted model) is the
conversion recipe of :mod:`odeify.serialization.file_recipe`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch.fx as fx

META_KEY = "odeify"

Role = Literal["branch", "join", "output", "stage", "segment", "segment_attribute"]


@dataclass(frozen=True)
class NodeTag:
    """What odeify knows about one node. Unset fields are None.

    ``block``: index of the residual block the node belongs to (analysis). ``role``: the node's part
    in it (``branch``, ``join``, ``output``), or ``stage`` for the call of an ODE stage, ``segment``
    for the call of a recomputed segment and ``segment_attribute`` for a weight read inside one.
    ``run``: the run of blocks that becomes a stage (analysis). ``stage``: the stage whose
    computation the node is part of (code generation). ``head``: the node computes timm's
    ``forward_head`` (``passes.head.mark_head``), so ``forward_features`` can cut the graph there.
    """

    block: int | None = None
    role: Role | None = None
    run: str | None = None
    stage: str | None = None
    head: bool | None = None


def node_tag(node: fx.Node) -> NodeTag:
    """The node's tag, or an empty one."""
    found = node.meta.get(META_KEY)
    return found if isinstance(found, NodeTag) else NodeTag()


def tag(node: fx.Node, **fields: object) -> NodeTag:
    """Set ``fields`` on the node's tag (other fields kept) and return the new tag."""
    new = dataclasses.replace(node_tag(node), **fields)
    node.meta[META_KEY] = new
    return new


def untag(node: fx.Node) -> None:
    """Forget what odeify knew about the node (an analysis that runs again starts clean)."""
    node.meta.pop(META_KEY, None)
