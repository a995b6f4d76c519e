"""The pass contract: what a graph pass requires, ensures and may change, checked in one place.

In the spirit of torch.fx's ``PassBase``/``PassManager`` (``requires``/``ensures`` hooks around
``call``, and one result type, ``PassResult(graph_module, modified)``) and optimum's
``Transformation`` (``preserves_computation``), each pass declares a :class:`PassSpec` with
:func:`graph_pass`, which attaches it to the function (``fn.pass_spec``: what a pipeline's ``Step``
reads). Every pass returns a :class:`PassResult`; an analysis carries its findings in ``value``.
Calling the decorated function runs it through :func:`run_pass`, which

* refuses a graph that lacks a required property, or has a forbidden one (a pass out of order);
* holds the pass to its :class:`PassKind`: a transformation gets the one ``graph.lint()`` +
  ``recompile()`` tail; an analysis must leave the graph, its modules, its tensors (their identity,
  shape, dtype and in-place version counter), the module's class and ``gm.meta`` unchanged (it
  writes ``node.meta`` and its result only); a module record may change the class and ``gm.meta``
  but nothing else;
* checks that every ensured property holds (each :class:`~odeify.passes.properties.Property` has a
  cheap check of the graph itself), then records the graph's properties in ``gm.meta``.

Properties are the named constants of :mod:`odeify.passes.properties`; a declaration naming
anything else is refused when the module defining the pass is imported. The pipelines that run the
passes in order are in :mod:`odeify.compiler.pipeline`. ``tests/test_passes.py`` checks every
transformation declaring ``preserves_computation`` against eager output.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import torch.fx as fx
from torch import nn

from odeify.passes.properties import PROPERTIES, Property

PROPERTIES_KEY = "odeify_properties"
"""``gm.meta`` key: the names of the properties the graph has (survives ``copy.deepcopy``)."""


class PassContractError(RuntimeError):
    """A pass was applied to a graph it does not accept, or broke its own declaration."""


class PassKind(Enum):
    """What a pass may change; the runner holds it to that."""

    ANALYSIS = "analysis"
    """Reads the graph module: writes ``node.meta`` and its result's ``value`` only."""
    MODULE_RECORD = "module record"
    """Writes ``gm.meta`` and may give the module a new class; its graph, submodules and tensors stay."""
    TRANSFORMATION = "transformation"
    """Rewrites the graph (or, tracing, creates it)."""


class PassResult(NamedTuple):
    """What every pass returns: torch.fx's ``PassResult(graph_module, modified)``, plus ``value``.

    ``graph_module`` is the module the pass leaves (the one it was given, or the one it created);
    ``modified`` whether the pass changed it; ``value`` what the pass found or the caller needs
    besides (an analysis's blocks or runs, the runs a lift left discrete), None when nothing.
    """

    graph_module: fx.GraphModule
    modified: bool
    value: Any = None


GraphPass = Callable[..., PassResult]
"""A pass function: takes the module it reads (and what else it needs), returns a PassResult."""


@dataclass(frozen=True)
class PassSpec:
    """What a graph pass needs, what it guarantees, and what kind of pass it is.

    ``forbids`` names properties the graph must not have (raising stages needs the segments inlined
    first); ``invalidates`` names properties a transformation destroys (folding BN erases nodes the
    block tags named); ``preserves_computation`` says the module's output is unchanged (to
    round-off); ``kind`` says what the pass may change (:class:`PassKind`).
    """

    name: str
    kind: PassKind
    preserves_computation: bool = True
    requires: frozenset[Property] = frozenset()
    ensures: frozenset[Property] = frozenset()
    invalidates: frozenset[Property] = frozenset()
    forbids: frozenset[Property] = frozenset()

    def __post_init__(self) -> None:
        if self.kind is not PassKind.TRANSFORMATION and (self.invalidates or not self.preserves_computation):
            raise ValueError(
                f"{self.kind.value} pass {self.name!r} cannot invalidate properties or change output"
            )
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
    """The declaration of an analysis: reads the graph, writes ``node.meta`` and its result only."""
    return PassSpec(name, PassKind.ANALYSIS, requires=frozenset(requires), ensures=frozenset(ensures))


def module_record(
    name: str, *, requires: Iterable[Property] = (), ensures: Iterable[Property] = ()
) -> PassSpec:
    """The declaration of a pass that writes ``gm.meta`` and may change the module's class, nothing else."""
    return PassSpec(name, PassKind.MODULE_RECORD, requires=frozenset(requires), ensures=frozenset(ensures))


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
    return PassSpec(name, PassKind.TRANSFORMATION, preserves_computation, *sets)


def graph_properties(module: nn.Module) -> frozenset[Property]:
    """The properties recorded on ``module`` by the passes run on it so far (none on a plain module)."""
    meta = getattr(module, "meta", None)
    names = meta.get(PROPERTIES_KEY, ()) if isinstance(meta, dict) else ()
    return frozenset(PROPERTIES[name] for name in names if name in PROPERTIES)


def run_pass(spec: PassSpec, fn: GraphPass, module: nn.Module, *args, **kwargs) -> PassResult:
    """Run ``fn(module, *args, **kwargs)`` under ``spec``'s contract (see the module docstring).

    ``module`` is the graph module the pass reads, or the model tracing creates one from.
    """
    have = graph_properties(module)
    refused = spec.refusal(have)
    if refused:
        raise PassContractError(refused + "; run the passes that ensure it first (odeify.compiler.pipeline)")
    rewrites = spec.kind is PassKind.TRANSFORMATION
    before = None if rewrites else _fingerprint(module, spec.kind)
    result = fn(module, *args, **kwargs)
    if not isinstance(result, PassResult):
        raise PassContractError(f"pass {spec.name!r} returned {type(result).__name__}, not a PassResult")
    gm = result.graph_module
    if rewrites:
        gm.graph.lint()
        gm.recompile()
    elif gm is not module or _fingerprint(gm, spec.kind) != before:
        if spec.kind is PassKind.ANALYSIS:
            changed, allowed = "its tensors, the module's class or gm.meta", "node.meta"
        else:
            changed, allowed = "or its tensors", "gm.meta and the module's class"
        raise PassContractError(
            f"{spec.kind.value} pass {spec.name!r} changed the graph, its modules {changed} (or returned "
            f"another module); it may write {allowed} only. Declare what it changes "
            "(odeify.passes.contract.PassKind) or leave the rest alone."
        )
    broken = sorted(p.name for p in spec.ensures if not p.holds(gm))
    if broken:
        raise PassContractError(
            f"pass {spec.name!r} ensures {', '.join(broken)}, which does not hold after it"
        )
    gm.meta[PROPERTIES_KEY] = sorted(p.name for p in spec.after(graph_properties(gm)))
    return result


def graph_pass(spec: PassSpec) -> Callable[[GraphPass], GraphPass]:
    """Declare ``spec`` for a pass function whose first argument is the module it reads.

    The decorated function runs through :func:`run_pass`; ``fn.pass_spec`` is the declaration, which
    a pipeline's ``Step`` reads from the function it runs.
    """

    def decorate(fn: GraphPass) -> GraphPass:
        @functools.wraps(fn)
        def wrapper(module: nn.Module, *args, **kwargs) -> PassResult:
            return run_pass(spec, fn, module, *args, **kwargs)

        wrapper.pass_spec = spec  # type: ignore[attr-defined]
        return wrapper

    return decorate


def _fingerprint(gm: fx.GraphModule, kind: PassKind) -> tuple:
    """What a pass of ``kind`` must leave alone: the graph's nodes and edges, the module tree, the
    tensors, and (an analysis) the module's class and ``gm.meta``.

    Nodes compare by identity and their (immutable) args by value: cheaper than the graph's text.
    Tensors compare by identity, shape, dtype and version counter, so an in-place ``mul_`` shows.
    ``gm.meta`` (plain data) compares by value, from a deep copy, so a nested write shows too.
    """
    nodes = tuple((n, n.name, n.op, n.target, n.args, dict(n.kwargs)) for n in gm.graph.nodes)
    modules = tuple((name, id(m)) for name, m in gm.named_modules(remove_duplicate=False))
    tensors = tuple(
        (name, id(t), t._version, tuple(t.shape), t.dtype)
        for name, t in [
            *gm.named_parameters(remove_duplicate=False),
            *gm.named_buffers(remove_duplicate=False),
        ]
    )
    if kind is PassKind.MODULE_RECORD:
        return nodes, modules, tensors
    return nodes, modules, tensors, type(gm), copy.deepcopy(gm.meta)
