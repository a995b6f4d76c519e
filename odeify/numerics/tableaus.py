"""Integrators as data: explicit Runge-Kutta Butcher tableaus with exact coefficients.

Step code reads a `Tableau` (or a reversible scheme, :mod:`odeify.numerics.schemes`) instead of
hard-coding each method, so a user tableau runs through the same path as the built-ins.
Coefficients are `fractions.Fraction` so the stage times c_i are exact and the step code can decide
exactly when a stage sits on a step's end (docs/design-math.md, "Left limits at a step's end").
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

from odeify.core.errors import ConfigError
from odeify.core.limits import MAX_NAME
from odeify.numerics.schemes import REVERSIBLE_SCHEMES, AsyncLeapfrog, ReversibleHeun, ReversibleScheme
from odeify.numerics.splitting import SPLITTINGS, Splitting

__all__ = [
    "KNOWN_INTEGRATORS",
    "REVERSIBLE_SCHEMES",
    "TABLEAUS",
    "AsyncLeapfrog",
    "Integrator",
    "ReversibleHeun",
    "ReversibleScheme",
    "Splitting",
    "Tableau",
    "resolve_integrator",
    "to_fraction",
]

Number = int | Fraction | str | float

_ZERO = Fraction(0)
_ONE = Fraction(1)


MAX_NUMBER_TEXT = 64
# a decimal or a ratio, with at most a two-digit exponent: Fraction("1e999999999") would build a
# billion-digit integer before anything could check it
_NUMBER_TEXT = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d{1,2})?(/\d+)?")


def to_fraction(value: object, what: str = "value") -> Fraction:
    """Convert an int, Fraction, string like "1/3" or float to an exact Fraction.

    Floats go through their shortest repr (0.1 -> 1/10), so 1/3 typed as a float stays inexact;
    pass "1/3" or Fraction(1, 3) instead. Anything else raises ConfigError naming `what`.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a number, got the bool {value!r}; write 0 or 1 instead.")
    if isinstance(value, Fraction):
        return value
    if isinstance(value, numbers.Rational):
        return Fraction(int(value.numerator), int(value.denominator))
    if isinstance(value, numbers.Real):
        as_float = float(value)
        if not math.isfinite(as_float):
            raise ConfigError(f"{what} must be finite, got {as_float!r}.")
        return Fraction(repr(as_float))
    if isinstance(value, str):
        text = value.strip()
        if len(text) > MAX_NUMBER_TEXT or not _NUMBER_TEXT.fullmatch(text):
            raise ConfigError(
                f"{what} {value[:40]!r} is not a number of a few digits: write an int, a decimal or a "
                f"ratio like '1/3' (at most {MAX_NUMBER_TEXT} characters, exponents up to e±99)."
            )
        try:
            return Fraction(text)
        except (ValueError, ZeroDivisionError):
            raise ConfigError(
                f"{what} {value!r} is not a number; write it as an int, a decimal or a ratio like '1/3'."
            ) from None
    raise ConfigError(
        f"{what} must be an int, a Fraction, a string like '1/3' or a float; got {type(value).__name__}."
    )


# --- order conditions (rooted trees), used to check a tableau's declared order -------------------------

Tree = tuple["Tree", ...]  # a rooted tree is the sorted tuple of its child subtrees; () is a single node


@cache
def _trees(order: int) -> tuple[Tree, ...]:
    """All rooted trees with `order` nodes, each exactly once (canonical: children sorted)."""
    if order == 1:
        return ((),)
    found: set[Tree] = set()
    for children in _forests(order - 1, order - 1):
        found.add(tuple(sorted(children)))
    return tuple(sorted(found))


def _forests(nodes: int, max_first: int) -> Iterator[tuple[Tree, ...]]:
    """Multisets of trees with `nodes` nodes in total, the first tree having at most `max_first` nodes."""
    if nodes == 0:
        yield ()
        return
    for first in range(min(nodes, max_first), 0, -1):
        for tree in _trees(first):
            for rest in _forests(nodes - first, first):
                yield (tree, *rest)


def _tree_size(tree: Tree) -> int:
    return 1 + sum(_tree_size(child) for child in tree)


def _density(tree: Tree) -> int:
    """gamma(tree): the order condition for `tree` is b . Phi(tree) = 1 / gamma(tree)."""
    return _tree_size(tree) * math.prod(_density(child) for child in tree)


def _first_failed_condition(
    a: tuple[tuple[Fraction, ...], ...], b: tuple[Fraction, ...], order: int
) -> tuple[int, Tree] | None:
    """Return (order, tree) of the first violated order condition up to `order`, or None if all hold."""
    s = len(b)
    memo: dict[Tree, tuple[Fraction, ...]] = {}

    def phi(tree: Tree) -> tuple[Fraction, ...]:
        # Stage weights of a tree: Phi_i(tree) = prod over children of (A Phi(child))_i.
        if tree not in memo:
            vec = [_ONE] * s
            for child in tree:
                child_vec = phi(child)
                for i in range(s):
                    vec[i] *= sum((a[i][j] * child_vec[j] for j in range(s)), _ZERO)
            memo[tree] = tuple(vec)
        return memo[tree]

    for p in range(1, order + 1):
        for tree in _trees(p):
            weight = sum((bi * v for bi, v in zip(b, phi(tree), strict=True)), _ZERO)
            if weight != Fraction(1, _density(tree)):
                return p, tree
    return None


# --- tableaus ------------------------------------------------------------------------------------------


_TABLEAU_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Tableau:
    """An explicit Runge-Kutta method: stage matrix a (strictly lower triangular), weights b, nodes c.

    Build one with `Tableau.create`, which converts entries to Fractions and validates them.
    """

    name: str
    a: tuple[tuple[Fraction, ...], ...]
    b: tuple[Fraction, ...]
    c: tuple[Fraction, ...]
    order: int

    @property
    def stages(self) -> int:
        """Number of stages s (field evaluations per step)."""
        return len(self.b)

    @property
    def evals_per_step(self) -> int:
        """Field evaluations per step; the reversible schemes have it too, so callers need not dispatch."""
        return len(self.b)

    @classmethod
    def create(
        cls,
        name: str,
        a: Sequence[Sequence[Number]],
        b: Sequence[Number],
        c: Sequence[Number] | None = None,
        order: int = 1,
    ) -> Tableau:
        """Convert a, b, c to Fractions and validate them; raises ConfigError saying what to fix.

        a is the full s x s matrix (zeros on and above the diagonal). c defaults to the row sums of a.
        The declared `order` is checked against the Runge-Kutta order conditions, so a tableau cannot
        claim more accuracy than it has.
        """
        label = f"tableau {_checked_name(name)!r}"
        bf = _weights(b, label)
        af = _strictly_lower(a, len(bf), label)
        cf = _nodes(c, af, label)
        _check_order(af, bf, order, label)
        return cls(name=name, a=af, b=bf, c=cf, order=order)


def _checked_name(name: object) -> str:
    """A tableau's name is printed in listings and saved in recipes: a Python name, as load requires."""
    if not isinstance(name, str) or len(name) > MAX_NAME or not _TABLEAU_NAME.fullmatch(name):
        raise ConfigError(
            f"a tableau name is a Python name of 1 to {MAX_NAME} characters like 'rk4' or 'my_rk3', "
            f"got {name!r:.80}."
        )
    return name


def _is_sequence(value: object, length: int | None = None) -> bool:
    ok = not isinstance(value, (str, bytes)) and isinstance(value, Sequence)
    return ok and (length is None or len(value) == length)  # type: ignore[arg-type]


def _got(value: object) -> object:
    return len(value) if isinstance(value, Sequence) else type(value).__name__


def _weights(b: object, label: str) -> tuple[Fraction, ...]:
    """b as exact Fractions; they must sum to 1."""
    if not _is_sequence(b) or len(b) == 0:  # type: ignore[arg-type]
        raise ConfigError(f"{label}: b must be a non-empty sequence of weights, got {b!r}.")
    bf = tuple(to_fraction(v, f"{label}: b[{i}]") for i, v in enumerate(b))  # type: ignore[arg-type]
    total = sum(bf, _ZERO)
    if total != 1:
        raise ConfigError(
            f"{label}: the weights b sum to {total}, not 1. Fix b, writing thirds etc. exactly "
            "('1/3', not 0.333)."
        )
    return bf


def _strictly_lower(a: object, s: int, label: str) -> tuple[tuple[Fraction, ...], ...]:
    """a as an s x s matrix of Fractions, zero on and above the diagonal (an explicit method)."""
    if not _is_sequence(a, s):
        raise ConfigError(
            f"{label}: a must have one row per stage, i.e. {s} rows to match len(b) = {s}; got {_got(a)}. "
            "Pass the full square matrix, zeros included."
        )
    rows: list[tuple[Fraction, ...]] = []
    for i, row in enumerate(a):  # type: ignore[arg-type]
        if not _is_sequence(row, s):
            raise ConfigError(
                f"{label}: a must be square {s} x {s} (s = len(b)); row {i} has {_got(row)} entries. "
                "Pass the full matrix, writing 0 on and above the diagonal."
            )
        rows.append(tuple(to_fraction(v, f"{label}: a[{i}][{j}]") for j, v in enumerate(row)))
    for i in range(s):
        for j in range(i, s):
            if rows[i][j] != 0:
                raise ConfigError(
                    f"{label}: odeify supports explicit Runge-Kutta tableaus; entry a[{i}][{j}] with "
                    f"j >= i is nonzero ({rows[i][j]}). Make a strictly lower triangular."
                )
    return tuple(rows)


def _nodes(c: object, af: tuple[tuple[Fraction, ...], ...], label: str) -> tuple[Fraction, ...]:
    """c, the row sums of a unless given (then it must equal them), each inside its step."""
    row_sums = tuple(sum(row, _ZERO) for row in af)
    cf = row_sums
    if c is not None:
        if not _is_sequence(c, len(af)):
            raise ConfigError(f"{label}: c must have {len(af)} entries to match len(b); got {_got(c)}.")
        cf = tuple(to_fraction(v, f"{label}: c[{i}]") for i, v in enumerate(c))  # type: ignore[arg-type]
        for i in range(len(af)):
            if cf[i] != row_sums[i]:
                raise ConfigError(
                    f"{label}: c[{i}] = {cf[i]} but row {i} of a sums to {row_sums[i]}; odeify needs "
                    f"c = row sums of a (consistent stages). Pass c=None to use {_show(row_sums)}."
                )
    for i, ci in enumerate(cf):
        if not 0 <= ci <= 1:
            raise ConfigError(
                f"{label}: c[{i}] = {ci} lies outside [0, 1]; every stage must sit inside its step."
            )
    return cf


def _check_order(
    af: tuple[tuple[Fraction, ...], ...], bf: tuple[Fraction, ...], order: object, label: str
) -> None:
    """The declared order is checked against the order conditions: no claim of more accuracy than it has."""
    s = len(bf)
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ConfigError(f"{label}: order must be an int >= 1, got {order!r}.")
    if order > s:
        raise ConfigError(
            f"{label}: an explicit method with {s} stage(s) has order at most {s}; got order={order}."
        )
    failed = _first_failed_condition(af, bf, order)
    if failed is not None:
        p, _tree = failed
        raise ConfigError(
            f"{label}: declared order {order} but the order-{p} conditions do not hold, so the method "
            f"has order {p - 1}. Pass order={p - 1} or fix the coefficients."
        )


def _show(values: Sequence[Fraction]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


Integrator = Tableau | ReversibleHeun | AsyncLeapfrog | Splitting

_h = "1/2"
TABLEAUS: dict[str, Tableau] = {
    t.name: t
    for t in (
        Tableau.create("euler", [[0]], [1], order=1),
        Tableau.create("midpoint", [[0, 0], [_h, 0]], [0, 1], order=2),
        Tableau.create("heun", [[0, 0], [1, 0]], [_h, _h], order=2),
        Tableau.create("ralston", [[0, 0], ["2/3", 0]], ["1/4", "3/4"], order=2),
        Tableau.create("kutta3", [[0, 0, 0], [_h, 0, 0], [-1, 2, 0]], ["1/6", "2/3", "1/6"], order=3),
        Tableau.create("ssprk3", [[0, 0, 0], [1, 0, 0], ["1/4", "1/4", 0]], ["1/6", "1/6", "2/3"], order=3),
        Tableau.create(
            "rk4",
            [[0, 0, 0, 0], [_h, 0, 0, 0], [0, _h, 0, 0], [0, 0, 1, 0]],
            ["1/6", "1/3", "1/3", "1/6"],
            order=4,
        ),
        Tableau.create(
            "rk4_38",
            [[0, 0, 0, 0], ["1/3", 0, 0, 0], ["-1/3", 1, 0, 0], [1, -1, 1, 0]],
            ["1/8", "3/8", "3/8", "1/8"],
            order=4,
        ),
    )
}
del _h

KNOWN_INTEGRATORS: tuple[str, ...] = tuple(sorted([*TABLEAUS, *REVERSIBLE_SCHEMES, *SPLITTINGS]))


def resolve_integrator(spec: str | Integrator) -> Integrator:
    """An integrator name or object as a Tableau, a reversible or a splitting scheme; ConfigError if unknown.

    Names are case-insensitive and '-' counts as '_' ("RK4-38" -> rk4_38).
    """
    if isinstance(spec, (Tableau, ReversibleScheme, Splitting)):
        return spec
    if isinstance(spec, str):
        key = spec.strip().lower().replace("-", "_")
        if key in REVERSIBLE_SCHEMES:
            return REVERSIBLE_SCHEMES[key]
        if key in TABLEAUS:
            return TABLEAUS[key]
        if key in SPLITTINGS:
            return SPLITTINGS[key]
        raise ConfigError(
            f"unknown integrator {spec!r}; known: {', '.join(KNOWN_INTEGRATORS)}. A custom explicit method "
            "can be passed as a tableau built with odeify.Tableau.create(name, a, b, order=...)."
        )
    raise ConfigError(
        f"integrator must be a name (one of {', '.join(KNOWN_INTEGRATORS)}) or a Tableau, "
        f"got {type(spec).__name__}."
    )
