"""What every memory-saving backward pass shares: its autograd Function's shape, gradients, context, warnings.

:class:`StageFunction` is the base of the memory-saving autograd Functions (``checkpoint`` and
``reverse`` in :mod:`odeify.runtime.adjoint`, ``reversible`` in :mod:`odeify.runtime.reversible`):
inputs (the stage's :class:`StageCall`, x, the knot stacks, the stage's other trainable
parameters), so gradients reach the knots as ordinary leaf gradients; one backward prologue
(saved tensors, :class:`ParamGrads`, the forward's context restored) around the pass the forward
chose.

A re-run graph takes only the rows of each knot stack it reads (``graph.knot_window``), so its
knot inputs are fresh leaves over those rows and its gradients land in just those rows of the
accumulators: one step of a K-knot stage costs its own knots in backward, not all K.

:class:`ForwardContext` is what a forward keeps so that backward re-runs see the same mixed
precision and random draws, and leave the global RNG stream as backprop would.
:func:`training_batchnorm` finds what no re-run may hold: a BatchNorm in training mode, whose running
statistics a recompute would update a second time. :func:`warn_fallback` is the one warning policy:
every fallback or inexact rebuild warns as :class:`odeify.FallbackWarning`, attributed to the user's
line.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from odeify.codegen.emit import StepGraph
from odeify.core.errors import FallbackWarning
from odeify.ir.stage_ir import StageIR, static_size
from odeify.runtime.rng_tape import Generators, Tape, record, replay
from odeify.runtime.stats import AdjointStats


def knot_window_inputs(graph: StepGraph, knots: Sequence[Tensor]) -> list[Tensor]:
    """The knot inputs of a step or field graph: each stack's rows ``graph.knot_window``."""
    window = graph.knot_window
    return [k if (window.start, window.stop) == (0, static_size(k)) else k[window] for k in knots]


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

    With ``in_place``, a parameter whose ``.grad`` autograd would add this pass's gradient into as it
    is (:func:`_grad_to_add_into`) gets it added there directly, and autograd is handed a zero that
    takes no memory: no second gradient-sized buffer while the stage steps back (a ViT's whole
    stage: 81 MiB of vit_small's step). Not for a pass that may start over (:meth:`reset`).
    """

    def __init__(
        self, params: Sequence[Tensor], num_knots: int, needs: Sequence[bool], in_place: bool = False
    ) -> None:
        self.knots = [k.detach() for k in params[:num_knots]]
        self.knot_needs = list(needs[:num_knots])
        self.extras = [p for p, need in zip(params[num_knots:], needs[num_knots:], strict=True) if need]
        self.needs = list(needs)
        self.added_in_place: set[int] = set()  # ids of the accumulators that are a parameter's .grad
        pairs = zip(params[:num_knots], self.knot_needs, strict=True)
        self.knot_grads = [self._accumulator(k, in_place) if need else None for k, need in pairs]
        self.extra_grads = [self._accumulator(p, in_place) for p in self.extras]

    def _accumulator(self, param: Tensor, in_place: bool) -> Tensor:
        """Where the pass adds ``param``'s gradient: its own ``.grad`` (in place), else fresh zeros."""
        grad = _grad_to_add_into(param) if in_place else None
        if grad is None:
            return torch.zeros_like(param)
        self.added_in_place.add(id(grad))
        return grad

    def rerun(self, graph: StepGraph, differentiate: bool = True) -> Rerun:
        """Knot inputs for one run of ``graph`` (fresh leaves when ``differentiate``).

        A differentiated knot leaf adds its gradient into its accumulator as soon as autograd has
        it (a hook), and hands autograd a zero that takes no memory: a field's knot gradients are
        then not all alive at once until ``torch.autograd.grad`` returns (resnet18 at 32x32, where
        weights outweigh activations: two 9 MiB conv gradients and their stacked copy at the peak).
        """
        window = graph.knot_window
        knots = []
        for k, need, acc in zip(self.knots, self.knot_needs, self.knot_grads, strict=True):
            # a fresh view per run: two runs at one point must not share a leaf (their grads would merge)
            leaf = k[window].requires_grad_(need and differentiate)
            if leaf.requires_grad:
                leaf.register_hook(functools.partial(_add_into, acc[window]))
            knots.append(leaf)
        wrt = [k for k in knots if k.requires_grad] + (self.extras if differentiate else [])
        return Rerun(window, knots, wrt)

    def add(self, rerun: Rerun, grads: Sequence[Tensor | None]) -> None:
        """Add the gradients w.r.t. ``rerun.wrt`` (as returned by ``torch.autograd.grad``): the
        other parameters'; the knots' were added as autograd made them (:meth:`rerun`)."""
        found = iter(grads[sum(k.requires_grad for k in rerun.knots) :])
        for acc in self.extra_grads:
            g = next(found)
            if g is not None:
                acc.add_(g)

    def _handed_over(self, grad: Tensor | None) -> Tensor | None:
        if grad is None or id(grad) not in self.added_in_place:
            return grad
        return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)

    def reset(self) -> None:
        """Zero the accumulators, for a pass that starts over (never one built ``in_place``)."""
        assert not self.added_in_place, "a pass that starts over keeps its gradients apart"
        for acc in [*self.knot_grads, *self.extra_grads]:
            if acc is not None:
                acc.zero_()

    def result(self) -> list[Tensor | None]:
        """One gradient (or None) per parameter input, in order; a zero that takes no memory for one
        added into ``.grad`` already."""
        knot_grads = iter(map(self._handed_over, self.knot_grads))
        extra_grads = iter(map(self._handed_over, self.extra_grads))
        out: list[Tensor | None] = [next(knot_grads) for _ in self.knots]
        out += [next(extra_grads) if need else None for need in self.needs[len(self.knots) :]]
        return out


def _add_into(accumulator: Tensor, grad: Tensor) -> Tensor:
    """A knot leaf's hook: ``grad`` added into ``accumulator``; autograd gets a zero without memory."""
    accumulator.add_(grad)
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)


def _grad_to_add_into(param: Tensor) -> Tensor | None:
    """``param.grad`` where autograd would add this backward's gradient into it as it is, so the pass
    may add it there itself; else None. That is: a leaf with an allocated dense ``.grad`` of its dtype
    and shape, no hook to see the gradient before it is added (``register_hook``), no graph of the
    backward being built (``create_graph``), and this backward accumulating into it (not
    ``torch.autograd.grad``, nor ``backward(inputs=...)`` without it). Hooks that run after the
    gradient is added (DDP's, ``register_post_accumulate_grad_hook``) see the sum, as they would."""
    if not (param.is_leaf and param.requires_grad) or torch.is_grad_enabled() or param._backward_hooks:
        return None
    grad = param.grad
    if grad is None or grad.layout != torch.strided or (grad.dtype, grad.shape) != (param.dtype, param.shape):
        return None
    with torch.enable_grad():
        accumulator = param.view_as(param).grad_fn.next_functions[0][0]
    try:
        accumulates = torch._C._will_engine_execute_node(accumulator)
    except RuntimeError:  # torch.autograd.grad: it hands gradients back, never into .grad
        return None
    return grad if accumulates else None


@dataclass
class ForwardContext:
    """What a stage's forward leaves for its backward: generators, autocast state, random draws.

    ``tapes`` holds the random draws of each recorded graph run, keyed by the caller (a step
    index, or a point and side); a run that drew nothing leaves no tape. ``inputs`` are the
    stage's constant inputs (:attr:`StageIR.inputs`), which every graph run takes after its knots.
    """

    rng: Generators
    autocast: dict[str, Any]
    tapes: dict[Any, Tape] = field(default_factory=dict)
    inputs: tuple[Tensor, ...] = ()

    @classmethod
    def capture(cls, x: Tensor, inputs: Sequence[Tensor] = ()) -> ForwardContext:
        """The current autocast state, the generators ``x``'s device draws from, the constant inputs."""
        kind = x.device.type
        autocast = {
            "device_type": kind,
            "dtype": torch.get_autocast_dtype(kind),
            "enabled": torch.is_autocast_enabled(kind),
        }
        return cls(Generators(x.device), autocast, inputs=tuple(inputs))

    def record(self, key: Any, graph: StepGraph, args: Sequence[Tensor]) -> Any:
        """Run ``graph`` in forward, noting the random draws it made under ``key``."""
        out, tape = record(graph.module, (*args, *self.inputs), self.rng)
        if tape:
            self.tapes[key] = tape
        return out

    def replay(self, key: Any, graph: StepGraph, args: Sequence[Tensor]) -> Any:
        """Re-run ``graph`` (or another graph naming its nodes alike) with the draws noted under ``key``."""
        tape = self.tapes.get(key)
        args = (*args, *self.inputs)
        return graph(*args) if tape is None else replay(graph.module, args, tape, self.rng)

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


@dataclass(frozen=True)
class StageCall:
    """What a memory-saving Function needs of its stage besides tensors: the IR, where to report, how
    many of the parameter inputs are knot stacks."""

    stage: StageIR
    stats: AdjointStats
    num_knots: int
    inputs: tuple[Tensor, ...] = ()
    """The stage's constant inputs (:attr:`StageIR.inputs`): passed to every graph, never differentiated."""


@dataclass(frozen=True)
class Backward:
    """What one backward pass works with: its stage, the gradient accumulators, whether x wants a
    gradient, the forward's context and the knot stacks (detached views are made per re-run)."""

    call: StageCall
    grads: ParamGrads
    needs_x: bool
    context: ForwardContext
    knots: tuple[Tensor, ...]

    @property
    def stage(self) -> StageIR:
        return self.call.stage

    @property
    def stats(self) -> AdjointStats:
        return self.call.stats


BackwardPass = Callable[[Backward, tuple[Tensor, ...], Tensor], Tensor | None]
"""A pass chosen in forward: ``(its Backward, what forward saved, the output's gradient) -> x's gradient``."""


class StageFunction(torch.autograd.Function):
    """Base of the memory-saving autograd Functions: ``apply(call, x, *knots, *other parameters)``.

    A subclass writes ``forward(ctx, call, x, *params)``: it runs the stage under ``no_grad``, and
    calls :meth:`keep` with what backward needs and the pass that will use it. ``backward`` is
    here, once: it unpacks the saved tensors, makes the gradient accumulators and runs that pass
    under the forward's autocast state, restoring the global RNG stream afterwards.
    """

    @classmethod
    def run(cls, call: StageCall, x: Tensor, params: Sequence[Tensor]) -> Tensor:
        return cls.apply(call, x, *params)

    @staticmethod
    def keep(
        ctx: Any,
        call: StageCall,
        context: ForwardContext,
        params: Sequence[Tensor],
        saved: Sequence[Tensor | None],
        backward: BackwardPass,
        grads_in_place: bool = True,
    ) -> None:
        """Save what ``backward`` (run later, by :meth:`backward`) needs; ``grads_in_place``: whether
        it may add gradients into the parameters' ``.grad`` directly (:class:`ParamGrads`)."""
        ctx.call, ctx.context, ctx.backward_pass, ctx.num_params = call, context, backward, len(params)
        ctx.grads_in_place = grads_in_place
        ctx.save_for_backward(*params, *saved)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        params, saved = ctx.saved_tensors[: ctx.num_params], ctx.saved_tensors[ctx.num_params :]
        call = ctx.call
        grads = ParamGrads(params, call.num_knots, ctx.needs_input_grad[2:], ctx.grads_in_place)
        work = Backward(call, grads, ctx.needs_input_grad[1], ctx.context, params[: call.num_knots])
        with ctx.context.restored():
            grad_x = ctx.backward_pass(work, saved, grad_out)
        return (None, grad_x, *grads.result())


_LIBRARY = tuple(str(Path(module.__file__).parent) for module in (sys.modules["odeify"], torch))


def warn_fallback(message: str) -> None:
    """Warn ``message`` as :class:`odeify.FallbackWarning`, attributed to the first frame outside odeify
    and torch: the user's ``model(x)`` for a forward's fallback, ``loss.backward()`` for a backward's."""
    frame, level = sys._getframe(), 1
    while frame.f_back is not None and _in_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(f"odeify: {message}", FallbackWarning, stacklevel=level)


def _in_library(filename: str) -> bool:
    """Whether a frame runs odeify's or torch's code (or a graph torch.fx generated)."""
    return filename.startswith(_LIBRARY) or filename.startswith("<eval_with_key>")


def training_batchnorm(module: nn.Module) -> str | None:
    """The name of ``module``'s first BatchNorm in training mode ('' for ``module`` itself), or None.

    A memory-saving backward re-runs forward computation: such a BatchNorm would update its running
    statistics a second time, on the batch statistics of a reconstructed state.
    """
    for name, sub in module.named_modules():
        if isinstance(sub, _BatchNorm) and sub.training:
            return name
    return None
