"""The settings a stage accepts, and their checks: importable without torch (the CLI's parser reads them).

Every check raises :class:`~odeify.core.errors.ConfigError` naming the setting, what it got and what
to use instead, where the value enters (``ODEStage.configure``, ``convert``, the CLI).
"""

from __future__ import annotations

from typing import Literal

from odeify.core.errors import ConfigError
from odeify.numerics.tableaus import Integrator, ReversibleHeun

__all__ = [
    "BACKWARD_MODES",
    "BackwardMode",
    "validate_backward",
    "validate_checkpoint_every",
    "validate_steps",
]

BACKWARD_MODES = ("backprop", "checkpoint", "reverse", "reversible")
BackwardMode = Literal["backprop", "checkpoint", "reverse", "reversible"]


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
    if mode == "reversible" and not isinstance(integrator, ReversibleHeun):
        raise ConfigError(
            f"backward='reversible' needs an algebraically reversible integrator, but the stage uses "
            f"'{integrator.name}'. Use integrator='reversible_heun' with backward='reversible', or keep "
            f"'{integrator.name}' with backward='checkpoint' (exact) or 'reverse' (approximate, memory-free)."
        )
    if mode == "reverse" and isinstance(integrator, ReversibleHeun):
        raise ConfigError(
            "backward='reverse' rebuilds states by stepping backward with an explicit tableau; "
            "integrator='reversible_heun' is inverted exactly instead: use backward='reversible'."
        )
    return mode  # type: ignore[return-value]
