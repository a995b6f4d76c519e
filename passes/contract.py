"""The pass contract: what a graph pass requires and ensures, checked in one place.

In the spirit of torch.fx's ``PassBase``/``PassManager`` (``requires``/``ensures`` hooks around
``call``) and optimum's ``Transformation`` (``preserves_computation``), each pass declares a
:class:`PassSpec` with :func:`graph_pass`. Calling the decorated function runs it through
:func:`run_pass`, which

* refuses a graph that lacks a required property, or has a forbidden one (a pass out of order);
* for a transformation (``modifies_graph``) does the one ``graph.lint()`` + ``recompile()`` tail;
* for an analysis checks that the graph, its modules and its tensors (their identity, shape, dtype
  and in-place version counter) are unchanged: analyses write to ``node.meta`` and their return
  value only;
* checks that every ensured property holds (each :class:`~odeify.passes.properties.Property` has a
  cheap check of the graph itself), then records the graph's properties in ``gm.meta``.

Properties are the named constants of :mod:`odeify.passes.properties`; a declaration naming
anything else is refused when the module defining the pass is imported. The pipelines that run the
passes in order are in :mod:`odeify.compiler.pipeline`. ``tests/test_passes.py`` checks every
transformation declaring ``preserves_computation`` against eager output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch.fx as fx

from odeify.passes.properties import PROPERTIES, Property

PROPERTIES_KEY = "odeify_properties"
"""``gm.meta`` key: the names of the properties the graph has (survives ``copy.deepcopy``)."""

P = ParamSpec("P")
R = TypeVar("R")


class PassContractError(RuntimeError):
    """A pass was applied to a graph it does not accept, or broke its own declaration."""


@dataclass(frozen=True)
class PassSpec:
    """What a graph pass needs, what it guarantees, and what kind of pass it is.

    ``forbids`` names properties the graph must not have (raising stages needs the segments inlined
    first); ``invalidates`` names properties a transformation destroys (folding BN erases nodes the
    block tags named); ``preserves_computation`` says the module's output is unchanged (to
    round-off); ``modifies_graph`` is False for analyses, which the runner holds to read-only.
    """

    name: str
    preserves_computation: bool
    modifies_graph: bool
    requires: frozenset[Property] = frozenset()
    ensures: frozenset[Property] = frozenset()
    invalidates: frozenset[Property] = frozenset()
    forbids: frozenset[Property] = frozenset()

    def __post_init__(self) -> None:
        if not self.modifies_graph and (self.invalidates or not self.preserves_computation):
            raise ValueError(f"analysis pass {self.name!r} cannot invalidate properties or change output")
        for prop in self.requires | self.ensures | self.invalidates | self.forbids:
            if PROPERTIES.get(getattr(prop, "name", None)) is not prop:
                raise ValueError(
                    f"pass {self.name!r} names {prop!r}, which is not in odeify.passes.properties"
                )

    def after(self, have: frozenset[Property]) -> frozenset[Property]:
        """The properties a graph that had ``have`` has after this pass."""
        return (have - self.invalidates) | self.ensures

    def refusal(self, have: frozenset[Property]) -> str | None:
        """Why this pass cannot run on a graph with properties ``have``, or None."""
        missing = sorted(p.name for p in self.requires - have)
        present = sorted(p.name for p in self.forbids & have)
        if not (missing or present):
            return None
        why = [f"requires {', '.join(missing)}"] if missing else []
        why += [f"forbids {', '.join(present)}"] if present else []
        needed = "; ".join(f"{p.name}: {p.meaning}" for p in sorted(self.requires - have, key=str))
        return (
            f"pass {self.name!r} {' and '.join(why)}; the graph has "
            f"{', '.join(sorted(p.name for p in have)) or 'none'}" + (f" ({needed})" if needed else "")
        )


def analysis(name: str, *, requires: Iterable[Property] = (), ensures: Iterable[Property] = ()) -> PassSpec:
    """The declaration of an analysis: reads the graph, writes ``node.meta`` and its return value only."""
    return PassSpec(name, True, False, frozenset(requires), frozenset(ensures))


def transformation(
    name: str,
    *,
    preserves_computation: bool = True,
    requires: Iterable[Property] = (),
    ensures: Iterable[Property] = (),
    invalidates: Iterable[Property] = (),
    forbids: Iterable[Property] = (),
) -> PassSpec:
    """The declaration of a pass that rewrites the graph (by default, without changing its output)."""
    sets = (frozenset(requires), frozenset(ensures), frozenset(invalidates), frozenset(forbids))
    return PassSpec(name, preserves_computation, True, *sets)


def graph_properties(gm: fx.GraphModule) -> frozenset[Property]:
    """The properties recorded on ``gm`` by the passes run on it so far."""
    return frozenset(PROPERTIES[name] for name in gm.meta.get(PROPERTIES_KEY, ()) if name in PROPERTIES)


def run_pass(spec: PassSpec, fn: Callable[..., R], gm: fx.GraphModule, *args, **kwargs) -> R:
    """Run ``fn(gm, *args, **kwargs)`` under ``spec``'s contract (see the module docstring)."""
    have = graph_properties(gm)
    refused = spec.refusal(have)
    if refused:
        raise PassContractError(refused + "; run the passes that ensure it first (odeify.compiler.pipeline)")
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
    broken = sorted(p.name for p in spec.ensures if not p.holds(gm))
    if broken:
        raise PassContractError(
            f"pass {spec.name!r} ensures {', '.join(broken)}, which does not hold after it"
        )
    gm.meta[PROPERTIES_KEY] = sorted(p.name for p in spec.after(have))
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
    Tensors compare by identity, shape, dtype and version counter, so an in-place ``mul_`` shows.
    """
    graph = tuple((n, n.name, n.op, n.target, n.args, dict(n.kwargs)) for n in gm.graph.nodes)
    modules = tuple((name, id(m)) for name, m in gm.named_modules(remove_duplicate=False))
    tensors = tuple(
        (name, id(t), t._version, tuple(t.shape), t.dtype)
        for name, t in [
            *gm.named_parameters(remove_duplicate=False),
            *gm.named_buffers(remove_duplicate=False),
        ]
    )
    return graph, modules, tensors
