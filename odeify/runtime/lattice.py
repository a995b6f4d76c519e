"""The fixed-point lattice that makes a reversible scheme's inverse exact in floating point.

A plain floating-point inverse amplifies round-off (reversible Heun's about 3x per step on an
expansive stage: fp32 gradients drifted 1e-3..1e-2 from backprop). Here a state register lives on
a lattice: integer multiples of a power of two q, 2^-bits of each sample's largest input
magnitude (rounded up to a power of two; bits from :func:`lattice_bits`), held as counts of q in
float64, and every field increment is rounded to the lattice ([.]) before it is added. Sums of
counts are exact in float64 while below 2^53 (registers are kept below :data:`EXACT_COUNTS`,
2^(52 - bits) times the input's magnitude: 2^24 for fp32 inputs), so undoing an addition rebuilds
its register bit for bit, provided the field returns the same bits for the same input: CPU
kernels do; on GPU use deterministic kernels. The field runs in the input's dtype on the register
rounded to it, so its Jacobians are the ones backprop uses; only the state arithmetic is finer
than the unrolled graph's.

What the forward keeps of its final registers (:meth:`Lattice.pack`), at any depth:

- the output register rounded to the input's dtype, which the model keeps anyway (the next part
  of the model saves it; the Function saves the same storage, counted once);
- its rounding residual in counts, in the narrowest integer type that holds it (int8 while the
  stage grows its input by less than about 2^4 for fp32; nothing when the output is exact in the
  dtype, as in fp64);
- every other register as int32 counts while they fit (else in 5 to 7 bytes a count, halved
  first where the scheme's ops keep it even): as its difference from the output (reversible
  Heun's z - y) or as itself (ALF's p = h/2 v), as the scheme says;
- the spacing q per sample.

For fp32 that was 1.25 states beside the output at 26 bits on the models measured (``benchmarks/
lattice_range.py``), 1.75 where a stage outgrows its input by 2^13 (resnet152's layer3). A
register past 2^52 counts, or not finite (a NaN or inf sample), cannot be kept exactly:
:meth:`Lattice.pack` says why, and the caller falls back (:mod:`odeify.runtime.reversible`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fractions import Fraction

import torch
from torch import Tensor

from odeify.ir.stage_ir import StageIR
from odeify.numerics.schemes import ReversibleScheme

__all__ = ["EXACT_COUNTS", "Lattice", "half_step", "lattice_bits"]

HEADROOM_BITS = 9
"""Float64 sums of counts stay exact up to 2^9 times the input's magnitude at least (fp64 inputs)."""

FINER_BITS = 4
"""How much finer than the input dtype's precision the lattice is (see :func:`lattice_bits`)."""

EXACT_COUNTS = 2.0**52
"""Largest |count| of a register the forward accepts: below it every sum and difference is exact."""


def lattice_bits(dtype: torch.dtype) -> int:
    """Lattice spacing 2^-bits relative to the input: 2^4 finer than the input dtype's precision.

    28 bits for fp32 (float64 headroom 2^25), 12 for bfloat16; float64 inputs get
    53 - HEADROOM_BITS = 44 bits, coarser than their own round-off, so in fp64 the lattice trades
    2^-44 rounding for exactness. The spacing is one per sample, relative to its largest value, so
    the lattice is coarser than fp32 for a sample's small values: a ViT's token activations, whose
    largest values stand far above the rest. Measured on fp32 gradients against float64 backprop
    (vit_small_patch16_224, random weights, batch 4, 224x224, Lie-Trotter ALF, native steps):
    26 bits erred 2.09e-6, 28 bits 1.16e-6, 30 bits 1.10e-6, fp32 backprop 1.13e-6; on the digits
    stage (256 steps) 26 bits erred 6e-7 like fp32 backprop (5e-7), 24 bits 6e-4 (a ReLU kink the
    coarser states landed on the other side of). Each bit more costs a bit of the stored state (see
    the module docstring): 28 bits against 26 keep the same bytes on vit_small and resnet50
    (trained-like weights), 4.6 MiB more of 111 on resnet152 (benchmarks/train_step.py's rows).
    """
    precision = 1 - round(math.log2(torch.finfo(dtype).eps))  # 24 for fp32
    return min(precision + FINER_BITS, 53 - HEADROOM_BITS)


def half_step(stage: StageIR) -> Fraction:
    """h L / 2: an increment [h/2 F] is [h L / 2 * delta], delta = F / L being what the graphs evaluate.

    1/2 at native steps. Folding L here saves a multiply per evaluation and one in its VJP.
    """
    return Fraction(stage.depth, 2 * stage.steps)


def _profiled(method):
    """Label a lattice method's tensor ops as ``odeify.lattice`` in ``torch.profiler`` traces."""

    @functools.wraps(method)
    def labelled(*args, **kwargs):
        with torch.profiler.record_function("odeify.lattice"):
            return method(*args, **kwargs)

    return labelled


class Lattice:
    """The lattice of one pass: spacing q per sample, registers as float64 counts of q.

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
        # h L / 2 a power of two up to 1 (native depth, 2x, 4x...): field * scale is exact in the dtype
        # (scale <= 2^126: q >= the smallest normal) and so is its rounding, so an increment's counts
        # can be made at the dtype's width, then widened: the same integers in 28 bytes a value, not 44
        # (an increment past the dtype's range, 2^102 times the stage input's largest value in fp32,
        # is inf here where float64 held it: a state the pack refuses either way, with the reason)
        self._narrow_increments = self._via_dtype and _is_power_of_two(half_step) and half_step <= 1
        self._narrow_scales: dict[int, Tensor | None] = {}
        self._scratch: Tensor | None = None  # the dtype-wide increment, reused
        self._spare: list[Tensor] = []
        self._points: dict[str, Tensor] = {}  # value()'s reused outputs, one per register

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
    def increment(self, field: Tensor, like: Tensor, finer: int = 0) -> Tensor:
        """[h/2 F] in counts of a lattice ``finer`` bits finer than q, in a buffer (release it when done)."""
        scale = self.increment_scale if not finer else self.increment_scale * 2.0**finer
        narrow_scale = self._narrow_scale(scale, finer) if field.dtype == self.dtype else None
        if narrow_scale is None:
            return self.buffer(like).copy_(field).mul_(scale).round_()
        if self._scratch is None or self._scratch.shape != field.shape:
            self._scratch = torch.empty_like(field)
        narrow = torch.mul(field, narrow_scale, out=self._scratch).round_()
        return self.buffer(like).copy_(narrow)

    def _narrow_scale(self, scale: Tensor, finer: int) -> Tensor | None:
        """``scale`` in the input's dtype, once per ``finer``; None where increments must be made in
        float64: no narrow path, or 2^finer / q past the dtype's range (inputs below 2^-97 in fp32)."""
        if finer not in self._narrow_scales:
            narrow = scale.to(self.dtype) if self._narrow_increments else None
            finite = narrow is not None and bool(torch.isfinite(narrow).all())
            self._narrow_scales[finer] = narrow if finite else None
        return self._narrow_scales[finer]

    @_profiled
    def value(self, counts: Tensor, reuse: str | None = None) -> Tensor:
        """The lattice point ``counts * q`` rounded to the input's dtype (a new tensor).

        With ``reuse``, in that name's buffer, which the next such call for the name overwrites:
        for a register's value, used by its evaluations until the register changes.
        """
        if not self._via_dtype:
            return torch.mul(counts, self.quantum).to(self.dtype)
        if reuse is None:
            return counts.to(self.dtype).mul_(self._quantum_in_dtype)
        point = self._points.get(reuse)
        if point is None:
            point = self._points[reuse] = torch.empty_like(counts, dtype=self.dtype)
        return point.copy_(counts).mul_(self._quantum_in_dtype)

    @_profiled
    def add(self, target: Tensor, source: Tensor, times: int, finer: int = 0) -> None:
        """target += times * source, in place (times a small integer, negative going back: exact).

        ``finer``: how many bits finer the source's lattice is; it is rounded to the target's first.
        """
        rounded = self.on_target_lattice(source, finer)
        target.add_(rounded, alpha=times)
        if rounded is not source:
            self.release(rounded)

    @_profiled
    def reflect(self, target: Tensor, about: Tensor, finer: int = 0) -> None:
        """target -> 2 about - target, in place (its own inverse); ``about`` as in :meth:`add`."""
        rounded = self.on_target_lattice(about, finer)
        target.lerp_(rounded, 2.0)  # target + 2 (about - target): every partial result an integer below 2^54
        if rounded is not about:
            self.release(rounded)

    def on_target_lattice(self, source: Tensor, finer: int) -> Tensor:
        """``source`` in counts of a lattice ``finer`` bits coarser (rounded; exact when ``finer`` <= 0)."""
        if finer == 0:
            return source
        out = torch.mul(source, 2.0**-finer, out=self.buffer(source))
        return out.round_() if finer > 0 else out

    @_profiled
    def pack(
        self, registers: Sequence[Tensor], scheme: ReversibleScheme
    ) -> tuple[Tensor, tuple[Tensor | None, ...] | None, str]:
        """The output register (the first) rounded to the input's dtype, and the final registers in
        compact exact form beside it: ``(residual of the output, each other register as the
        scheme's layout keeps it, q)``.

        Consumes the registers (a relative one becomes its difference in place). The compact form
        is None, with the reason, when the counts cannot hold the state exactly. One device sync
        (two when the residual's bound sits exactly on an integer type's edge).
        """
        layout = scheme.registers
        first = registers[0]
        out, residual = self._rounded(first)
        kinds = [how.kept for how in layout[1:]]
        pairs = zip(registers[1:], kinds, strict=True)
        others = [r.sub_(first) if kind == "relative" else r for r, kind in pairs]
        largest = torch.stack([_largest(t) for t in (first, *others)]).tolist()
        if not all(map(math.isfinite, largest)):
            why = "its state is not finite (a NaN or inf in the batch, or a field that overflowed)"
            return out, None, why
        first_max, *other_max = largest
        # a relative register's bound is |first| + |its difference|: one pass fewer than its own max
        pairs = zip(other_max, kinds, strict=True)
        bounds = [first_max, *(m + first_max * (kind == "relative") for m, kind in pairs)]
        if max(bounds) >= EXACT_COUNTS:
            growth = math.log2(max(bounds)) - lattice_bits(self.dtype)
            return (
                out,
                None,
                (
                    f"its state grew to 2^{growth:.0f} times its input's magnitude, past the 2^"
                    f"{52 - lattice_bits(self.dtype)} up to which the lattice's float64 arithmetic is exact"
                ),
            )
        kept = None if residual is None else _narrowest(residual, self._half_ulp(first_max))
        even = [how.name in scheme.even_registers for how in layout[1:]]
        compact = [_compact(t, m, e) for t, m, e in zip(others, other_max, even, strict=True)]
        return out, (kept, *compact, self.quantum), ""

    def _rounded(self, counts: Tensor) -> tuple[Tensor, Tensor | None]:
        """``counts * q`` in the input's dtype (a new tensor) and what that rounding left, in counts
        (None where it is exact: float64 inputs). Four passes: two fewer than value(), then the
        difference from it."""
        if not self._via_dtype:
            return self.value(counts), None
        low = counts.to(self.dtype)  # counts rounded to the dtype; * q (a power of two) is exact
        widened = self.buffer(counts).copy_(low)
        return low.mul_(self._quantum_in_dtype), torch.sub(counts, widened, out=widened)

    def _half_ulp(self, largest: float) -> float:
        """A bound on the rounding residual of counts up to ``largest``: half a unit in the last place
        of the input's dtype at ``largest`` (so no pass over the residual is needed to size it)."""
        mantissa = 1 - round(math.log2(torch.finfo(self.dtype).eps))  # 24 for fp32
        return 2.0 ** (math.frexp(largest)[1] - 1 - mantissa) if largest else 0.0

    @_profiled
    def unpack(self, out: Tensor, packed: Sequence[Tensor | None], scheme: ReversibleScheme) -> list[Tensor]:
        """The registers in counts from :meth:`pack`'s form (without its q)."""
        layout = scheme.registers
        residual, *others = packed
        first = torch.empty_like(out, dtype=torch.float64).copy_(out).div_(self.quantum)
        rebuilt = [torch.empty_like(first) for _ in others]
        if residual is not None:
            # widened in a register's buffer first: adding int8 to float64 takes a slow mixed-dtype path
            widened = rebuilt[0] if rebuilt else torch.empty_like(first)
            first.add_(widened.copy_(residual))
        for register, kept, how in zip(rebuilt, others, layout[1:], strict=True):
            _expanded(kept, into=register, even=how.name in scheme.even_registers)
            if how.kept == "relative":
                register.add_(first)
        return [first, *rebuilt]


def _largest(t: Tensor) -> Tensor:
    """max |t| as a 0-dim tensor (NaN if any is NaN), in one pass without an |t| temporary (``aminmax``
    reads the tensor once: 3x faster than ``vector_norm(ord=inf)`` on a resnet50 stage's state)."""
    low, high = torch.aminmax(t)
    return torch.maximum(high, -low)


def _narrowest(counts: Tensor, largest: float, kinds=(torch.int8, torch.int16, torch.int32)) -> Tensor:
    """``counts`` (float64 integers, |.| <= largest) in the narrowest of ``kinds`` that holds them.

    A bound of exactly 2^7, 2^15 or 2^31 (half a unit in the last place, as the output's residual's
    is) is reached only by exact ties, so there the counts themselves are looked at: one pass, and
    int16 rather than int32 for a stage whose output is 2^39..2^40 counts.
    """
    for kind in kinds:
        limit = torch.iinfo(kind).max
        if largest == limit + 1:
            largest = float(_largest(counts))
        if largest <= limit:
            return counts.to(kind)
    return counts


def _compact(counts: Tensor, largest: float, even: bool = False) -> Tensor:
    """A register's counts (float64 integers, |.| <= largest < 2^52) as int32 while they fit, else in
    the fewest little-endian bytes that hold them (uint8 with a trailing axis of 5 to 7 bytes, not
    float64's 8). An ``even`` register (:attr:`ReversibleScheme.even_registers`) is kept halved in
    that form (4 to 7 bytes): ALF's p on resnet152's 35-block layer3 reaches 2^40 counts, 5 bytes
    halved where it would take 6. Undone by :func:`_expanded`."""
    if largest <= torch.iinfo(torch.int32).max:
        return counts.to(torch.int32)
    if even:
        counts, largest = counts.mul_(0.5), largest / 2  # even integers: exact
    width = next(k for k in range(4, 8) if largest < 2.0 ** (8 * k - 1))
    whole = counts.to(torch.int64).unsqueeze(-1).view(torch.uint8)  # 8 bytes, little-endian
    return whole[..., :width].contiguous()


def _expanded(kept: Tensor, into: Tensor, even: bool = False) -> Tensor:
    """The float64 counts :func:`_compact` kept, written into ``into`` (a float64 tensor of their shape)."""
    if kept.dtype != torch.uint8:
        return into.copy_(kept)
    width = kept.shape[-1]
    sign = (kept[..., -1:] >= 128).to(torch.uint8) * 255  # sign-extend to 8 bytes
    whole = torch.cat([kept, sign.expand(*kept.shape[:-1], 8 - width)], dim=-1)
    into.copy_(whole.view(torch.int64).squeeze(-1))
    return into.mul_(2) if even else into


def _is_power_of_two(value: Fraction) -> bool:
    """Whether ``value`` is 2^k for an integer k (numerator and denominator both powers of two)."""
    return all(n > 0 and n & (n - 1) == 0 for n in (value.numerator, value.denominator))


def _quantum(x: Tensor) -> Tensor:
    """The lattice spacing per sample of ``x``: a power of two, 2^-bits of its max|x| rounded up.

    At least the dtype's smallest normal number, so that q and the dtype's values on the
    lattice are exact in it (only an input below 2^(bits - 126) in fp32 gets a coarser lattice).
    """
    if x.dim() > 1:  # amax and amin along a dim: 6x faster on the CPU than aminmax along it, NaN alike
        rows = x.detach().flatten(1)
        low, high = rows.amin(dim=1), rows.amax(dim=1)
    else:
        low, high = torch.aminmax(x.detach())
    magnitude = torch.maximum(high, -low).reshape(-1, *([1] * (x.dim() - 1)))
    _, exponent = torch.frexp(magnitude.double())
    smallest = round(math.log2(torch.finfo(x.dtype).smallest_normal))
    exponent = (exponent - lattice_bits(x.dtype)).clamp_min(smallest)
    return torch.ldexp(torch.ones_like(magnitude, dtype=torch.float64), exponent)
