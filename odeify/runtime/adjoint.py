"""``backward='checkpoint'`` and ``backward='reverse'``: re-run each step of an explicit integrator.

Both walk the steps from last to first; at each they obtain the step's start state, re-run the
step with grad and take its vector-Jacobian product. They differ only in how they obtain that
state:

- ``checkpoint``: from states saved in forward (every ``stage.checkpoint_every``-th step, the
  ones between recomputed). Exact.
- ``reverse``: by stepping the explicit tableau backward from the step's end (Sander et al.
  2022). Saves only the input and output; approximate. Each step checks its reconstruction
  (re-run forward from the rebuilt state, compare with the state it was rebuilt from); past
  :data:`RECONSTRUCTION_TOLERANCE`, or not finite (a NaN sample), the pass restarts exactly,
  from the saved input, with checkpointing, so a backward pass is either within tolerance at
  every step or exact.

Their autograd Functions share the prologue of :class:`odeify.runtime.rerun.StageFunction`;
re-runs see the forward's autocast state, take only the knots their step reads and replay the
forward's random draws (:mod:`odeify.runtime.rng_tape`). The approximate reverse step replays the
draws whose names it shares with the forward step (all of them for Euler off native depth); its
reconstruction check measures any mismatch. ``reversible`` lives in
:mod:`odeify.runtime.reversible`; the table of modes in :mod:`odeify.runtime.stage`.

Why not ``torch.utils.checkpoint``'s RNG handling: it saves one RNG state per checkpointed call
and replays the call whole and in order. The passes here re-run single steps from rebuilt states
and, for ``reverse``, run other graphs (backward steps) that must reuse some of the forward's
draws, so draws are recorded per graph node (:mod:`odeify.runtime.rng_tape`). The parts of a model
between stages, which are recomputed whole, do use ``torch.utils.checkpoint``
(:mod:`odeify.passes.segments`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from odeify.codegen.emit import step_graph
from odeify.runtime.batch_slices import batch_slices, probe_sample_bytes
from odeify.runtime.rerun import (
    Backward,
    ForwardContext,
    StageCall,
    StageFunction,
    knot_window_inputs,
    warn_fallback,
)

__all__ = ["RECONSTRUCTION_TOLERANCE", "CheckpointAdjoint", "ReverseAdjoint"]

RECONSTRUCTION_TOLERANCE = 1e-3
"""Largest relative one-step reconstruction error ``||step(rebuilt x_n) - x_{n+1}|| / ||x_{n+1}||``
that ``backward='reverse'`` accepts before falling back to checkpointing. A stage may override it
with a ``reverse_tolerance`` attribute. 1e-3 keeps the gradient error at a few percent on smooth
stages (benchmarks/gradient_error.py) and far above fp32 round-off."""

State = tuple[Tensor, ...]


def _run_forward(call: StageCall, x: Tensor, knots: Sequence[Tensor], keep_every: int = 0) -> tuple:
    """All steps from x under no_grad, recording random draws: (final state, context, the state at
    every ``keep_every``-th step, flattened; none when 0)."""
    stage = call.stage
    context = ForwardContext.capture(x, call.inputs)
    state = stage.initial_state(x)
    saved: list[Tensor] = []
    for n in range(stage.steps):
        if keep_every and n % keep_every == 0:
            saved.extend(state)
        graph = step_graph(stage, n)
        state = context.record(n, graph, (*state, *knot_window_inputs(graph, knots)))
    return state, context, saved


class CheckpointAdjoint(StageFunction):
    """``checkpoint``: keeps every ``checkpoint_every``-th step's state; exact."""

    @staticmethod
    def forward(ctx: Any, call: StageCall, x: Tensor, *params: Tensor) -> Tensor:
        every = call.stage.checkpoint_every
        state, context, saved = _run_forward(call, x, params[: call.num_knots], every)

        def backward(work: Backward, kept: tuple[Tensor, ...], grad_out: Tensor) -> Tensor | None:
            states = _chunk(kept, len(work.stage.state_starts))
            return _StagePass(work).checkpointed_by_slices(states, every, grad_out)

        StageFunction.keep(ctx, call, context, params, saved, backward)
        return state[0]


class ReverseAdjoint(StageFunction):
    """``reverse``: keeps the input and output, rebuilds each step's start by stepping backward."""

    @staticmethod
    def forward(ctx: Any, call: StageCall, x: Tensor, *params: Tensor) -> Tensor:
        state, context, _ = _run_forward(call, x, params[: call.num_knots])

        def backward(work: Backward, kept: tuple[Tensor, ...], grad_out: Tensor) -> Tensor | None:
            return _StagePass(work).reconstructed(tuple(kept[1:]), grad_out, kept[0])

        StageFunction.keep(ctx, call, context, params, [x, *state], backward, grads_in_place=False)
        return state[0]


class _StagePass:
    """One backward pass over a stage: re-runs steps, takes their VJPs, accumulates the gradients."""

    def __init__(self, work: Backward) -> None:
        self.stage, self.grads, self.stats = work.stage, work.grads, work.stats
        self.needs_x, self.context = work.needs_x, work.context

    def checkpointed_by_slices(self, saved: list[State], every: int, grad_out: Tensor) -> Tensor | None:
        """:meth:`checkpointed`, slice by slice of the batch (:mod:`odeify.runtime.batch_slices`), so
        a re-run step's activations live for one slice; whole where the stage draws random numbers
        (the forward drew them for the whole batch) or has one sample."""
        self.stats.backward_passes += 1
        slices = [slice(None)]
        if not self.stage.draws_random:
            graph = step_graph(self.stage, 0)
            knots = self.grads.rerun(graph, differentiate=False).knots
            inputs = self.context.inputs
            step = probe_sample_bytes(graph.module, lambda state: graph(*state, *knots, *inputs), saved[0])
            slices = batch_slices(grad_out, sample_bytes=step + sum(4 * s[0].numel() for s in saved[0]))
        if len(slices) == 1:
            return self.checkpointed(saved, every, grad_out)
        grad_x = grad_out.new_empty(grad_out.shape) if self.needs_x else None
        for rows in slices:
            part = self.checkpointed([tuple(s[rows] for s in kept) for kept in saved], every, grad_out[rows])
            if grad_x is not None:
                grad_x[rows] = part
        return grad_x

    def checkpointed(self, saved: list[State], every: int, grad_out: Tensor) -> Tensor | None:
        """Exact: re-run each segment of ``every`` steps from its saved start, then VJP its steps.
        The caller counts the pass."""
        steps = self.stage.steps
        cotangent = self._start(grad_out)
        for segment in reversed(range(len(saved))):
            begin, end = segment * every, min(segment * every + every, steps)
            states = [saved[segment]]
            with torch.no_grad():
                for n in range(begin, end - 1):
                    states.append(self._run(n, "forward", states[-1]))
            for n in reversed(range(begin, end)):
                _, cotangent = self._vjp(n, states.pop(), cotangent)
        return self._finish(cotangent)

    def reconstructed(self, final: State, grad_out: Tensor, x: Tensor) -> Tensor | None:
        """Rebuild each step's start by stepping backward from its end, then VJP the step.

        Step 0 starts from ``x`` itself. A reconstruction error past the tolerance, or not finite,
        abandons the pass for :meth:`checkpointed` from x. On the CPU each step's error is checked
        at once; on an accelerator they are read together at the end (one device sync per pass).
        """
        tolerance = getattr(self.stage, "reverse_tolerance", RECONSTRUCTION_TOLERANCE)
        check_each_step = x.device.type == "cpu"
        cotangent = self._start(grad_out)
        errors: list[Tensor] = []  # errors[i]: step (i + 1)'s start, filled from the last step down
        state = final
        for n in reversed(range(1, self.stage.steps)):
            with torch.no_grad():
                start = self._run(n, "reverse", state)
            end, cotangent = self._vjp(n, start, cotangent)
            errors.insert(0, _relative_error(end, state))
            if check_each_step and not float(errors[0]) <= tolerance:  # NaN fails too
                return self._fall_back(x, errors, tolerance, grad_out)
            state = start
        if errors and not check_each_step:
            values = torch.stack(errors).tolist()
            if not all(v <= tolerance for v in values):
                return self._fall_back(x, errors, tolerance, grad_out)
        _, cotangent = self._vjp(0, self.stage.initial_state(x), cotangent)
        self.stats.backward_passes += 1
        self.stats.record([x.new_zeros(()), *errors])
        return self._finish(cotangent)

    def _fall_back(
        self, x: Tensor, errors: list[Tensor], tolerance: float, grad_out: Tensor
    ) -> Tensor | None:
        """Redo the whole pass exactly from the saved input, keeping sqrt(steps) states."""
        self.stats.record(errors)
        self.stats.fallbacks += 1
        steps = self.stage.steps
        failed = next(i for i, e in enumerate(self.stats.last_errors) if not e <= tolerance)
        n, error = failed + steps - len(errors), self.stats.last_errors[failed]
        if self.stats.fallbacks == 1:
            cause = "is not finite (a NaN or inf in the batch?)" if math.isinf(error) else f"{error:.2e}"
            warn_fallback(
                f"stage '{self.stage.stage_name}' (backward='reverse', integrator="
                f"'{self.stage.integrator.name}', steps={steps}) could not rebuild its states: step {n} "
                f"has reconstruction error {cause} > tolerance {tolerance:.0e}. This backward pass was "
                "redone exactly with checkpointing from the stage input (more compute, memory ~ "
                "sqrt(steps) states), and later ones will be too whenever this happens; "
                "stage.adjoint_stats.fallbacks counts them. To stay memory-free use more steps or "
                "integrator='heun' instead of 'euler'; if memory allows, backward='checkpoint' skips "
                "the failed attempts."
            )
        self.grads.reset()
        self.stats.backward_passes += 1
        every = math.isqrt(steps - 1) + 1  # ceil(sqrt(steps))
        state = self.stage.initial_state(x)
        saved = [state]
        with torch.no_grad():
            for m in range(every * ((steps - 1) // every)):
                state = self._run(m, "forward", state)
                if (m + 1) % every == 0:
                    saved.append(state)
        return self.checkpointed(saved, every, grad_out)

    # -- one step ------------------------------------------------------------------------------
    def _start(self, grad_out: Tensor) -> list[Tensor | None]:
        """Cotangents of the final state: the output's, then None for the other components."""
        return [grad_out, *([None] * (len(self.stage.state_starts) - 1))]

    def _vjp(self, n: int, start: State, cotangent: list[Tensor | None]) -> tuple[State, list[Tensor | None]]:
        """Re-run step ``n`` from ``start`` with grad; returns its end state and its start's cotangents."""
        need_state = n > 0 or self.needs_x
        graph = step_graph(self.stage, n)
        rerun = self.grads.rerun(graph)
        with torch.enable_grad():
            inputs = tuple(s.detach().requires_grad_(need_state) for s in start)
            end = self.context.replay(n, graph, (*inputs, *rerun.knots))
            pairs = [(e, g) for e, g in zip(end, cotangent, strict=True) if g is not None]
            wrt = [*inputs, *rerun.wrt] if need_state else rerun.wrt
            step_grads = torch.autograd.grad(
                [e for e, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
            )
        self.grads.add(rerun, step_grads[len(inputs) :] if need_state else step_grads)
        state_cotangent = list(step_grads[: len(inputs)]) if need_state else [None] * len(inputs)
        return tuple(e.detach() for e in end), state_cotangent

    def _run(self, n: int, kind: str, state: State) -> State:
        """Step graph ``n`` of ``kind`` without grad, replaying the random draws step n made in forward."""
        graph = step_graph(self.stage, n, kind)
        rerun = self.grads.rerun(graph, differentiate=False)
        return self.context.replay(n, graph, (*state, *rerun.knots))

    def _finish(self, cotangent: list[Tensor | None]) -> Tensor | None:
        """The gradient w.r.t. x, which fed the components of the initial state that start at x."""
        if not self.needs_x:
            return None
        starts = self.stage.state_starts
        parts = [g for g, start in zip(cotangent, starts, strict=True) if g is not None and start == "input"]
        return sum(parts[1:], parts[0])


def _relative_error(got: State, want: State) -> Tensor:
    """||got - want|| / ||want|| over all state components, as a 0-dim tensor (no device sync)."""
    diff = torch.stack([torch.linalg.vector_norm(g - w) for g, w in zip(got, want, strict=True)]).norm()
    norm = torch.stack([torch.linalg.vector_norm(w) for w in want]).norm()
    return diff / norm.clamp_min(torch.finfo(norm.dtype).tiny)


def _chunk(flat: Sequence[Tensor], width: int) -> list[State]:
    return [tuple(flat[i : i + width]) for i in range(0, len(flat), width)]
