"""The settings a stage accepts, and their checks: importable without torch (the CLI's parser reads them).

Every check raises :class:`~odeify.core.errors.ConfigError` naming the setting, what it got and what
to use instead, where the value enters (``ODEStage.configure``, ``convert``, the CLI).
:class:`StageSettings` is a stage's manifestation as one frozen value: a stage swaps it whole, so a
refused ``configure`` changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from odeify.core.errors import ConfigError
from odeify.numerics.bases import get_basis
from odeify.numerics.tableaus import AsyncLeapfrog, Integrator, ReversibleScheme

__all__ = [
    "BACKWARD_MODES",
    "BackwardMode",
    "StageSettings",
    "validate_backward",
    "validate_checkpoint_every",
    "validate_midpoints",
    "validate_steps",
]

BACKWARD_MODES = ("backprop", "checkpoint", "reverse", "reversible")
"""The one list of backward mode names: the runtime's dispatch table covers every one but backprop."""
BackwardMode = Literal["backprop", "checkpoint", "reverse", "reversible"]


@dataclass(frozen=True)
class StageSettings:
    """How a stage is manifested: weight-path basis, integrator, steps, backward mode, checkpoint spacing.

    ``checkpoint_every=k`` makes ``backward='checkpoint'`` keep every k-th step's state.
    """

    basis: str
    integrator: Integrator
    steps: int
    backward: BackwardMode
    checkpoint_every: int = 1


def _positive_int(value: object, what: str, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive integer ({meaning}); got {value!r}.")
    return value


def validate_steps(steps: object, stage: str) -> int:
    return _positive_int(steps, f"steps for stage '{stage}'", "or 'native' for the original depth")


def validate_checkpoint_every(every: object, stage: str) -> int:
    return _positive_int(
        every,
        f"checkpoint_every for stage '{stage}'",
        "1 keeps every step's state, k keeps every k-th and recomputes the rest",
    )


def validate_backward(mode: object, integrator: Integrator) -> BackwardMode:
    if mode not in BACKWARD_MODES:
        raise ConfigError(f"unknown backward mode {mode!r}; choose one of {', '.join(BACKWARD_MODES)}.")
    if mode == "reversible" and not isinstance(integrator, ReversibleScheme):
        raise ConfigError(
            f"backward='reversible' needs an algebraically reversible integrator, but the stage uses "
            f"'{integrator.name}'. Use integrator='alf' (one field evaluation per step) or "
            f"'reversible_heun' with backward='reversible', or keep '{integrator.name}' with "
            "backward='checkpoint' (exact) or 'reverse' (approximate, memory-free)."
        )
    if mode == "reverse" and isinstance(integrator, ReversibleScheme):
        raise ConfigError(
            "backward='reverse' rebuilds states by stepping backward with an explicit tableau; "
            f"integrator='{integrator.name}' is inverted exactly instead: use backward='reversible'."
        )
    return mode  # type: ignore[return-value]


def validate_midpoints(integrator: Integrator, basis: str, knots: int, steps: int, stage: str) -> None:
    """Refuse ALF where a step's midpoint, its one evaluation, falls on a jump of the weight path.

    There the midpoint would read one of the two cells its step covers, arbitrarily (at half the
    native steps on the piecewise-constant path: one block of every two). A path jumps only at a
    knot, so only midpoints on a knot are compared, exactly, from both sides.
    """
    if not isinstance(integrator, AsyncLeapfrog):
        return
    path = get_basis(basis)
    for n in range(steps):
        t = Fraction(2 * n + 1, 2 * steps)
        if (t * knots).denominator == 1 and path.coefficients(knots, t, True) != path.coefficients(knots, t):
            raise ConfigError(
                f"integrator='{integrator.name}' evaluates the field once per step, at the step's midpoint; "
                f"with {steps} steps over the {knots} '{basis}' knots of stage '{stage}', step {n}'s "
                f"midpoint t = {t} falls on a jump of the weight path, where it would read one of the two "
                "blocks its step covers (at half the native steps: one block of every two). Use "
                "integrator='reversible_heun' at these steps (exact and memory-free too; it reads both), "
                "ALF at a multiple of the knots (steps='native', 'x2', ...), or basis='linear'."
            )
