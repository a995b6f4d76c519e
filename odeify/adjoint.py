"""Memory-saving backward passes for ODE stages (DESIGN.md section 2, "Backward modes").

:func:`integrate_with_adjoint` runs a stage's step graphs under ``no_grad`` inside one
``torch.autograd.Function`` whose inputs are the stage input and the stage's parameters (the
knots), so gradients reach the knots as ordinary leaf gradients: optimizers, gradient clipping,
loss scaling and DistributedDataParallel's hooks work unchanged. Backward walks the steps from
last to first; at each step it obtains the step's start state, re-runs the step with grad and
takes its vector-Jacobian product. The modes differ only in how they obtain that state:

- ``checkpoint``: from states saved in forward (every ``stage.checkpoint_every``-th step, the
  ones between recomputed). Exact.
- ``reverse``: by stepping the explicit tableau backward from the step's end (Sander et al.
  2022). Saves only the input and output; approximate. Each step checks its reconstruction
  (re-run forward from the rebuilt state, compare with the state it was rebuilt from); past
  :data:`RECONSTRUCTION_TOLERANCE` the pass restarts exactly, from the saved input, with
  checkpointing, so a backward pass is either within tolerance at every step or exact.
- ``reversible``: reversible Heun's closed-form inverse. Saves only the final (y, z); exact up
  to round-off at any depth. That round-off is the field's arithmetic (bf16 under autocast,
  TF32 in cuDNN's default fp32 convolutions), and the inverse amplifies it on an expansive
  stage; a state sitting exactly on a ReLU kink is rebuilt just off it and may take the
  other subgradient.

Re-runs also see the forward's autocast state, and a stage's trainable parameters outside its
knots (a user's template module) get their gradients too.

Random draws (DropPath in train mode) are replayed: forward notes the RNG state before every
graph node that draws, and the re-runs restore it before the node of the same name. Step graphs
name a node after its template node and its field evaluation (``s{n}_{i}``), so a forward step
and its re-run match exactly, and so do reversible Heun's step and inverse (which evaluate the
same two fields in the opposite order). The approximate reverse step replays the draws whose
names it shares with the forward step (all of them for Euler off native depth); its
reconstruction check measures any mismatch. The global RNG stream is restored after backward.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from odeify.errors import ConfigError

if TYPE_CHECKING:
    from odeify.stage import ODEStage

__all__ = ["RECONSTRUCTION_TOLERANCE", "AdjointStats", "integrate_with_adjoint"]

RECONSTRUCTION_TOLERANCE = 1e-3
"""Largest relative one-step reconstruction error ``||step(rebuilt x_n) - x_{n+1}|| / ||x_{n+1}||``
that ``backward='reverse'`` accepts before falling back to checkpointing. A stage may override it
with a ``reverse_tolerance`` attribute. 1e-3 keeps the gradient error at a few percent on smooth
stages (benchmarks/gradient_error.py) and far above fp32 round-off."""

MEMORY_FREE_MODES = ("checkpoint", "reverse", "reversible")

State = tuple[Tensor, ...]
RngState = tuple[Tensor, Tensor | None]
Tape = dict[str, RngState]


@dataclass
class AdjointStats:
    """What a stage's memory-saving backward passes did; read ``stage.adjoint_stats`` after backward.

    ``last_errors[n]`` is the last pass's relative error in rebuilding step n's start x'_n,
    ``||step_n(x'_n) - x'_{n+1}|| / ||x'_{n+1}||`` (``reverse`` and ``reversible``; 0 for
    reverse's step 0, which starts from the saved input; after a fallback, only the steps tried),
    ``worst_error`` the largest seen in any pass.
    """

    backward_passes: int = 0
    fallbacks: int = 0
    worst_error: float = 0.0
    last_errors: list[float] = field(default_factory=list)


def integrate_with_adjoint(stage: ODEStage, x: Tensor) -> Tensor:
    """Run ``stage`` on ``x`` with the memory-saving backward named by ``stage.backward``."""
    if stage.backward not in MEMORY_FREE_MODES:
        raise ConfigError(
            f"stage '{stage.stage_name}' has backward={stage.backward!r}; the adjoint runs only "
            f"{', '.join(MEMORY_FREE_MODES)} (backprop goes through the unrolled graph)."
        )
    _check_batchnorm(stage)
    knots = stage.knot_tensors()
    extras = [p for p in stage.parameters() if p.requires_grad and not any(p is k for k in knots)]
    if not (x.requires_grad or any(t.requires_grad for t in (*knots, *extras))):
        with torch.no_grad():
            return stage(x)
    return _StageAdjoint.apply(stage, len(knots), x, *knots, *extras)


def _check_batchnorm(stage: ODEStage) -> None:
    """Refuse train-mode BatchNorm: a re-run would update running stats twice, on other batch stats."""
    for name, module in stage.named_modules():
        if isinstance(module, _BatchNorm) and module.training:
            raise ConfigError(
                f"stage '{stage.stage_name}' holds BatchNorm '{name}' in training mode, but "
                f"backward={stage.backward!r} re-runs steps in backward, which would update its running "
                "statistics a second time (and a reconstructed state has other batch statistics). "
                "Fold it into the conv before it (odeify.convert does) or freeze it with .eval()."
            )


class _StageAdjoint(torch.autograd.Function):
    """Inputs: the stage, how many knot tensors follow x, x, the knots, other trainable parameters."""

    @staticmethod
    def forward(ctx: Any, stage: ODEStage, num_knots: int, x: Tensor, *params: Tensor) -> Tensor:
        mode, every, rng = stage.backward, stage.checkpoint_every, _Rng(x.device)
        state = stage.initial_state(x)
        saved: list[Tensor] = []
        tapes: list[Tape] = []
        for n in range(stage.steps):
            if mode == "checkpoint" and n % every == 0:
                saved.extend(state)
            state, tape = _record(stage.step_graph(n), (*state, *params[:num_knots]), rng)
            tapes.append(tape)
        if mode == "reverse":
            saved = [x, *state]
        elif mode == "reversible":
            saved = list(state)
        ctx.stage, ctx.mode, ctx.every, ctx.rng = stage, mode, every, rng
        ctx.num_knots, ctx.tapes = num_knots, tapes
        device = x.device.type
        ctx.autocast = {
            "device_type": device,
            "dtype": torch.get_autocast_dtype(device),
            "enabled": torch.is_autocast_enabled(device),
        }
        ctx.save_for_backward(*params, *saved)
        return state[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        count = len(ctx.needs_input_grad) - 3  # the inputs after (stage, num_knots, x)
        params, states = ctx.saved_tensors[:count], ctx.saved_tensors[count:]
        pass_ = _Backward(ctx.stage, ctx.num_knots, params, ctx.needs_input_grad[2:], ctx.tapes, ctx.rng)
        outer = ctx.rng.get()
        try:
            with torch.autocast(**ctx.autocast):  # re-runs see the forward's mixed precision
                if ctx.mode == "checkpoint":
                    width = len(ctx.stage.initial_state(grad_out))
                    grads = pass_.checkpointed(_chunk(states, width), ctx.every, grad_out)
                elif ctx.mode == "reversible":
                    grads = pass_.reconstructed(tuple(states), "inverse", grad_out, None)
                else:
                    grads = pass_.reconstructed(tuple(states[1:]), "reverse", grad_out, states[0])
        finally:
            ctx.rng.set(outer)
        return (None, None, *grads)


class _Backward:
    """One backward pass over a stage: re-runs steps, takes their VJPs, accumulates the gradients."""

    def __init__(
        self,
        stage: ODEStage,
        num_knots: int,
        params: Sequence[Tensor],
        needs: Sequence[bool],
        tapes: list[Tape],
        rng: _Rng,
    ) -> None:
        self.stage, self.tapes, self.rng = stage, tapes, rng
        self.needs_x, self.needs = needs[0], list(needs[1:])
        # knots enter each re-run as detached leaves; other parameters are read by the graph itself
        self.knots = [
            k.detach().requires_grad_(n)
            for k, n in zip(params[:num_knots], self.needs[:num_knots], strict=True)
        ]
        inputs = [*self.knots, *params[num_knots:]]
        self.trained = [p for p, need in zip(inputs, self.needs, strict=True) if need]
        self.stats = stage.adjoint_stats

    def checkpointed(self, saved: list[State], every: int, grad_out: Tensor) -> list[Tensor | None]:
        """Exact: re-run each segment of ``every`` steps from its saved start, then VJP its steps."""
        self.stats.backward_passes += 1
        steps = self.stage.steps
        grads = self._start(grad_out)
        for segment in reversed(range(len(saved))):
            begin, end = segment * every, min(segment * every + every, steps)
            states = [saved[segment]]
            with torch.no_grad():
                for n in range(begin, end - 1):
                    states.append(self._run(n, "forward", (*states[-1], *self.knots)))
            for n in reversed(range(begin, end)):
                _, grads = self._vjp(n, states.pop(), grads)
        return self._finish(grads)

    def reconstructed(
        self, final: State, kind: str, grad_out: Tensor, x: Tensor | None
    ) -> list[Tensor | None]:
        """Rebuild each step's start from its end (``kind`` graph), then VJP the step.

        With ``x`` (the stage input, mode ``reverse``) step 0 starts from ``x`` itself, and a
        reconstruction error past the tolerance abandons the pass for :meth:`checkpointed` from x.
        """
        tolerance = getattr(self.stage, "reverse_tolerance", RECONSTRUCTION_TOLERANCE)
        grads = self._start(grad_out)
        errors: list[Tensor] = []  # 0-dim tensors: reversible reads them once, at the end
        state = final
        for n in reversed(range(self.stage.steps)):
            if n == 0 and x is not None:
                _, grads = self._vjp(0, self.stage.initial_state(x), grads)
                errors.insert(0, torch.zeros((), device=x.device))
                break
            with torch.no_grad():
                start = self._run(n, kind, (*state, *self.knots))
            end, grads = self._vjp(n, start, grads)
            errors.insert(0, _relative_error(end, state))
            if x is not None and float(errors[0]) > tolerance:
                self._record_errors(errors)
                return self._fall_back(x, n, float(errors[0]), tolerance, grad_out)
            state = start
        self.stats.backward_passes += 1
        self._record_errors(errors)
        return self._finish(grads)

    def _fall_back(
        self, x: Tensor, n: int, error: float, tolerance: float, grad_out: Tensor
    ) -> list[Tensor | None]:
        """Redo the whole pass exactly from the saved input, keeping sqrt(steps) states."""
        self.stats.fallbacks += 1
        if self.stats.fallbacks == 1:
            warnings.warn(
                f"odeify: stage '{self.stage.stage_name}' (backward='reverse', integrator="
                f"'{self.stage.integrator.name}', steps={self.stage.steps}) could not rebuild its states: "
                f"step {n} has reconstruction error {error:.2e} > tolerance {tolerance:.0e}. This backward "
                "pass was redone exactly with checkpointing from the stage input (more compute, memory "
                "~ sqrt(steps) states), and later ones will be too whenever this happens; "
                "stage.adjoint_stats.fallbacks counts them. To stay memory-free use more steps or "
                "integrator='heun' instead of 'euler'; if memory allows, backward='checkpoint' skips "
                "the failed attempts.",
                RuntimeWarning,
                stacklevel=2,
            )
        steps = self.stage.steps
        every = math.isqrt(steps - 1) + 1  # ceil(sqrt(steps))
        state = self.stage.initial_state(x)
        saved = [state]
        with torch.no_grad():
            for m in range(every * ((steps - 1) // every)):
                state = self._run(m, "forward", (*state, *self.knots))
                if (m + 1) % every == 0:
                    saved.append(state)
        return self.checkpointed(saved, every, grad_out)

    # -- one step ------------------------------------------------------------------------------
    def _start(self, grad_out: Tensor) -> list[Tensor | None]:
        """Gradients w.r.t. the final state (y only for reversible Heun), then zeroed parameter grads."""
        width = len(self.stage.initial_state(grad_out))
        return [grad_out, *([None] * (width - 1)), *(torch.zeros_like(p) for p in self.trained)]

    def _vjp(self, n: int, start: State, grads: list[Tensor | None]) -> tuple[State, list[Tensor | None]]:
        """Re-run step ``n`` from ``start`` with grad; returns its end state and the updated grads."""
        width = len(start)
        need_state = n > 0 or self.needs_x
        with torch.enable_grad():
            inputs = tuple(s.detach().requires_grad_(need_state) for s in start)
            end = self._run(n, "forward", (*inputs, *self.knots))
            pairs = [(e, g) for e, g in zip(end, grads[:width], strict=True) if g is not None]
            step_grads = torch.autograd.grad(
                [e for e, _ in pairs],
                [*inputs, *self.trained] if need_state else self.trained,
                [g for _, g in pairs],
                allow_unused=True,
            )
        state_grads = step_grads[:width] if need_state else (None,) * width
        for acc, g in zip(grads[width:], step_grads[len(step_grads) - len(self.trained) :], strict=True):
            if g is not None:
                acc.add_(g)
        return tuple(e.detach() for e in end), [*state_grads, *grads[width:]]

    def _run(self, n: int, kind: str, args: tuple[Tensor, ...]) -> State:
        """Step graph ``n`` of ``kind``, replaying the random draws step n made in forward."""
        graph = self.stage.step_graph(n, kind)
        tape = self.tapes[n]
        return graph(*args) if not tape else _Replay(graph, tape, self.rng).run(*args)

    def _finish(self, grads: list[Tensor | None]) -> list[Tensor | None]:
        """(grad x, one grad or None per parameter input): x fed every component of the initial state."""
        width = len(grads) - len(self.trained)
        parts = [g for g in grads[:width] if g is not None]
        found = iter(grads[width:])
        return [
            sum(parts[1:], parts[0]) if self.needs_x else None,
            *(next(found) if need else None for need in self.needs),
        ]

    def _record_errors(self, errors: list[Tensor]) -> None:
        self.stats.last_errors = torch.stack([e.float() for e in errors]).tolist()
        self.stats.worst_error = max(self.stats.worst_error, *self.stats.last_errors)


def _relative_error(got: State, want: State) -> Tensor:
    """||got - want|| / ||want|| over all state components, as a 0-dim tensor (no device sync)."""
    diff = torch.stack([torch.linalg.vector_norm(g - w) for g, w in zip(got, want, strict=True)]).norm()
    norm = torch.stack([torch.linalg.vector_norm(w) for w in want]).norm()
    return diff / norm.clamp_min(torch.finfo(norm.dtype).tiny)


def _chunk(flat: Sequence[Tensor], width: int) -> list[State]:
    return [tuple(flat[i : i + width]) for i in range(0, len(flat), width)]


# -- random-number replay ------------------------------------------------------------------------
class _Rng:
    """The generators a stage's random ops draw from: the CPU one, plus x's GPU when x is on one."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None

    def get(self) -> RngState:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.cuda) if self.cuda else None

    def set(self, state: RngState) -> None:
        torch.set_rng_state(state[0])
        if self.cuda is not None:
            torch.cuda.set_rng_state(state[1], self.cuda)


def _same(a: RngState, b: RngState) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


_DRAWS: weakref.WeakSet[fx.GraphModule] = weakref.WeakSet()  # step graphs seen drawing random numbers


def _record(graph: fx.GraphModule, args: tuple[Tensor, ...], rng: _Rng) -> tuple[State, Tape]:
    """Run a step graph, noting the RNG state before each node that drew random numbers.

    Recording goes node by node, so a graph runs whole first; only if it moved the RNG does it
    run again, recording, from the same state (and is recorded straight away from then on).
    """
    if graph not in _DRAWS:
        before = rng.get()
        out = graph(*args)
        if _same(rng.get(), before):
            return out, {}
        rng.set(before)
        _DRAWS.add(graph)
    recorder = _Recorder(graph, rng)
    return recorder.run(*args), recorder.tape


class _Recorder(fx.Interpreter):
    def __init__(self, graph: fx.GraphModule, rng: _Rng) -> None:
        super().__init__(graph)
        self.rng, self.tape, self.last = rng, {}, rng.get()

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        now = self.rng.get()
        if not _same(now, self.last):
            self.tape[n.name], self.last = self.last, now
        return out


class _Replay(fx.Interpreter):
    def __init__(self, graph: fx.GraphModule, tape: Tape, rng: _Rng) -> None:
        super().__init__(graph)
        self.tape, self.rng = tape, rng

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.tape:
            self.rng.set(self.tape[n.name])
        return super().run_node(n)
