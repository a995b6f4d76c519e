"""The settings a stage accepts, and their checks: importable without torch (the CLI's parser reads them).

Every check raises :class:`~odeify.core.errors.ConfigError` naming the setting, what it got and what
to use instead, where the value enters (``ODEStage.configure``, ``convert``, the CLI).
:class:`StageSettings` is a stage's manifestation as one frozen value: a stage swaps it whole, so a
refused ``configure`` changes nothing.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from odeify.core.errors import ConfigError
from odeify.numerics.bases import get_basis
from odeify.numerics.schemes import Evaluate
from odeify.numerics.tableaus import Integrator, ReversibleScheme, Splitting

__all__ = [
    "BACKWARD_MODES",
    "DEFAULTS",
    "BackwardMode",
    "DepthMultiplier",
    "StageRequest",
    "StageSettings",
    "StepsSpec",
    "parse_steps",
    "resolve_steps",
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


def validate_backward(mode: object, integrator: Integrator, stage: str | None = None) -> BackwardMode:
    """``mode`` checked against the integrator of the stage (named in the message when given)."""
    which = "the stage" if stage is None else f"stage '{stage}'"
    if mode not in BACKWARD_MODES:
        raise ConfigError(f"unknown backward mode {mode!r}; choose one of {', '.join(BACKWARD_MODES)}.")
    if isinstance(integrator, Splitting):
        return _split_backward(mode, integrator)
    if mode == "reversible" and not isinstance(integrator, ReversibleScheme):
        raise ConfigError(
            f"backward='reversible' needs an algebraically reversible integrator, but {which} uses "
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


def _split_backward(mode: str, splitting: Splitting) -> BackwardMode:
    """``mode`` checked against a splitting scheme: ``reversible`` for the reversible splittings only,
    ``reverse`` (stepping back by explicit sub-steps) for the others only."""
    if mode == "reversible" and not splitting.reversible:
        strang = splitting.pattern == "symmetric"
        raise ConfigError(
            f"backward='reversible' runs an algebraically reversible scheme on a fixed-point lattice, and "
            f"integrator='{splitting.name}' is not one. Use integrator='{'strang_alf' if strang else 'alf'}' "
            f"(each sub-step an ALF step{', Strang order' if strang else ''}; 'reversible_heun' and "
            "'strang_reversible_heun' too) with backward='reversible', or keep "
            f"'{splitting.name}' with backward='checkpoint' (exact gradients, memory ~ steps/k + k "
            "states) or 'reverse' (approximate, memory-free)."
        )
    if mode == "reverse" and splitting.reversible:
        raise ConfigError(
            "backward='reverse' rebuilds states by stepping backward with explicit sub-steps; "
            f"integrator='{splitting.name}' is inverted exactly instead: use backward='reversible'."
        )
    return mode  # type: ignore[return-value]


# -- the manifestation a pipeline applies ------------------------------------------------------------
DEFAULTS: dict[str, str] = {
    "integrator": "euler",
    "steps": "native",
    "basis": "constant",
    "knots": "native",
    "backward": "backprop",
}
"""convert's defaults, which reproduce the source network: read by the API and the command line."""

StepsSpec = int | str
"""A stage's steps as the user writes them: an int, ``"native"`` (one per block) or ``"x<m>"``."""

_DECIMAL = re.compile(r"\d+(\.\d*)?|\.\d+")


def parse_steps(spec: object, stage: str | None = None) -> StepsSpec:
    """Check the steps grammar, the same in Python and on the command line; returns the spec.

    ``4`` is 4 steps (the command line reads ``4`` as an int first), ``"native"`` one step per block, ``"x2"``
    twice the run's block count (plain decimals only: ``x1e3`` is refused rather than read). A float
    is refused rather than guessed at: 2.0 steps, or a 2x multiplier?
    """
    label = f"stage '{stage}'" if stage else "a stage"
    if spec == "native":
        return "native"
    if isinstance(spec, str) and spec.startswith("x"):
        # plain decimals only: Fraction("1e999999999") would build a billion-digit integer
        if _DECIMAL.fullmatch(spec[1:]) and len(spec) <= 16 and Fraction(spec[1:]) > 0:
            return spec
        raise ConfigError(
            f"a steps multiplier is 'x' and a positive number, e.g. 'x2' or 'x0.5'; got {spec!r}."
        )
    if isinstance(spec, float):
        hint = max(1, round(spec)) if math.isfinite(spec) else 4
        raise ConfigError(
            f"steps for {label} is the float {spec!r}: pass an integer number of steps (e.g. {hint}) or "
            f"a depth multiplier as a string (e.g. 'x{spec:g}')."
        )
    if isinstance(spec, numbers.Integral) and not isinstance(spec, bool):
        return _positive_int(int(spec), f"steps for {label}", "or 'native' for the original depth")
    raise ConfigError(
        f"steps for {label} must be a positive integer, 'native' or a depth multiplier such as 'x2'; "
        f"got {spec!r}."
    )


def resolve_steps(spec: StepsSpec, depth: int, stage: str, whole_model: bool = False) -> int:
    """The step count ``spec`` asks of a stage of ``depth`` blocks: 'x<m>' is round(m * depth), >= 1.

    ``whole_model``: the multiplier was given for every stage at once, so a stage it gives fewer than
    one step is clamped to one (:func:`depth_multiplier` says which). Given for one named stage, a
    multiplier that rounds below one step is refused: that stage was asked for something it cannot take.
    """
    spec = parse_steps(spec, stage)
    if spec == "native":
        return depth
    if isinstance(spec, str):
        exact = Fraction(spec[1:]) * depth
        if exact < Fraction(1, 2) and not whole_model:
            raise ConfigError(
                f"steps={spec!r} gives stage '{stage}' ({depth} blocks) {float(exact):.3g} steps: fewer "
                f"than one, which would be rounded up to 1 step. Ask for steps=1 (--steps 1), or a "
                f"multiplier of at least 'x{1 / (2 * depth):g}'."
            )
        return max(1, round(exact))
    return spec


@dataclass(frozen=True)
class DepthMultiplier:
    """What a whole-model depth multiplier became: each stage's steps, and the stages clamped to one.

    Recorded on the model (``gm.meta["odeify"]["steps_multiplier"]``) and printed by the CLI and the
    report, since 'x0.33' of a 2-block stage is 1 step, not a third of it.
    """

    asked: str
    depths: dict[str, int]
    steps: dict[str, int]
    clamped: tuple[str, ...]

    @classmethod
    def of(cls, spec: str, depths: dict[str, int]) -> DepthMultiplier:
        """The multiplier ``spec`` applied to stages of ``depths`` blocks."""
        steps = {name: resolve_steps(spec, depth, name, whole_model=True) for name, depth in depths.items()}
        clamped = tuple(n for n, d in depths.items() if round(Fraction(spec[1:]) * d) < 1)
        return cls(spec, dict(depths), steps, clamped)

    def check_changes(self) -> None:
        """Refuse a multiplier below x1 that gives every stage its own depth: it asks for fewer steps and
        would change nothing (above x1 a stage that rounds back is a retarget warning)."""
        if Fraction(self.asked[1:]) >= 1 or self.steps != self.depths:
            return
        if set(self.depths.values()) == {1}:
            why = "every stage has one block, and a stage takes at least one step"
            fix = "keep native steps (leave steps out), or a number to step more finely (--steps 2, steps=2)"
        else:
            why = "it rounds back to each stage's block count (a stage takes whole steps)"
            fix = "ask for a smaller multiplier (e.g. 'x0.5') or a number of steps (--steps 1, steps=1)"
        blocks = ", ".join(f"{n}: {d}" for n, d in self.depths.items())
        raise ConfigError(f"steps={self.asked!r} changes nothing on this model: {why} ({blocks}); {fix}.")

    def line(self) -> str:
        """'steps x0.33: 12 blocks -> 5 steps in all (layer1 2 -> 1, ...); clamped to one step: ...'."""
        per_stage = ", ".join(f"{n} {self.depths[n]} -> {s}" for n, s in self.steps.items())
        text = (
            f"steps {self.asked}: {sum(self.depths.values())} blocks -> {sum(self.steps.values())} steps in "
            f"all ({per_stage})"
        )
        if self.clamped:
            m = Fraction(self.asked[1:])
            why = ", ".join(f"{float(m * self.depths[n]):.3g} of {self.depths[n]}" for n in self.clamped)
            text += f"; clamped to one step: {', '.join(self.clamped)} ({self.asked} gives {why})"
        return text

    def to_dict(self) -> dict:
        return {
            "asked": self.asked,
            "depths": self.depths,
            "steps": self.steps,
            "clamped": list(self.clamped),
        }

    @classmethod
    def from_dict(cls, record: dict) -> DepthMultiplier:
        return cls(record["asked"], dict(record["depths"]), dict(record["steps"]), tuple(record["clamped"]))


@dataclass(frozen=True)
class StageRequest:
    """What a pipeline asks of one stage; None keeps the stage's current value.

    ``knots`` is a count or ``"native"`` (one per block); ``steps`` a :data:`StepsSpec`, resolved
    against the stage's depth when applied; ``integrator`` a name or a tableau. ``steps_for_all``:
    the steps were given once for every stage, so a multiplier clamps a stage to one step.
    """

    knots: int | str | None = None
    basis: str | None = None
    integrator: object | None = None
    steps: StepsSpec | None = None
    backward: str | None = None
    checkpoint_every: int | None = None
    steps_for_all: bool = False


def validate_midpoints(
    integrator: Integrator, basis: str, knots: int, steps: int, stage: str, fields: int = 1
) -> None:
    """Refuse ALF where an evaluation inside a (sub-)step falls on a jump of the weight path.

    There the evaluation would read one of the two cells its step covers, arbitrarily (at half the
    native steps on the piecewise-constant path: one block of every two). A path jumps only at a
    knot, so only such times on a knot are compared, exactly, from both sides. ``fields``: a split
    stage's sub-field count (its reversible splitting's program has one ALF step per sub-step).
    """
    name, parts = integrator.name, ((0, Fraction(0), Fraction(1)),)
    if isinstance(integrator, Splitting) and integrator.reversible:
        split = integrator.scheme(fields)
        integrator, parts = split.base, split.parts
    if not isinstance(integrator, ReversibleScheme):
        return
    inner = [op.at for op in integrator.step if isinstance(op, Evaluate) and 0 < op.at < 1]
    inside = sorted({start + at * length for _, start, length in parts for at in inner})
    path = get_basis(basis)
    for n in range(steps):
        for at in inside:
            t = (n + at) / steps
            if (t * knots).denominator == 1 and path.coefficients(knots, t, True) != path.coefficients(
                knots, t
            ):
                raise ConfigError(
                    f"integrator='{name}' evaluates the field inside each (sub-)step (ALF: at its "
                    f"midpoint); with {steps} steps over the {knots} '{basis}' knots of stage '{stage}', "
                    f"step {n}'s {'midpoint' if at == Fraction(1, 2) else 'evaluation'} t = {t} falls on "
                    "a jump of the weight path, where it would read one of the two blocks its step covers "
                    "(at half the native steps: one block of every two). Use integrator='reversible_heun' "
                    "at these steps (on a split stage 'strang_reversible_heun' too: exact and memory-free, "
                    "it reads both), ALF at a multiple of the knots (steps='native', 'x2', ...), or "
                    "basis='linear'."
                )
