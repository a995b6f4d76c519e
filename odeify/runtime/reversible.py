"""``backward='reversible'``: reversible Heun's memory-free backward, exact to the last bit.

Reversible Heun (Kidger et al. 2021) keeps a pair (y, z) and is invertible in exact arithmetic.
In floating point its inverse amplifies round-off, about 3x per step on an expansive stage, so
fp32 gradients drifted 1e-3..1e-2 from backprop. Here the state lives on a fixed-point lattice:
integer multiples of a power of two q, 2^-bits of each sample's largest magnitude (rounded up to
a power of two; bits from :func:`lattice_bits`), held as counts of q in float64, and every
increment is rounded to the lattice ([.]) before it is added:

    a_n = [h/2 F(t_n, z_n)],     z_{n+1} = 2 y_n - z_n + 2 a_n,
    b_n = [h/2 F(t_{n+1}-, z_{n+1})],     y_{n+1} = y_n + a_n + b_n.

Sums of counts are exact in float64 while below 2^53 (the forward accepts states below 2^52
counts: 2^(52 - bits) times the input's magnitude, 2^26 for fp32 inputs), so the inverse
z_n = 2 y_{n+1} - z_{n+1} - 2 b_n, y_n = y_{n+1} - a_n - b_n rebuilds every state bit for bit,
provided F returns the same bits for the same input: CPU kernels do; on GPU set
``torch.backends.cudnn.deterministic = True``. F runs in the input's dtype on z rounded to it,
so its Jacobians are the ones backprop uses; only the state arithmetic is
finer than the unrolled graph's (whose output differs by its own round-off).

What it costs per point, besides the field: the graphs evaluate delta = F / L (the stage's depth
L is folded into the increments' scale, h L / 2, and into the cotangents: a multiply fewer per
evaluation and per VJP), the increment is three float64 passes, and the running sum
u_m = y_m + a_m makes z_{m+1} = 2 u_m - z_m one pass (see :func:`_integrate`); a shared
evaluation's increment is computed once and added twice in one pass.

Backward walks the points z_N, ..., z_0. At each it evaluates the fields at z_m with grad
(B_{m-1} = F(t_m-, z_m) and A_m = F(t_m, z_m); one evaluation when the weight path is continuous
at t_m and nothing random is drawn), takes one vector-Jacobian product with the cotangents

    λy_m = λy_{m+1} + 2 λz_{m+1},    cA_m = h λz_{m+1} + h/2 λy_{m+1},    cB_{m-1} = h/2 λy_m,
    λz_m = -λz_{m+1} + J_A^T cA_m + J_B^T cB_{m-1},

and steps the lattice state back with the same evaluations' values. Every field is evaluated
once in forward and once, with grad, in backward.

What forward keeps, at any depth (``benchmarks/lattice_range.py`` measures the counts: for fp32
inputs, 2^31 on a random-weight resnet50, whose stages grow their input up to 2^6, and 2^27 on
the trained digits model):

- the output y_N rounded to the input's dtype, which the model keeps anyway (the next part of the
  model saves it) and which the Function saves too (the same storage, counted once);
- y_N's rounding residual in counts, in the narrowest integer type that holds it (int8 while the
  stage grows its input by less than about 2^6 for fp32; nothing when y_N is exact in the dtype,
  as in fp64);
- d_N = z_N - y_N in counts, as int32 while below 2^31 (growth below about 2^6), else float64;
- the spacing q per sample.

For fp32 that is 1.25 states beside the output on the models measured (it was 4: y and z in
float64), 2.25 where d outgrows int32. The lattice is 2^2 finer than the input's precision
(26 bits for fp32): gradients agree with fp32 backprop as closely as fp32 backprop agrees with
float64 (:func:`lattice_bits`).

Whatever the counts cannot hold exactly is detected, never stored lossily: a state past 2^52
counts (the float64 sums are no longer exact) or not finite (a NaN or inf sample) makes the
forward keep its input instead and the backward recompute the forward's states from it
(memory: all steps' states, during backward only), with one warning per stage and
``stage.adjoint_stats.fallbacks`` counting. A field that returns other bits on a re-run
(nondeterministic kernels), or a state that exceeded the bound between steps only, shows as a
rebuilt y_0 that differs from z_0: every such pass warns and records the gap.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from odeify.codegen.emit import delta_graph
from odeify.core.errors import FallbackWarning
from odeify.ir.stage_ir import StageIR
from odeify.runtime.rerun import ForwardContext, ParamGrads, knot_window_inputs

__all__ = ["EXACT_COUNTS", "half_step", "integrate_reversible", "lattice_bits"]

HEADROOM_BITS = 9
"""Float64 sums of counts stay exact up to 2^9 times the input's magnitude at least (fp64 inputs)."""

FINER_BITS = 2
"""How much finer than the input dtype's precision the lattice is (see :func:`lattice_bits`)."""

EXACT_COUNTS = 2.0**52
"""Largest |count| of y or z the forward accepts: below it every sum, and d = z - y, is exact."""


def lattice_bits(dtype: torch.dtype) -> int:
    """Lattice spacing 2^-bits relative to the input: 2^2 finer than the input dtype's precision.

    26 bits for fp32 (float64 headroom 2^27), 10 for bfloat16; float64 inputs get
    53 - HEADROOM_BITS = 44 bits, coarser than their own round-off, so in fp64 the lattice trades
    2^-44 rounding for exactness. Measured on fp32 (digits stage, 256 steps, gradients against
    float64 backprop): 26 bits err 6e-7 like fp32 backprop itself (5e-7); 24 bits erred 6e-4 (a
    ReLU kink the coarser states landed on the other side of). Each bit more costs a bit of the
    stored state (see the module docstring).
    """
    precision = 1 - round(math.log2(torch.finfo(dtype).eps))  # 24 for fp32
    return min(precision + FINER_BITS, 53 - HEADROOM_BITS)


def half_step(stage: StageIR) -> Fraction:
    """h L / 2: an increment [h/2 F] is [h L / 2 * delta], delta = F / L being what the graphs evaluate.

    1/2 at native steps. Folding L here saves a multiply per evaluation and one in its VJP.
    """
    return Fraction(stage.depth, 2 * stage.steps)


def integrate_reversible(stage: StageIR, x: Tensor, knots: list[Tensor], extras: list[Tensor]) -> Tensor:
    """Run a reversible-Heun ``stage`` on ``x``; its backward rebuilds the states exactly."""
    return _ReversibleHeunAdjoint.apply(stage, len(knots), x, *knots, *extras)


@dataclass(frozen=True)
class _Field:
    """One field evaluation at z_m, at ``t`` (left limit when ``left``): A_m, B_{m-1} or both."""

    t: Fraction
    left: bool
    starts_step: bool  # A_m = F(t_m, z_m), the first evaluation of step m
    ends_step: bool  # B_{m-1} = F(t_m-, z_m), the last evaluation of step m - 1


def _fields_at(stage: StageIR, m: int) -> list[_Field]:
    """The evaluations at z_m in forward order (B_{m-1}, then A_m), one when they coincide."""
    t = Fraction(m, stage.steps)
    ends, starts = m > 0, m < stage.steps
    same = stage.field_weights(t, True) == stage.field_weights(t, False) and not stage.draws_random
    if ends and starts and same:
        return [_Field(t, True, starts_step=True, ends_step=True)]
    fields = [_Field(t, True, starts_step=False, ends_step=True)] if ends else []
    return fields + ([_Field(t, False, starts_step=True, ends_step=False)] if starts else [])


def _profiled(method):
    """Label a lattice method's tensor ops as ``odeify.lattice`` in ``torch.profiler`` traces."""

    @functools.wraps(method)
    def labelled(*args, **kwargs):
        with torch.profiler.record_function("odeify.lattice"):
            return method(*args, **kwargs)

    return labelled


class _Lattice:
    """The lattice of one pass: spacing q per sample, states as float64 counts of q.

    Per sample (q has shape (N, 1, ..., 1)), so that a sample's result does not depend on its
    batch: a data-parallel run and one process on the whole batch compute the same states.
    Updates work in place and increments go to reused buffers: a float64 state of a large stage
    is past the size malloc recycles, and allocating a fresh one per step costs more than the
    arithmetic (page faults).
    """

    def __init__(self, x: Tensor, half_step: Fraction, quantum: Tensor | None = None) -> None:
        self.dtype = x.dtype
        self.quantum = _quantum(x) if quantum is None else quantum
        # dividing by q (a power of two) is exact
        self.increment_scale = float(half_step) / self.quantum
        # counts -> dtype, then * q (exact: q is a normal power of two in dtype) is round(counts * q),
        # without a float64 temporary; fp16 could overflow on the counts, fp64 needs no rounding
        self._via_dtype = self.dtype != torch.float64 and torch.finfo(self.dtype).max > EXACT_COUNTS
        self._quantum_in_dtype = self.quantum.to(self.dtype)
        self._spare: list[Tensor] = []
        self._point: Tensor | None = None  # value()'s reused output

    def buffer(self, like: Tensor) -> Tensor:
        """A float64 tensor shaped like ``like`` (contents undefined), reused once released."""
        return self._spare.pop() if self._spare else torch.empty_like(like, dtype=torch.float64)

    def release(self, *buffers: Tensor | None) -> None:
        self._spare.extend(b for b in buffers if b is not None)

    # Mixed-dtype elementwise ops (fp32 * float64 -> float64) take a slow, unvectorised path on the
    # CPU (10x a same-dtype op here): values are copied into float64 first, then scaled in place.

    @_profiled
    def counts(self, value: Tensor) -> Tensor:
        """``value`` rounded to the lattice, in counts (exact for a value on it)."""
        return torch.empty_like(value, dtype=torch.float64).copy_(value).div_(self.quantum).round_()

    @_profiled
    def increment(self, field: Tensor, like: Tensor) -> Tensor:
        """[h/2 F] in counts, in a buffer (release it when done)."""
        return self.buffer(like).copy_(field).mul_(self.increment_scale).round_()

    @_profiled
    def value(self, counts: Tensor, reuse: bool = False) -> Tensor:
        """The lattice point ``counts * q`` rounded to the input's dtype (a new tensor).

        With ``reuse``, in one buffer that the next such call overwrites: for the walks, whose
        field evaluation at a point (and its VJP) is done before they move on.
        """
        if not self._via_dtype:
            return torch.mul(counts, self.quantum).to(self.dtype)
        if not reuse:
            return counts.to(self.dtype).mul_(self._quantum_in_dtype)
        if self._point is None:
            self._point = torch.empty_like(counts, dtype=self.dtype)
        return self._point.copy_(counts).mul_(self._quantum_in_dtype)

    @staticmethod
    @_profiled
    def add(u: Tensor, increment: Tensor, times: int) -> None:
        """u += times * increment, in place (times is 1 or 2, or -1 or -2 going back: exact)."""
        u.add_(increment, alpha=times)

    @staticmethod
    @_profiled
    def reflect(z: Tensor, u: Tensor) -> Tensor:
        """z -> 2 u - z, in place: z_{m+1} from z_m forward, z_{m-1} from z_m backward (one pass)."""
        return z.lerp_(u, 2.0)  # z + 2 (u - z): every partial result an integer below 2^54, exact

    @_profiled
    def pack(self, y: Tensor, z: Tensor, out: Tensor) -> tuple[tuple[Tensor | None, ...] | None, str]:
        """The final (y, z) in compact exact form, ``(residual of y, d = z - y, q)`` beside ``out``.

        Consumes ``z`` (d is computed in its place). Returns ``(None, why)`` when the counts
        cannot hold the state exactly. One device sync.
        """
        d = z.sub_(y)
        residual = self.buffer(y).copy_(out).div_(self.quantum).sub_(y).neg_()  # y - out / q: integers
        y_max, res_max, d_max = torch.stack([_largest(y), _largest(residual), _largest(d)]).tolist()
        if not all(map(math.isfinite, (y_max, res_max, d_max))):
            return None, "its state is not finite (a NaN or inf in the batch, or a field that overflowed)"
        z_max = y_max + d_max  # a bound on |z|, one pass fewer; d = z - y is exact below 2^53
        if max(y_max, z_max) >= EXACT_COUNTS:
            growth = math.log2(max(y_max, z_max)) - lattice_bits(self.dtype)
            return None, (
                f"its state grew to 2^{growth:.0f} times its input's magnitude, past the 2^"
                f"{52 - lattice_bits(self.dtype)} up to which the lattice's float64 arithmetic is exact"
            )
        kept = _narrowest(residual, res_max) if res_max else None  # None: out is y_N exactly
        return (kept, _narrowest(d, d_max, (torch.int32,)), self.quantum), ""

    @_profiled
    def unpack(self, out: Tensor, residual: Tensor | None, d: Tensor) -> tuple[Tensor, Tensor]:
        """(y, z) in counts from :meth:`pack`'s form."""
        y = torch.empty_like(out, dtype=torch.float64).copy_(out).div_(self.quantum)
        if residual is not None:
            y.add_(residual)
        return y, torch.add(y, d)


def _largest(t: Tensor) -> Tensor:
    """max |t| as a 0-dim tensor (NaN if any is NaN), without an |t| temporary."""
    return torch.linalg.vector_norm(t, ord=math.inf)


def _narrowest(counts: Tensor, largest: float, kinds=(torch.int8, torch.int16, torch.int32)) -> Tensor:
    """``counts`` (float64 integers, |.| <= largest) in the narrowest of ``kinds`` that holds them."""
    for kind in kinds:
        if largest <= torch.iinfo(kind).max:
            return counts.to(kind)
    return counts


def _quantum(x: Tensor) -> Tensor:
    """The lattice spacing per sample of ``x``: a power of two, 2^-bits of its max|x| rounded up.

    At least the dtype's smallest normal number, so that q and the dtype's values on the
    lattice are exact in it (only an input below 2^(bits - 126) in fp32 gets a coarser lattice).
    """
    magnitude = (
        x.detach().abs().amax(dim=tuple(range(1, x.dim())), keepdim=True) if x.dim() > 1 else x.abs().amax()
    )
    _, exponent = torch.frexp(magnitude.double())
    smallest = round(math.log2(torch.finfo(x.dtype).smallest_normal))
    exponent = (exponent - lattice_bits(x.dtype)).clamp_min(smallest)
    return torch.ldexp(torch.ones_like(magnitude, dtype=torch.float64), exponent)


class _ReversibleHeunAdjoint(torch.autograd.Function):
    """Inputs: the stage, how many knot tensors follow x, x, the knots, other trainable parameters."""

    @staticmethod
    def forward(ctx: Any, stage: StageIR, num_knots: int, x: Tensor, *params: Tensor) -> Tensor:
        context = ForwardContext.capture(x)
        lattice = _Lattice(x, half_step(stage))
        y, z = _integrate(stage, lattice, context, params[:num_knots], lattice.counts(x))
        out = lattice.value(y)
        packed, why = lattice.pack(y, z, out)
        ctx.stage, ctx.num_knots, ctx.context = stage, num_knots, context
        if packed is None:
            _note_fallback(stage, why)
            ctx.save_for_backward(*params, x)
        else:
            ctx.save_for_backward(*params, out, *packed)
        ctx.fallback = packed is None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        count = len(ctx.needs_input_grad) - 3  # the inputs after (stage, num_knots, x)
        params, state = ctx.saved_tensors[:count], ctx.saved_tensors[count:]
        grads = ParamGrads(params, ctx.num_knots, ctx.needs_input_grad[3:])
        pass_ = _ReversiblePass(ctx.stage, grads, ctx.needs_input_grad[2], ctx.context)
        with ctx.context.restored():
            if ctx.fallback:
                (x,) = state
                grad_x = pass_.from_input(x, params[: ctx.num_knots], grad_out)
            else:
                out, residual, d, quantum = state
                lattice = _Lattice(out, half_step(ctx.stage), quantum)
                grad_x = pass_.inverted(lattice, *lattice.unpack(out, residual, d), grad_out)
        return (None, None, grad_x, *grads.result())


def _integrate(
    stage: StageIR, lattice: _Lattice, context: ForwardContext, knots, y: Tensor, points: list | None = None
) -> tuple[Tensor, Tensor]:
    """The forward on the lattice from y_0 = z_0 = ``y`` (counts, updated in place); returns (y_N, z_N).

    The running sum is u: y_m after B_{m-1}'s increment, u_m = y_m + a_m after A_m's, so that
    z_{m+1} = 2 u_m - z_m is one pass (and a shared evaluation adds its increment twice, in one).
    ``points``, when given, collects every z_m as the fields saw it (backward's fallback).
    """
    u, z = y, y.clone()
    for m in range(stage.steps + 1):
        z_in = lattice.value(z, reuse=points is None)
        if points is not None:
            points.append(z_in)
        for f in _fields_at(stage, m):
            graph = delta_graph(stage, f.t, f.left)
            value = context.record((m, f.left), graph, (z_in, *knot_window_inputs(graph, knots)))
            increment = lattice.increment(value, u)
            del value
            lattice.add(u, increment, f.starts_step + f.ends_step)  # y_m = u_{m-1} + b_{m-1}; u_m = y_m + a_m
            lattice.release(increment)
        if m < stage.steps:
            z = lattice.reflect(z, u)
    return u, z


def _note_fallback(stage: StageIR, why: str) -> None:
    stats = stage.adjoint_stats
    stats.fallbacks += 1
    if stats.fallbacks == 1:
        warnings.warn(
            f"odeify: stage '{stage.stage_name}' (backward='reversible', steps={stage.steps}) cannot keep "
            f"its final state exactly: {why}. This pass keeps the stage input instead and recomputes the "
            "forward's states from it in backward (exact, memory ~ all steps' states during backward), and "
            "later passes will too whenever this happens; stage.adjoint_stats.fallbacks counts them.",
            FallbackWarning,
            stacklevel=4,
        )


class _ReversiblePass:
    """One backward pass: the points z_N .. z_0, each evaluated with grad once, stepped back exactly."""

    def __init__(self, stage: StageIR, grads: ParamGrads, needs_x: bool, context: ForwardContext) -> None:
        self.stage, self.grads, self.needs_x, self.context = stage, grads, needs_x, context
        self.steps = stage.steps

    def inverted(self, lattice: _Lattice, y: Tensor, z: Tensor, grad_out: Tensor) -> Tensor | None:
        """Walk the points by inverting the lattice steps from the final (y, z); check y_0 == z_0."""
        u = y  # y_N; then, going back, u_{m-1} = y_m - b_{m-1} and y_m = u_m - a_m (see _integrate)
        lam = _Cotangents(grad_out, self.stage)
        for m in range(self.steps, -1, -1):
            for value, times in self._point(m, lattice.value(z, reuse=True), lam):
                increment = lattice.increment(value, u)
                lattice.add(u, increment, -times)
                lattice.release(increment)
            if m > 0:
                z = lattice.reflect(z, u)  # z_{m-1} = 2 u_{m-1} - z_m
        self._check_rebuild(u, z)
        return lam.result() if self.needs_x else None

    def from_input(self, x: Tensor, knots, grad_out: Tensor) -> Tensor | None:
        """The fallback: recompute the forward from the saved input, keeping every point z_m."""
        lattice = _Lattice(x, half_step(self.stage))
        points: list[Tensor] = []
        with torch.no_grad():
            _integrate(self.stage, lattice, _Replaying(self.context), knots, lattice.counts(x), points)
        lam = _Cotangents(grad_out, self.stage)
        for m in range(self.steps, -1, -1):
            self._point(m, points.pop(), lam)
        self.stage.adjoint_stats.backward_passes += 1
        return lam.result() if self.needs_x else None

    def _check_rebuild(self, y: Tensor, z: Tensor) -> None:
        """y_0 and z_0 started equal: any gap means the rebuilt states were not the forward's."""
        stats = self.stage.adjoint_stats
        stats.backward_passes += 1
        if torch.equal(y, z):  # one pass; the norms below only when something went wrong
            stats.record([torch.zeros((), dtype=torch.float64)])
            return
        stats.record([torch.linalg.vector_norm(y - z) / torch.linalg.vector_norm(y).clamp_min(1e-300)])
        error = stats.last_errors[0]
        warnings.warn(
            f"odeify: stage '{self.stage.stage_name}' (backward='reversible') did not rebuild its "
            f"states exactly (rebuilt y0 and z0 differ by {error:.1e}, relative): its field returned "
            "other bits on a re-run, or its state outgrew exact float64 arithmetic between steps, so "
            "these gradients carry that difference, amplified by the inverse. On GPUs use "
            "deterministic kernels (torch.use_deterministic_algorithms(True), "
            "torch.backends.cudnn.benchmark = False). stage.adjoint_stats.worst_error tracks it.",
            RuntimeWarning,
            stacklevel=4,
        )

    def _point(self, m: int, z_in: Tensor, lam: _Cotangents) -> list[tuple[Tensor, int]]:
        """Evaluate the fields at z_m with grad, take their VJP, add the parameter gradients.

        Returns the detached values in the order backward undoes them (A_m, then B_{m-1}), each
        with how many increments it served in forward (2 for a shared evaluation); updates the
        cotangents.
        """
        need_z = m > 0 or self.needs_x
        fields = _fields_at(self.stage, m)
        outputs, reruns = [], []
        with torch.enable_grad():
            z_in = z_in.detach().requires_grad_(need_z)
            for f in fields:
                graph = delta_graph(self.stage, f.t, f.left)
                rerun = self.grads.rerun(graph)
                outputs.append(self.context.replay((m, f.left), graph, (z_in, *rerun.knots)))
                reruns.append(rerun)
            serves = [(f.starts_step, f.ends_step) for f in fields]
            cotangents = [c.to(v.dtype) for c, v in zip(lam.at(m, serves), outputs, strict=True)]
            wrt = ([z_in] if need_z else []) + [t for r in reruns for t in r.wrt]
            found = iter(torch.autograd.grad(outputs, wrt, cotangents, allow_unused=True) if wrt else ())
        lam.step(next(found) if need_z else None)
        for rerun in reruns:
            self.grads.add(rerun, [next(found) for _ in rerun.wrt])
        served = zip(outputs, fields, strict=True)
        return [(value.detach(), f.starts_step + f.ends_step) for value, f in served][::-1]


class _Cotangents:
    """λy, λz walking back from the output (y_N alone is the output, so λz_N = 0); updated in place."""

    def __init__(self, grad_out: Tensor, stage: StageIR) -> None:
        self.lam_y, self.lam_z = grad_out.clone(), None
        # h and h/2 times L: the graphs evaluate delta = F / L, whose cotangent is L times F's
        self.h, self.half_h = float(2 * half_step(stage)), float(half_step(stage))

    def at(self, m: int, serves: list[tuple[bool, bool]]) -> list[Tensor]:
        """The cotangent of each evaluation at z_m, given what it serves (starts, ends a step).

        cA_m = h λz_{m+1} + h/2 λy_{m+1} and cB_{m-1} = h/2 λy_m; moves λy to y_m. A shared
        evaluation gets their sum, h λy_m (two passes instead of five).
        """
        if self.lam_z is None:  # m = N: only B_{N-1}
            return [self.lam_y * self.half_h]
        if serves == [(True, True)]:
            self.lam_y.add_(self.lam_z, alpha=2)
            return [self.lam_y * self.h]
        cot_start = torch.mul(self.lam_z, self.h).add_(self.lam_y, alpha=self.half_h)
        self.lam_y.add_(self.lam_z, alpha=2)
        return [cot_start if starts else self.lam_y * self.half_h for starts, _ in serves]

    def step(self, grad_z: Tensor | None) -> None:
        """λz_m = -λz_{m+1} + (the VJP's gradient w.r.t. z_m)."""
        if self.lam_z is None:
            self.lam_z = grad_z
        elif grad_z is None:
            self.lam_z.neg_()
        else:
            self.lam_z = grad_z.sub_(self.lam_z)

    def result(self) -> Tensor:
        """The gradient w.r.t. x, which fed both y_0 and z_0."""
        return self.lam_y.add_(self.lam_z)


class _Replaying:
    """A stand-in for :class:`ForwardContext` whose ``record`` replays the forward's draws instead."""

    def __init__(self, context: ForwardContext) -> None:
        self.context = context

    def record(self, key: Any, graph, args) -> Tensor:
        return self.context.replay(key, graph, args)
