"""Reversible integrators as data: register programs that invert exactly.

A reversible scheme keeps a few state registers and advances them by ops that each undo in closed
form: ``Add`` (``target += times * source``), ``Reflect`` (``target = 2 * about - target``) and
``Evaluate`` (a field increment ``[h/2 F(t, register)]``, read-only). ``backward='reversible'``
(:mod:`odeify.runtime.reversible`) runs a scheme's program on a fixed-point lattice, where every
register is an integer count and every increment is rounded before it is added, so undoing the ops
in reverse order, each increment re-evaluated from the register it was computed from, rebuilds
every state bit for bit. :mod:`odeify.codegen.emit` writes the same programs as readable float
graphs (inference, ``backprop``, ``checkpoint``), so a new reversible scheme is one entry here.

Two schemes ship (the runtime knows neither by name), and their compositions over the sub-fields
of a split stage (:class:`SplitScheme`: one sub-step of one sub-field after another, in Lie-Trotter
or Strang order, on one augmented state; the inverse undoes the sub-steps in reverse order):

- **reversible Heun** (Kidger et al. 2021, "Efficient and accurate gradients for neural SDEs"):
  registers (y, z), two evaluations per step (one where consecutive steps can share it);
- **the asynchronous leapfrog, ALF** (Zhuang et al. 2021, "MALI: A memory efficient and reverse
  accurate integrator for Neural ODEs", ICLR; TorchDiffEqPack's ``Sym12Async`` with damping 1):
  registers (z, p) with p = h/2 v, one evaluation per step, strictly inside it.

A program is valid when every increment is used only while the register it was evaluated from
is unchanged: then, walking back, the register holds the same bits when the increment is needed
again. :func:`validate_scheme` checks that, and that each op names known registers and
increments, when this module loads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar, Literal

__all__ = [
    "REVERSIBLE_SCHEMES",
    "AsyncLeapfrog",
    "Add",
    "Evaluate",
    "Op",
    "Reflect",
    "Register",
    "ReversibleHeun",
    "ReversibleScheme",
    "SplitScheme",
    "validate_scheme",
]


@dataclass(frozen=True)
class Evaluate:
    """``into = [length h/2 F_field(t_n + at * h, register)]`` (the left limit when ``left``): one
    field increment. ``field`` names the sub-field of a split stage (0 on other stages) and ``length``
    the sub-step's length in steps (a power of two: Strang's half sub-steps are 1/2)."""

    register: str
    at: Fraction
    left: bool
    into: str
    field: int = 0
    length: Fraction = Fraction(1)


@dataclass(frozen=True)
class Add:
    """``target += times * source``, ``source`` a register or an increment; ``times`` a small integer."""

    target: str
    source: str
    times: int = 1


@dataclass(frozen=True)
class Reflect:
    """``target = 2 * about - target``, ``about`` a register or an increment (its own inverse)."""

    target: str
    about: str


Op = Evaluate | Add | Reflect


@dataclass(frozen=True)
class Register:
    """A state register: starting at the stage input or at zero.

    ``kept`` says how the forward keeps its final value for backward: as its difference from the
    output register (small where the two stay close, as reversible Heun's y and z do) or as itself.
    ``lattice`` is its spacing: ``state``, the input's (the lattice's q), or ``increment``, finer by
    about h L / 2, for a register that holds an increment-sized quantity (ALF's p = h/2 v): there
    the input's spacing would round it ever more coarsely, relative to its size, as the steps get
    smaller. Adding it to a state register rounds it to the state's spacing first (exactly undone,
    since the same bits are rounded again going back). ``per_field``: a split scheme gives every
    sub-field its own copy (ALF's p, a field's velocity: shared, it would carry one sub-field's
    velocity into the next's predictor). ``velocity``: the float graphs carry this ``increment``
    register divided by h/2, under that name (ALF's p as v, the velocity MALI writes); a split
    scheme carries its registers as themselves (its sub-steps' h/2 differ).
    """

    name: str
    start: Literal["input", "zero"]
    kept: Literal["relative", "absolute"] = "absolute"
    lattice: Literal["state", "increment"] = "state"
    per_field: bool = False
    velocity: str | None = None


class ReversibleScheme:
    """What the lattice runtime reads of a reversible integrator (class attributes, no behaviour).

    ``registers`` (the first is the output), ``start`` (ops run once before step 0, at t = 0) and
    ``step`` (the ops of every step, times relative to the step). ``evals_per_step`` and
    ``evals_at_start`` count the evaluations before any is shared, for the graph-size budget.

    ``rounds_each_op`` says how the float graphs (:mod:`odeify.codegen.emit`) round the program,
    where the lattice is exact either way. False: a register stays a sum of terms until a field
    reads it, another register adds it, or the step ends, and a reflection doubles the terms
    pending on its centre (reversible Heun's z_{n+1} = (2 y_n - z_n) + h F(t_n, z_n), as Kidger et
    al. write it). True: every op's result is rounded (the split schemes, as they were first
    written).
    """

    name: ClassVar[str]
    order: ClassVar[int]
    evals_per_step: ClassVar[int]
    registers: ClassVar[tuple[Register, ...]]
    step: ClassVar[tuple[Op, ...]]
    rounds_each_op: ClassVar[bool] = False

    @property
    def start(self) -> tuple[Op, ...]:
        return ()

    @property
    def evals_at_start(self) -> int:
        return sum(isinstance(op, Evaluate) for op in self.start)

    @property
    def output(self) -> str:
        return self.registers[0].name

    @property
    def substeps(self) -> tuple[tuple[Op, ...], ...]:
        """The step's ops in sub-steps (a split scheme's, one per sub-field step; else the step whole):
        the float graphs name the registers after each."""
        return (self.step,)

    @functools.cached_property
    def even_registers(self) -> frozenset[str]:
        """Registers whose counts are always even: they start at zero, and only reflections
        (``2 about - r`` keeps r's parity) and even multiples change them (ALF's p with v_0 = 0).
        The forward keeps such a register halved when it is wide: one bit fewer
        (:meth:`odeify.runtime.lattice.Lattice.pack`). Derived once per scheme."""
        ops = (*self.start, *self.step)

        def keeps_parity(op: Op, name: str) -> bool:
            if isinstance(op, Evaluate) or op.target != name:
                return True
            return isinstance(op, Reflect) or op.times % 2 == 0

        zero_start = [r.name for r in self.registers if r.start == "zero"]
        return frozenset(name for name in zero_start if all(keeps_parity(op, name) for op in ops))


@dataclass(frozen=True)
class ReversibleHeun(ReversibleScheme):
    """The algebraically reversible Heun method (Kidger et al. 2021), order 2.

    In registers (y, z), both starting at x, with a = [h/2 F(t_n, z_n)] and b = [h/2 F(t_{n+1}-, z_{n+1})]:
    y += a; z = 2y - z (so z_{n+1} = 2 y_n - z_n + 2a); y += b. On a continuous weight path b and
    the next step's a are one evaluation.
    """

    name: ClassVar[str] = "reversible_heun"
    order: ClassVar[int] = 2
    evals_per_step: ClassVar[int] = 2
    registers: ClassVar[tuple[Register, ...]] = (Register("y", "input"), Register("z", "input", "relative"))
    step: ClassVar[tuple[Op, ...]] = (
        Evaluate("z", Fraction(0), False, "a"),
        Add("y", "a"),
        Reflect("z", "y"),
        Evaluate("z", Fraction(1), True, "b"),
        Add("y", "b"),
    )


@dataclass(frozen=True)
class AsyncLeapfrog(ReversibleScheme):
    """MALI's asynchronous leapfrog with damping 1 (Zhuang et al., ICLR 2021), order 2.

    State (z, v); with p = h/2 v in the registers and a = [h/2 F(t_n + h/2, s)]:

        s = z_n + p_n,   p_{n+1} = 2a - p_n,   z_{n+1} = s + p_{n+1}

    so z_{n+1} = z_n + h F(t_n + h/2, z_n + h/2 v_n): a midpoint step whose predictor uses v
    instead of a second evaluation. One evaluation per step, strictly inside it: on a
    piecewise-constant weight path at native steps each step reads exactly its block.
    ``initial_velocity``: v_0 = 0 (``"zero"``, the default: no extra evaluation, and at native
    steps the first step is the first block's own Euler step) or v_0 = F(t_0, z_0) (``"field"``,
    MALI's choice: one more evaluation per stage). benchmarks/results/design_notes.md has the measurements
    behind the default.
    """

    initial_velocity: Literal["zero", "field"] = "zero"
    order: ClassVar[int] = 2
    evals_per_step: ClassVar[int] = 1
    registers: ClassVar[tuple[Register, ...]] = (
        Register("z", "input"),
        Register("p", "zero", lattice="increment", per_field=True, velocity="v"),
    )
    step: ClassVar[tuple[Op, ...]] = (
        Add("z", "p"),
        Evaluate("z", Fraction(1, 2), False, "a"),
        Reflect("p", "a"),
        Add("z", "p"),
    )

    @property
    def name(self) -> str:  # type: ignore[override]
        return "alf" if self.initial_velocity == "zero" else "alf_field_start"

    @property
    def start(self) -> tuple[Op, ...]:
        if self.initial_velocity == "zero":
            return ()
        return (Evaluate("z", Fraction(0), False, "a"), Add("p", "a"))


@dataclass(frozen=True)
class SplitScheme(ReversibleScheme):
    """A reversible split step: ``base``'s step once per sub-step, each on one sub-field.

    ``parts`` are the sub-steps in the order they run, as (field, start, length) in fractions of
    the step (:meth:`odeify.numerics.splitting.Splitting.substeps`). Every sub-step is ``base``'s
    step of F_field over [start, start + length] on one augmented state (reversible Heun's (y, z),
    ALF's z with one velocity register p<field> per sub-field): a composition of exactly invertible
    maps, which the runtime undoes sub-step by sub-step in reverse order. ``base`` must need no
    start ops.
    """

    label: str
    degree: int
    base: ReversibleScheme
    parts: tuple[tuple[int, Fraction, Fraction], ...]
    rounds_each_op: ClassVar[bool] = True

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.label

    @property
    def order(self) -> int:  # type: ignore[override]
        return self.degree

    @property
    def evals_per_step(self) -> int:  # type: ignore[override]
        return self.base.evals_per_step * len(self.parts)

    @functools.cached_property
    def registers(self) -> tuple[Register, ...]:  # type: ignore[override]
        fields = sorted({field for field, _, _ in self.parts})
        out: list[Register] = []
        for r in self.base.registers:
            copies = [f"{r.name}{f + 1}" for f in fields] if r.per_field else [r.name]
            out += [Register(name, r.start, r.kept, r.lattice) for name in copies]  # no velocity: as itself
        return tuple(out)

    @functools.cached_property
    def substeps(self) -> tuple[tuple[Op, ...], ...]:  # type: ignore[override]
        """Each sub-step's ops: ``base``'s step with its times mapped into the sub-interval, its
        per-field registers and its increments renamed (``a`` of sub-step k is ``a<k>``)."""
        per_field = {r.name for r in self.base.registers if r.per_field}
        local = {op.into for op in self.base.step if isinstance(op, Evaluate)}
        out = []
        for k, (field, start, length) in enumerate(self.parts, start=1):

            def name(n: str, k: int = k, field: int = field) -> str:
                return f"{n}{k}" if n in local else f"{n}{field + 1}" if n in per_field else n

            ops: list[Op] = []
            for op in self.base.step:
                if isinstance(op, Evaluate):
                    at = start + op.at * length
                    ops.append(Evaluate(name(op.register), at, op.left, name(op.into), field, length))
                elif isinstance(op, Add):
                    ops.append(Add(name(op.target), name(op.source), op.times))
                else:
                    ops.append(Reflect(name(op.target), name(op.about)))
            out.append(tuple(ops))
        return tuple(out)

    @property
    def step(self) -> tuple[Op, ...]:  # type: ignore[override]
        return tuple(op for ops in self.substeps for op in ops)


def validate_scheme(scheme: ReversibleScheme) -> None:
    """Check a scheme's program: known names, and each increment used only while its register is unchanged.

    Raises ``ValueError``: a scheme is code, not user input, so a failure here is a bug in its program.
    """
    registers = [r.name for r in scheme.registers]
    carried = registers + [r.velocity for r in scheme.registers if r.velocity]
    if len(set(carried)) != len(carried):
        raise ValueError(f"{scheme.name}: register names (and velocity names) must be unique")
    if any(r.velocity and r.lattice != "increment" for r in scheme.registers):
        raise ValueError(f"{scheme.name}: only an increment register is carried as a velocity")
    if isinstance(scheme, SplitScheme) and scheme.base.start:
        raise ValueError(f"{scheme.name}: a split scheme's step needs no start ops")
    lattices = {r.name: r.lattice for r in scheme.registers}
    if any(r.kept == "relative" and r.lattice != scheme.registers[0].lattice for r in scheme.registers):
        raise ValueError(f"{scheme.name}: a register kept relative to the output must share its lattice")
    for ops in (scheme.start, scheme.step):
        for i, op in enumerate(ops):
            if isinstance(op, Evaluate):
                _check_increment(scheme.name, ops, i, lattices)
            elif op.target not in registers or _source(op) == op.target:
                raise ValueError(f"{scheme.name}: {op} changes an unknown register, or adds it to itself")
            elif _source(op) not in registers and not any(
                isinstance(e, Evaluate) and e.into == _source(op) for e in ops[:i]
            ):
                raise ValueError(f"{scheme.name}: {op} reads an increment not evaluated before it")


def _source(op: Add | Reflect) -> str:
    return op.source if isinstance(op, Add) else op.about


def _check_increment(name: str, ops: tuple[Op, ...], i: int, lattices: dict[str, str]) -> None:
    """The increment evaluated by ``ops[i]`` is used, only before its register next changes, and only
    into registers of one lattice (it is rounded on theirs)."""
    evaluate = ops[i]
    assert isinstance(evaluate, Evaluate)
    if lattices.get(evaluate.register) != "state" or evaluate.into in lattices or not 0 <= evaluate.at <= 1:
        raise ValueError(f"{name}: {evaluate} reads an unknown or non-state register, or leaves its step")
    writes = [(j, op) for j, op in enumerate(ops) if not isinstance(op, Evaluate)]
    uses = [j for j, op in writes if _source(op) == evaluate.into]
    changes = [j for j, op in writes if j > i and op.target == evaluate.register]
    if not uses or (changes and max(uses) > min(changes)):
        raise ValueError(f"{name}: increment {evaluate.into!r} is unused, or used after its register changes")
    if len({lattices[ops[j].target] for j in uses}) > 1:
        raise ValueError(f"{name}: increment {evaluate.into!r} is added to registers of two lattices")


REVERSIBLE_SCHEMES: dict[str, ReversibleScheme] = {s.name: s for s in (ReversibleHeun(), AsyncLeapfrog())}
"""The built-in reversible integrators by name (``backward='reversible'`` runs any of them)."""

for _scheme in (*REVERSIBLE_SCHEMES.values(), AsyncLeapfrog("field")):
    validate_scheme(_scheme)
del _scheme
