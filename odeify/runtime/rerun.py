"""Shared pieces of the backward passes that re-run graphs: parameter gradients and the forward's context.

A re-run graph takes only the rows of each knot stack it reads (``graph.knot_window``), so its
knot inputs are fresh leaves over those rows and its gradients land in just those rows of the
accumulators: one step of a K-knot stage costs its own knots in backward, not all K.

:class:`ForwardContext` is what both memory-free autograd Functions (``odeify.runtime.adjoint`` and
``odeify.runtime.reversible``) keep from their forward so that backward re-runs see the same mixed
precision and random draws, and leave the global RNG stream as backprop would.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from odeify.runtime.rng_tape import Generators, Tape, record, replay


def knot_window_inputs(graph: fx.GraphModule, knots: Sequence[Tensor]) -> list[Tensor]:
    """The knot inputs of a step or field graph: each stack's rows ``graph.knot_window``."""
    window = graph.knot_window
    return [k if (window.start, window.stop) == (0, len(k)) else k[window] for k in knots]


@dataclass
class Rerun:
    """The parameter inputs of one re-run: ``knots`` to pass to the graph, ``wrt`` to differentiate."""

    window: slice
    knots: list[Tensor]
    wrt: list[Tensor]


class ParamGrads:
    """Accumulates one backward pass's gradients for the knot stacks and other trainable parameters.

    ``params`` are the Function's parameter inputs (the knot stacks, then the stage's other trainable
    parameters, which graphs read themselves); ``needs`` says which of them want a gradient.
    """

    def __init__(self, params: Sequence[Tensor], num_knots: int, needs: Sequence[bool]) -> None:
        self.knots = [k.detach() for k in params[:num_knots]]
        self.knot_needs = list(needs[:num_knots])
        self.extras = [p for p, need in zip(params[num_knots:], needs[num_knots:], strict=True) if need]
        self.needs = list(needs)
        pairs = zip(self.knots, self.knot_needs, strict=True)
        self.knot_grads = [torch.zeros_like(k) if need else None for k, need in pairs]
        self.extra_grads = [torch.zeros_like(p) for p in self.extras]

    def rerun(self, graph: fx.GraphModule, differentiate: bool = True) -> Rerun:
        """Knot inputs for one run of ``graph`` (fresh leaves when ``differentiate``)."""
        # a fresh view per run: two runs at one point must not share a leaf (their grads would merge)
        knots = [
            k[graph.knot_window].requires_grad_(need and differentiate)
            for k, need in zip(self.knots, self.knot_needs, strict=True)
        ]
        wrt = [k for k in knots if k.requires_grad] + (self.extras if differentiate else [])
        return Rerun(graph.knot_window, knots, wrt)

    def add(self, rerun: Rerun, grads: Sequence[Tensor | None]) -> None:
        """Add the gradients w.r.t. ``rerun.wrt`` (as returned by ``torch.autograd.grad``)."""
        found = iter(grads)
        for acc in self.knot_grads:
            if acc is not None:
                g = next(found)
                if g is not None:
                    acc[rerun.window].add_(g)
        for acc in self.extra_grads:
            g = next(found)
            if g is not None:
                acc.add_(g)

    def reset(self) -> None:
        """Zero the accumulators, for a pass that starts over."""
        for acc in [*self.knot_grads, *self.extra_grads]:
            if acc is not None:
                acc.zero_()

    def result(self) -> list[Tensor | None]:
        """One gradient (or None) per parameter input, in order."""
        knot_grads = iter(self.knot_grads)
        extra_grads = iter(self.extra_grads)
        out: list[Tensor | None] = [next(knot_grads) for _ in self.knots]
        out += [next(extra_grads) if need else None for need in self.needs[len(self.knots) :]]
        return out


@dataclass
class ForwardContext:
    """What a stage's forward leaves for its backward: generators, autocast state, random draws.

    ``tapes`` holds the random draws of each recorded graph run, keyed by the caller (a step
    index, or a point and side); a run that drew nothing leaves no tape.
    """

    rng: Generators
    autocast: dict[str, Any]
    tapes: dict[Any, Tape] = field(default_factory=dict)

    @classmethod
    def capture(cls, x: Tensor) -> ForwardContext:
        """The current autocast state and the generators ``x``'s device draws from."""
        kind = x.device.type
        autocast = {
            "device_type": kind,
            "dtype": torch.get_autocast_dtype(kind),
            "enabled": torch.is_autocast_enabled(kind),
        }
        return cls(Generators(x.device), autocast)

    def record(self, key: Any, graph: fx.GraphModule, args: Sequence[Tensor]) -> Any:
        """Run ``graph`` in forward, noting the random draws it made under ``key``."""
        out, tape = record(graph, tuple(args), self.rng)
        if tape:
            self.tapes[key] = tape
        return out

    def replay(self, key: Any, graph: fx.GraphModule, args: Sequence[Tensor]) -> Any:
        """Re-run ``graph`` (or another graph naming its nodes alike) with the draws noted under ``key``."""
        tape = self.tapes.get(key)
        return graph(*args) if tape is None else replay(graph, tuple(args), tape, self.rng)

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Run backward's re-runs under the forward's autocast; put the global RNG stream back after.

        Re-runs set the RNG to the states the forward noted; restoring the stream afterwards leaves
        the draws after backward as they are after backprop through the unrolled graph.
        """
        outer = self.rng.get()
        try:
            with torch.autocast(**self.autocast):
                yield
        finally:
            self.rng.set(outer)
