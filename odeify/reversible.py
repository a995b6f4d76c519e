"""``backward='reversible'``: reversible Heun's memory-free backward, exact to the last bit.

Reversible Heun (Kidger et al. 2021) keeps a pair (y, z) and is invertible in exact arithmetic.
In floating point its inverse amplifies round-off, about 3x per step on an expansive stage, so
fp32 gradients drifted 1e-3..1e-2 from backprop. Here the state lives on a fixed-point lattice:
float64 multiples of a power of two q, 2^-bits of each sample's largest magnitude (rounded up to
a power of two; bits from :func:`lattice_bits`), and every increment is rounded to the lattice
([.]) before it is added:

    a_n = [h/2 F(t_n, z_n)],     z_{n+1} = 2 y_n - z_n + 2 a_n,
    b_n = [h/2 F(t_{n+1}-, z_{n+1})],     y_{n+1} = y_n + a_n + b_n.

Sums of lattice values are exact in float64 while below 2^53 q (2^(53 - bits) times the input's
magnitude), so the inverse z_n = 2 y_{n+1} - z_{n+1} - 2 b_n, y_n = y_{n+1} - a_n - b_n
rebuilds every state bit for bit, provided F returns the same bits for the same input: CPU
kernels do; on GPU set ``torch.backends.cudnn.deterministic = True``. F runs in the input's dtype
on z rounded to it, so its Jacobians are the ones backprop uses; only the state arithmetic is
finer than the unrolled graph's (whose output differs by its own round-off).

Backward walks the points z_N, ..., z_0. At each it evaluates the fields at z_m with grad
(B_{m-1} = F(t_m-, z_m) and A_m = F(t_m, z_m); one evaluation when the weight path is continuous
at t_m and nothing random is drawn), takes one vector-Jacobian product with the cotangents

    λy_m = λy_{m+1} + 2 λz_{m+1},    cA_m = h λz_{m+1} + h/2 λy_{m+1},    cB_{m-1} = h/2 λy_m,
    λz_m = -λz_{m+1} + J_A^T cA_m + J_B^T cB_{m-1},

and steps the lattice state back with the same evaluations' values. Every field is evaluated
once in forward and once, with grad, in backward; the saved state is (y_N, z_N) at any depth.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from odeify.emit import field_graph
from odeify.ir import StageIR
from odeify.rerun import ParamGrads, autocast_state, knot_window_inputs
from odeify.rng_tape import Generators, record, replay

__all__ = ["integrate_reversible", "lattice_bits"]

HEADROOM_BITS = 9
"""Float64 sums of lattice values stay exact up to 2^9 times the input's magnitude at least."""


def lattice_bits(dtype: torch.dtype) -> int:
    """Lattice spacing 2^-bits relative to the input: 2^8 finer than ``dtype``'s unit round-off.

    32 bits for fp32 (headroom 2^21); float64 inputs get 53 - HEADROOM_BITS = 44 bits, coarser
    than their own round-off, so in fp64 the lattice trades 2^-44 rounding for exactness.
    """
    precision = 1 - round(math.log2(torch.finfo(dtype).eps))  # 24 for fp32
    return min(precision + 8, 53 - HEADROOM_BITS)


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
    same = (
        stage.row(t, True) == stage.row(t, False)
        and stage.variant_index(t, True) == stage.variant_index(t, False)
        and not stage.draws_random
    )
    if ends and starts and same:
        return [_Field(t, True, starts_step=True, ends_step=True)]
    fields = [_Field(t, True, starts_step=False, ends_step=True)] if ends else []
    return fields + ([_Field(t, False, starts_step=True, ends_step=False)] if starts else [])


def _quantum(x: Tensor) -> Tensor:
    """The lattice spacing per sample of ``x``: a power of two, 2^-bits of its max|x| rounded up.

    Per sample (shape (N, 1, ..., 1)), so that a sample's result does not depend on the rest of
    its batch: a data-parallel run and one process on the whole batch compute the same states.
    """
    magnitude = (
        x.detach().abs().amax(dim=tuple(range(1, x.dim())), keepdim=True) if x.dim() > 1 else x.abs().amax()
    )
    _, exponent = torch.frexp(magnitude.double())
    return torch.ldexp(torch.ones_like(magnitude, dtype=torch.float64), exponent - lattice_bits(x.dtype))


def _lattice(value: Tensor, scale: float, quantum: Tensor) -> Tensor:
    """``scale * value`` rounded to the nearest multiple of ``quantum``, in float64."""
    return value.to(torch.float64, copy=True).mul_(scale).div_(quantum).round_().mul_(quantum)


class _ReversibleHeunAdjoint(torch.autograd.Function):
    """Inputs: the stage, how many knot tensors follow x, x, the knots, other trainable parameters."""

    @staticmethod
    def forward(ctx: Any, stage: StageIR, num_knots: int, x: Tensor, *params: Tensor) -> Tensor:
        knots, rng = params[:num_knots], Generators(x.device)
        half_h = 0.5 / stage.steps
        quantum = _quantum(x)
        y = z = _lattice(x, 1.0, quantum)
        tapes = {}
        a = b = torch.zeros((), dtype=torch.float64, device=x.device)
        for m in range(stage.steps + 1):
            z_in = z.to(x.dtype)
            for f in _fields_at(stage, m):
                graph = field_graph(stage, f.t, f.left)
                value, tapes[m, f.left] = record(graph, (z_in, *knot_window_inputs(graph, knots)), rng)
                if f.ends_step:
                    b = _lattice(value, half_h, quantum)
                    y = y + a + b  # y_m = y_{m-1} + a_{m-1} + b_{m-1}
                if f.starts_step:
                    a = _lattice(value, half_h, quantum)
            if m < stage.steps:
                z = 2 * y - z + 2 * a  # z_{m+1} = 2 y_m - z_m + 2 a_m
        ctx.stage, ctx.num_knots, ctx.tapes, ctx.rng = stage, num_knots, tapes, rng
        ctx.autocast = autocast_state(x.device)
        ctx.save_for_backward(*params, y, z, quantum)
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        *params, y, z, quantum = ctx.saved_tensors
        grads = ParamGrads(params, ctx.num_knots, ctx.needs_input_grad[3:])
        outer = ctx.rng.get()
        try:
            with torch.autocast(**ctx.autocast):  # re-runs see the forward's mixed precision
                grad_x = _Backward(ctx, grads, quantum).run(y, z, grad_out)
        finally:
            ctx.rng.set(outer)
        return (None, None, grad_x, *grads.result())


class _Backward:
    """One backward pass: the points z_N .. z_0, each evaluated with grad once, stepped back exactly."""

    def __init__(self, ctx: Any, grads: ParamGrads, quantum: Tensor) -> None:
        self.stage, self.tapes, self.rng = ctx.stage, ctx.tapes, ctx.rng
        self.needs_x = ctx.needs_input_grad[2]
        self.grads, self.quantum = grads, quantum

    def run(self, y: Tensor, z: Tensor, grad_out: Tensor) -> Tensor | None:
        steps = self.stage.steps
        h, half_h = 1.0 / steps, 0.5 / steps
        lam_y, lam_z = grad_out, None  # cotangents of (y_{m+1}, z_{m+1}); y_N alone is the output
        b = None  # b_m, from the point after
        for m in range(steps, -1, -1):
            if lam_z is None:
                cot_start, cot_end = None, half_h * lam_y
            else:
                cot_start = h * lam_z + half_h * lam_y
                lam_y = lam_y + 2 * lam_z
                cot_end = half_h * lam_y
            values, grad_z = self._point(m, z, grad_out.dtype, cot_start, cot_end)
            lam_z = grad_z if lam_z is None else (-lam_z if grad_z is None else grad_z - lam_z)
            if m < steps:
                y = y - _lattice(values[True], half_h, self.quantum) - b  # y_m = y_{m+1} - a_m - b_m
            if m > 0:
                b = _lattice(values[False], half_h, self.quantum)  # b_{m-1}
                z = 2 * y - z - 2 * b  # z_{m-1} = 2 y_m - z_m - 2 b_{m-1}
        stats = self.stage.adjoint_stats
        stats.backward_passes += 1
        stats.record([torch.linalg.vector_norm(y - z) / torch.linalg.vector_norm(y).clamp_min(1e-300)])
        if stats.last_errors[0] > 0 and not stats.warned:
            stats.warned = True
            warnings.warn(
                f"odeify: stage '{self.stage.stage_name}' (backward='reversible') did not rebuild its "
                f"states exactly (rebuilt y0 and z0 differ by {stats.last_errors[0]:.1e}, relative): its "
                "field returned other bits on a re-run, so the gradients carry that difference, amplified "
                "by the inverse. On GPUs use deterministic kernels "
                "(torch.use_deterministic_algorithms(True), torch.backends.cudnn.benchmark = False); "
                "a state past 2^(53 - bits) lattice spacings "
                "(odeify.reversible.lattice_bits) also loses exactness. stage.adjoint_stats tracks it.",
                RuntimeWarning,
                stacklevel=2,
            )
        return lam_y + lam_z if self.needs_x else None

    def _point(
        self, m: int, z: Tensor, dtype: torch.dtype, cot_start: Tensor | None, cot_end: Tensor | None
    ) -> tuple[dict[bool, Tensor], Tensor | None]:
        """Evaluate the fields at z_m with grad, take their VJP, add the parameter gradients.

        Returns the detached values (``True``: A_m, ``False``: B_{m-1}) and the gradient w.r.t. z_m.
        """
        need_z = m > 0 or self.needs_x
        values: dict[bool, Tensor] = {}
        outputs, cotangents, reruns = [], [], []
        with torch.enable_grad():
            z_in = z.to(dtype).requires_grad_(need_z)
            for f in _fields_at(self.stage, m):
                graph = field_graph(self.stage, f.t, f.left)
                rerun = self.grads.rerun(graph)
                value = replay(graph, (z_in, *rerun.knots), self.tapes[m, f.left], self.rng)
                parts = [c for c, use in ((cot_start, f.starts_step), (cot_end, f.ends_step)) if use]
                for serves, use in ((True, f.starts_step), (False, f.ends_step)):
                    if use:
                        values[serves] = value.detach()
                outputs.append(value)
                cotangents.append(sum(parts[1:], parts[0]).to(value.dtype))
                reruns.append(rerun)
            wrt = ([z_in] if need_z else []) + [t for r in reruns for t in r.wrt]
            found = iter(torch.autograd.grad(outputs, wrt, cotangents, allow_unused=True) if wrt else ())
        grad_z = next(found) if need_z else None
        for rerun in reruns:
            self.grads.add(rerun, [next(found) for _ in rerun.wrt])
        return values, grad_z
