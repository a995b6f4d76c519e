"""Splitting schemes as data: how a stage of p sub-fields, dx/dt = F_1 + ... + F_p, takes a step.

A transformer block is two residual sub-blocks, ``x + attn(x)`` then ``x + mlp(x)``: one step of
*Lie-Trotter splitting* (each sub-field an Euler sub-step in turn) of dx/dt = F_attn + F_mlp, so
at native depth that scheme is the network. A :class:`Splitting` names the sub-steps of one step
as (sub-field, where its sub-interval starts, its length), in fractions of the step, and the
explicit tableau (by name, :data:`odeify.numerics.tableaus.TABLEAUS`) that integrates each one.
Each sub-field keeps its own clock: a sub-step over [a, a + l] of the step evaluates its field's
weights at times in that interval, which makes Strang splitting of the time-dependent field
second order (it is Strang splitting of the autonomous system with one clock per sub-field).

- ``lie_trotter``: F_1, ..., F_p, one full Euler sub-step each; first order; the network at native
  depth (docs/split-stages.md).
- ``strang``: F_1 .. F_{p-1} half sub-steps, F_p a full one, then F_{p-1} .. F_1 half sub-steps
  over the step's second half (half attention, full MLP, half attention: Lu et al. 2019's Macaron
  form), each sub-step by the explicit midpoint rule so that the composition is second order.
- ``lie_trotter_alf``, ``strang_alf``, ``lie_trotter_reversible_heun``, ``strang_reversible_heun``:
  the same orders with every sub-step a step of a reversible scheme
  (:mod:`odeify.numerics.schemes`), so the split step inverts exactly (``backward='reversible'``;
  :meth:`Splitting.scheme` is its register program). On a split stage ``alf`` and
  ``reversible_heun`` mean their Lie-Trotter splittings.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from odeify.numerics.schemes import REVERSIBLE_SCHEMES, SplitScheme, validate_scheme

__all__ = ["SPLITTINGS", "SubStep", "Splitting"]


@dataclass(frozen=True)
class SubStep:
    """Integrate sub-field ``field`` over ``[start, start + length]`` of the step (fractions of h)."""

    field: int
    start: Fraction
    length: Fraction


@dataclass(frozen=True)
class Splitting:
    """A splitting scheme: the sub-steps of one step, for any number of sub-fields.

    ``pattern`` is ``sequential`` (each sub-field once over the whole step, in order) or
    ``symmetric`` (Strang: the first p - 1 sub-fields over each half of the step, around the last
    over the whole step). ``substep`` names the tableau (:data:`odeify.numerics.tableaus.TABLEAUS`)
    or the reversible scheme (:data:`odeify.numerics.schemes.REVERSIBLE_SCHEMES`) each sub-step runs.
    """

    name: str
    order: int
    pattern: Literal["sequential", "symmetric"]
    substep: str

    def substeps(self, fields: int) -> tuple[SubStep, ...]:
        """The sub-steps of one step of a stage with ``fields`` sub-fields, in the order they run."""
        whole, half = Fraction(1), Fraction(1, 2)
        if self.pattern == "sequential" or fields == 1:
            return tuple(SubStep(i, Fraction(0), whole) for i in range(fields))
        first = [SubStep(i, Fraction(0), half) for i in range(fields - 1)]
        second = [SubStep(i, half, half) for i in reversed(range(fields - 1))]
        return (*first, SubStep(fields - 1, Fraction(0), whole), *second)

    @property
    def reversible(self) -> bool:
        """Whether every sub-step is a reversible scheme's step (``backward='reversible'`` runs it)."""
        return self.substep in REVERSIBLE_SCHEMES

    def scheme(self, fields: int) -> SplitScheme:
        """The register program of one step over ``fields`` sub-fields (a reversible splitting's)."""
        return _split_scheme(self, fields)


@functools.cache
def _split_scheme(splitting: Splitting, fields: int) -> SplitScheme:
    parts = tuple((s.field, s.start, s.length) for s in splitting.substeps(fields))
    scheme = SplitScheme(splitting.name, splitting.order, REVERSIBLE_SCHEMES[splitting.substep], parts)
    validate_scheme(scheme)
    return scheme


SPLITTINGS: dict[str, Splitting] = {
    s.name: s
    for s in (
        Splitting("lie_trotter", 1, "sequential", "euler"),
        Splitting("strang", 2, "symmetric", "midpoint"),
        Splitting("lie_trotter_alf", 1, "sequential", "alf"),
        Splitting("strang_alf", 2, "symmetric", "alf"),
        Splitting("lie_trotter_reversible_heun", 1, "sequential", "reversible_heun"),
        Splitting("strang_reversible_heun", 2, "symmetric", "reversible_heun"),
    )
}
"""The built-in splitting schemes by name (a split stage runs any of them; other stages none)."""
