"""Tests for odeify.numerics.tableaus: order conditions written out by hand, a numerical convergence oracle,
validation errors and integrator resolution."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from fractions import Fraction

import pytest

from odeify.core.errors import ConfigError
from odeify.numerics.schemes import Add, Evaluate, Reflect, validate_scheme
from odeify.numerics.splitting import SPLITTINGS
from odeify.numerics.tableaus import (
    KNOWN_INTEGRATORS,
    REVERSIBLE_SCHEMES,
    TABLEAUS,
    AsyncLeapfrog,
    ReversibleHeun,
    Tableau,
    resolve_integrator,
)

F = Fraction
Vec = list[Fraction]


# --- order conditions, spelled out (independent of the rooted-tree code in the module) ------------------


def _dot(u: Vec, v: Vec) -> Fraction:
    return sum((x * y for x, y in zip(u, v, strict=True)), F(0))


def _mul(u: Vec, v: Vec) -> Vec:
    return [x * y for x, y in zip(u, v, strict=True)]


def _apply(t: Tableau, v: Vec) -> Vec:
    return [_dot(list(row), v) for row in t.a]


def _pow(c: Vec, k: int) -> Vec:
    return [x**k for x in c]


Condition = tuple[str, Callable[[Tableau], Fraction], Fraction]


def _conditions() -> dict[int, list[Condition]]:
    def b(t: Tableau) -> Vec:
        return list(t.b)

    def c(t: Tableau) -> Vec:
        return list(t.c)

    def ac(t: Tableau) -> Vec:
        return _apply(t, c(t))

    return {
        1: [("sum b", lambda t: sum(t.b, F(0)), F(1))],
        2: [("b.c", lambda t: _dot(b(t), c(t)), F(1, 2))],
        3: [
            ("b.c^2", lambda t: _dot(b(t), _pow(c(t), 2)), F(1, 3)),
            ("b.Ac", lambda t: _dot(b(t), ac(t)), F(1, 6)),
        ],
        4: [
            ("b.c^3", lambda t: _dot(b(t), _pow(c(t), 3)), F(1, 4)),
            ("b.(c*Ac)", lambda t: _dot(b(t), _mul(c(t), ac(t))), F(1, 8)),
            ("b.Ac^2", lambda t: _dot(b(t), _apply(t, _pow(c(t), 2))), F(1, 12)),
            ("b.AAc", lambda t: _dot(b(t), _apply(t, ac(t))), F(1, 24)),
        ],
        5: [
            ("b.c^4", lambda t: _dot(b(t), _pow(c(t), 4)), F(1, 5)),
            ("b.(c^2*Ac)", lambda t: _dot(b(t), _mul(_pow(c(t), 2), ac(t))), F(1, 10)),
            ("b.(c*Ac^2)", lambda t: _dot(b(t), _mul(c(t), _apply(t, _pow(c(t), 2)))), F(1, 15)),
            ("b.(c*AAc)", lambda t: _dot(b(t), _mul(c(t), _apply(t, ac(t)))), F(1, 30)),
            ("b.(Ac)^2", lambda t: _dot(b(t), _mul(ac(t), ac(t))), F(1, 20)),
            ("b.Ac^3", lambda t: _dot(b(t), _apply(t, _pow(c(t), 3))), F(1, 20)),
            ("b.A(c*Ac)", lambda t: _dot(b(t), _apply(t, _mul(c(t), ac(t)))), F(1, 40)),
            ("b.AAc^2", lambda t: _dot(b(t), _apply(t, _apply(t, _pow(c(t), 2)))), F(1, 60)),
            ("b.AAAc", lambda t: _dot(b(t), _apply(t, _apply(t, ac(t)))), F(1, 120)),
        ],
    }


CONDITIONS = _conditions()
EXPECTED_ORDERS = {
    "euler": 1,
    "midpoint": 2,
    "heun": 2,
    "ralston": 2,
    "kutta3": 3,
    "ssprk3": 3,
    "rk4": 4,
    "rk4_38": 4,
}


def test_registry_has_exactly_the_documented_methods() -> None:
    assert {name: t.order for name, t in TABLEAUS.items()} == EXPECTED_ORDERS
    reversible_splittings = {
        f"{order}_{step}" for order in ("lie_trotter", "strang") for step in REVERSIBLE_SCHEMES
    }
    others = {"reversible_heun", "alf", "lie_trotter", "strang", *reversible_splittings}
    assert set(KNOWN_INTEGRATORS) == set(EXPECTED_ORDERS) | others
    assert {name: s.order for name, s in REVERSIBLE_SCHEMES.items()} == {"reversible_heun": 2, "alf": 2}
    assert {name: s.order for name, s in SPLITTINGS.items()} == {
        name: 1 if name.startswith("lie_trotter") else 2
        for name in ("lie_trotter", "strang", *reversible_splittings)
    }
    assert list(KNOWN_INTEGRATORS) == sorted(KNOWN_INTEGRATORS)
    for name, t in TABLEAUS.items():
        assert t.name == name


@pytest.mark.parametrize("name", sorted(SPLITTINGS))
@pytest.mark.parametrize("fields", [1, 2, 3, 4])
def test_a_splitting_integrates_each_field_once_over_the_whole_step(name: str, fields: int) -> None:
    """Consistency: each sub-field's sub-steps tile [0, 1] of the step, in order of their starts."""
    substeps = SPLITTINGS[name].substeps(fields)
    assert SPLITTINGS[name].substep in (*TABLEAUS, *REVERSIBLE_SCHEMES)
    for field in range(fields):
        mine = [s for s in substeps if s.field == field]
        assert mine[0].start == 0 and sum(s.length for s in mine) == 1
        assert all(a.start + a.length == b.start for a, b in zip(mine, mine[1:], strict=False))
    if SPLITTINGS[name].order == 2:  # symmetric: the step read backward is the same sub-steps
        assert [s.field for s in substeps] == [s.field for s in reversed(substeps)]


@pytest.mark.parametrize("name", sorted(TABLEAUS))
def test_coefficients_are_exact_fractions_and_explicit(name: str) -> None:
    t = TABLEAUS[name]
    s = t.stages
    assert len(t.a) == s and all(len(row) == s for row in t.a) and len(t.c) == s
    for value in (*t.b, *t.c, *(x for row in t.a for x in row)):
        assert type(value) is Fraction
    assert all(t.a[i][j] == 0 for i in range(s) for j in range(i, s))
    assert all(t.c[i] == sum(t.a[i], F(0)) for i in range(s))


@pytest.mark.parametrize("name", sorted(TABLEAUS))
def test_declared_order_is_the_real_order(name: str) -> None:
    t = TABLEAUS[name]
    for p in range(1, t.order + 1):
        for label, fn, expected in CONDITIONS[p]:
            assert fn(t) == expected, f"{name}: order-{p} condition {label}"
    failing = [label for label, fn, expected in CONDITIONS[t.order + 1] if fn(t) != expected]
    assert failing, f"{name} satisfies every order-{t.order + 1} condition; its declared order is too low"


def test_documented_coefficients() -> None:
    # The specific methods the design names; e.g. heun is the trapezoid rule, not Ralston.
    assert TABLEAUS["heun"].c == (0, 1) and TABLEAUS["heun"].b == (F(1, 2), F(1, 2))
    assert TABLEAUS["ralston"].c == (0, F(2, 3)) and TABLEAUS["ralston"].b == (F(1, 4), F(3, 4))
    assert TABLEAUS["midpoint"].b == (0, 1)
    assert TABLEAUS["kutta3"].a[2] == (-1, 2, 0)
    assert TABLEAUS["ssprk3"].c == (0, 1, F(1, 2))
    assert TABLEAUS["rk4"].c == (0, F(1, 2), F(1, 2), 1)
    assert TABLEAUS["rk4_38"].a[3] == (1, -1, 1, 0)
    assert TABLEAUS["rk4_38"].b == (F(1, 8), F(3, 8), F(3, 8), F(1, 8))
    assert [TABLEAUS[n].stages for n in ("euler", "heun", "kutta3", "rk4")] == [1, 2, 3, 4]
    assert TABLEAUS["rk4"].evals_per_step == 4


def _integrate(t: Tableau, n: int) -> float:
    """y' = cos(3 tau) y - y^3 + tau on [0, 1], y(0) = 1, with n steps (nonlinear and nonautonomous)."""

    def f(tau: float, y: float) -> float:
        return math.cos(3 * tau) * y - y**3 + tau

    a = [[float(x) for x in row] for row in t.a]
    b = [float(x) for x in t.b]
    c = [float(x) for x in t.c]
    h, y = 1.0 / n, 1.0
    for step in range(n):
        tau = step * h
        k: list[float] = []
        for i in range(t.stages):
            k.append(f(tau + c[i] * h, y + h * sum(a[i][j] * k[j] for j in range(i))))
        y += h * sum(bi * ki for bi, ki in zip(b, k, strict=True))
    return y


@pytest.mark.parametrize("name", sorted(TABLEAUS))
def test_observed_convergence_order(name: str) -> None:
    t = TABLEAUS[name]
    y1, y2, y3 = (_integrate(t, n) for n in (64, 128, 256))
    observed = math.log2(abs(y1 - y2) / abs(y2 - y3))
    assert abs(observed - t.order) < 0.2, f"{name}: observed order {observed:.2f}"


# --- Tableau.create -----------------------------------------------------------------------------------


def test_create_converts_strings_ints_floats_and_computes_c() -> None:
    t = Tableau.create("mine", [[0, 0], ["2/3", 0]], [0.25, F(3, 4)], order=2)
    assert t.c == (0, F(2, 3))
    assert t.b == (F(1, 4), F(3, 4))
    assert all(type(x) is Fraction for x in (*t.b, *t.c, *t.a[1]))
    assert t == Tableau(name="mine", a=t.a, b=t.b, c=t.c, order=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.order = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(a=[[0, 1], [0, 0]], b=["1/2", "1/2"]), "explicit Runge-Kutta"),
        (dict(a=[[1, 0], [0, 0]], b=["1/2", "1/2"]), "a[0][0]"),
        (dict(a=[[0, 0], [1, 0]], b=["1/2", "1/2"], c=[0, "1/2"]), "row sums"),
        (dict(a=[[0, 0], [1, 0]], b=["1/2", "1/3"]), "sum to 5/6"),
        (dict(a=[[0, 0], [1, 0]], b=[1 / 3, 2 / 3]), "not 1"),
        (dict(a=[[0, 0, 0], [1, 0, 0]], b=["1/2", "1/2"]), "square"),
        (dict(a=[[0, 0], [1, 0], [0, 0]], b=["1/2", "1/2"]), "one row per stage"),
        (dict(a=[[0, 0], [1, 0]], b=["1/2", "1/2"], c=[0]), "c must have 2 entries"),
        (dict(a=[], b=[]), "non-empty"),
        (dict(a=[[0, 0], [2, 0]], b=["1/2", "1/2"]), "outside [0, 1]"),
        (dict(a=[[0, 0], ["x", 0]], b=["1/2", "1/2"]), "not a number"),
        (dict(a=[[0, 0], ["1e999999999", 0]], b=["1/2", "1/2"]), "not a number of a few digits"),
        (dict(a=[[0, 0], ["9" * 100, 0]], b=["1/2", "1/2"]), "not a number of a few digits"),
        (dict(a=[[0, 0], [1, 0]], b=["3/4", "1/4"], order=2), "order-2 conditions do not hold"),
        (dict(a=[[0, 0], [None, 0]], b=["1/2", "1/2"]), "NoneType"),
        (dict(a=[[0, 0], [True, 0]], b=["1/2", "1/2"]), "bool"),
        (dict(a=[[0, 0], [float("nan"), 0]], b=["1/2", "1/2"]), "finite"),
        (dict(a=[[0, 0], [1, 0]], b=["1/2", "1/2"], order=0), "order must be an int >= 1"),
        (dict(a=[[0, 0], [1, 0]], b=["1/2", "1/2"], order=True), "order must be an int >= 1"),
        (dict(a=[[0, 0], [1, 0]], b=["1/2", "1/2"], order=3), "order at most 2"),
        (dict(a=[[0]], b=[1], order=1, name=""), "a tableau name is a Python name"),
        (dict(a=[[0]], b=[1], order=1, name="my rk"), "a tableau name is a Python name"),
        (dict(a=[[0]], b=[1], order=1, name="mine\nimport os"), "a tableau name is a Python name"),
        (dict(a=[[0]], b=[1], order=1, name="x" * 65), "1 to 64 characters"),
    ],
)
def test_create_rejects_bad_tableaus(kwargs: dict, needle: str) -> None:
    kwargs = {"name": "bad", "order": 1, **kwargs}
    with pytest.raises(ConfigError) as info:
        Tableau.create(**kwargs)
    assert needle in str(info.value)


def test_create_rejects_overstated_order() -> None:
    # Heun is second order: claiming order 3 (possible for 3 stages) must fail and name the real order.
    with pytest.raises(ConfigError, match="order 2"):
        Tableau.create("heun3", [[0, 0, 0], [1, 0, 0], [0, 0, 0]], ["1/2", "1/2", 0], order=3)
    # Euler's weights with a consistent first-order tableau cannot claim order 2.
    with pytest.raises(ConfigError, match="order-2 conditions"):
        Tableau.create("euler2", [[0, 0], [1, 0]], [1, 0], order=2)


def test_config_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        Tableau.create("bad", [[0, 0], [1, 0]], [1, 1])


# --- resolve_integrator -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["rk4", "RK4", " rk4 ", "Rk4"])
def test_resolve_by_name(spec: str) -> None:
    assert resolve_integrator(spec) is TABLEAUS["rk4"]


def test_resolve_dash_and_reversible_heun() -> None:
    assert resolve_integrator("RK4-38") is TABLEAUS["rk4_38"]
    rh = resolve_integrator("Reversible-Heun")
    assert isinstance(rh, ReversibleHeun)
    assert (rh.name, rh.order, rh.evals_per_step) == ("reversible_heun", 2, 2)
    assert resolve_integrator(rh) is rh
    assert rh == ReversibleHeun()


def test_resolve_alf() -> None:
    alf = resolve_integrator(" ALF ")
    assert isinstance(alf, AsyncLeapfrog) and alf.initial_velocity == "zero"
    assert (alf.name, alf.order, alf.evals_per_step, alf.evals_at_start) == ("alf", 2, 1, 0)
    started = AsyncLeapfrog("field")  # v_0 = F(t_0, z_0): reachable as an object, not saved by name
    assert (started.name, started.evals_at_start) == ("alf_field_start", 1)
    assert resolve_integrator(started) is started and started != alf


def test_scheme_programs_are_checked() -> None:
    """An increment used after its register changed could not be re-evaluated from the same bits."""
    for scheme in REVERSIBLE_SCHEMES.values():
        validate_scheme(scheme)

    class Broken(AsyncLeapfrog):  # a leapfrog that moves z before p reads the increment
        step = (Evaluate("z", F(1, 2), False, "a"), Add("z", "a"), Reflect("p", "a"))

    with pytest.raises(ValueError, match="used after its register changes"):
        validate_scheme(Broken())

    class Unknown(AsyncLeapfrog):
        step = (Add("z", "b"),)

    with pytest.raises(ValueError, match="not evaluated before it"):
        validate_scheme(Unknown())


def test_resolve_passes_custom_tableau_through() -> None:
    mine = Tableau.create("mine", [[0, 0], ["1/2", 0]], [0, 1], order=2)
    assert resolve_integrator(mine) is mine


def test_resolve_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_integrator("dopri5")
    message = str(info.value)
    assert "dopri5" in message and "Tableau.create" in message
    assert ", ".join(sorted(KNOWN_INTEGRATORS)) in message


@pytest.mark.parametrize(("spec", "type_name"), [(4, "int"), (None, "NoneType"), (["rk4"], "list")])
def test_resolve_rejects_other_types(spec: object, type_name: str) -> None:
    with pytest.raises(ConfigError, match=type_name):
        resolve_integrator(spec)  # type: ignore[arg-type]
