"""The pass contract: what a graph pass requires and ensures, checked in one place.

In the spirit of torch.fx's ``PassBase``/``PassManager`` (``requires``/``ensures`` hooks around
``call``) and optimum's ``Transformation`` (``preserves_computation``), each pass declares a
:class:`PassSpec` with :func:`graph_pass`. Calling the decorated function runs it through
:func:`run_pass`, which

* refuses a graph that lacks a required property (a pass applied out of order);
* for a transformation (``modifies_graph``) does the one ``graph.lint()`` + ``recompile()`` tail;
* for an analysis checks that the graph, its modules and its tensors are unchanged afterwards:
  analyses write their results to ``node.meta`` and their return value only;
* records the properties the graph now has in ``gm.meta[PROPERTIES_KEY]``.

Properties are plain names: ``shapes`` (every node carries ``tensor_meta``), ``bn_folded``,
``blocks`` and ``runs`` (the analysis tags in ``node.meta``), ``lifted`` (runs are stage calls).
``tests/test_passes.py`` checks every transformation declaring ``preserves_computation`` against
eager output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch.fx as fx

PROPERTIES_KEY = "odeify_properties"
"""``gm.meta`` key: the set of properties the graph has (survives ``copy.deepcopy``)."""

P = ParamSpec("P")
R = TypeVar("R")


class PassContractError(RuntimeError):
    """A pass was applied to a graph it does not accept, or broke its own declaration."""


@dataclass(frozen=True)
class PassSpec:
    """What a graph pass needs, what it guarantees, and what kind of pass it is.

    ``invalidates`` names properties a transformation destroys (folding BN erases nodes the block
    tags named); ``preserves_computation`` says the module's output is unchanged (to round-off);
    ``modifies_graph`` is False for analyses, which the runner holds to read-only.
    """

    name: str
    preserves_computation: bool
    modifies_graph: bool
    requires: frozenset[str] = frozenset()
    ensures: frozenset[str] = frozenset()
    invalidates: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.modifies_graph and (self.invalidates or not self.preserves_computation):
            raise ValueError(f"analysis pass {self.name!r} cannot invalidate properties or change output")


def graph_properties(gm: fx.GraphModule) -> frozenset[str]:
    """The properties recorded on ``gm`` by the passes run on it so far."""
    return frozenset(gm.meta.get(PROPERTIES_KEY, ()))


def run_pass(spec: PassSpec, fn: Callable[..., R], gm: fx.GraphModule, *args, **kwargs) -> R:
    """Run ``fn(gm, *args, **kwargs)`` under ``spec``'s contract (see the module docstring)."""
    have = graph_properties(gm)
    missing = sorted(spec.requires - have)
    if missing:
        raise PassContractError(
            f"pass {spec.name!r} requires {', '.join(missing)} on the graph, which has "
            f"{', '.join(sorted(have)) or 'none'}; run the pass that ensures it first "
            "(shapes: odeify.passes.tracing.annotate_shapes; blocks/runs: "
            "odeify.compiler.analysis.analyze_graph)."
        )
    before = None if spec.modifies_graph else _fingerprint(gm)
    result = fn(gm, *args, **kwargs)
    if spec.modifies_graph:
        gm.graph.lint()
        gm.recompile()
    elif _fingerprint(gm) != before:
        raise PassContractError(
            f"analysis pass {spec.name!r} changed the graph, its modules or its tensors; analyses may "
            "write node.meta only. Declare it modifies_graph=True or leave the graph alone."
        )
    gm.meta[PROPERTIES_KEY] = sorted((have - spec.invalidates) | spec.ensures)
    return result


def graph_pass(spec: PassSpec) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Declare ``spec`` for a pass function whose first argument is the GraphModule.

    The decorated function runs through :func:`run_pass`; ``fn.pass_spec`` is the declaration.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(gm: fx.GraphModule, *args, **kwargs) -> R:
            return run_pass(spec, fn, gm, *args, **kwargs)

        wrapper.pass_spec = spec  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def _fingerprint(gm: fx.GraphModule) -> tuple:
    """What an analysis must leave alone: the graph's nodes and edges, the module tree, the tensors.

    Nodes compare by identity and their (immutable) args by value: cheaper than the graph's text.
    """
    graph = tuple((n, n.name, n.op, n.target, n.args, dict(n.kwargs)) for n in gm.graph.nodes)
    modules = tuple((name, id(m)) for name, m in gm.named_modules(remove_duplicate=False))
    tensors = tuple(
        (name, id(t))
        for name, t in [
            *gm.named_parameters(remove_duplicate=False),
            *gm.named_buffers(remove_duplicate=False),
        ]
    )
    return graph, modules, tensors
