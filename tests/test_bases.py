"""Tests for odeify.numerics.bases against independent oracles: numpy/scipy interpolation, exact
piecewise-cubic reconstruction for C2 continuity, float64 least squares, and exact round trips."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest

from odeify.core.errors import ConfigError
from odeify.numerics.bases import BASES, MAX_KNOTS, fit_matrix, get_basis, validate_knots

F = Fraction
NAMES = sorted(BASES)


def unit(K: int, k: int) -> tuple[Fraction, ...]:
    return tuple(F(int(i == k)) for i in range(K))


def random_times(rng: random.Random, count: int) -> list[Fraction]:
    """Exact times in [0, 1) with assorted denominators, plus two fixed awkward ones."""
    return [F(rng.randrange(0, 10**6), 10**6) for _ in range(count)] + [F(1, 3), F(2, 7)]


def matmul(P: tuple[tuple[Fraction, ...], ...], x: list[Fraction]) -> list[Fraction]:
    return [sum((p * v for p, v in zip(row, x, strict=True)), F(0)) for row in P]


def design(name: str, K: int, L: int) -> list[tuple[Fraction, ...]]:
    basis = get_basis(name)
    return [basis.coefficients(K, F(j, L)) for j in range(L)]


# --- coefficients -------------------------------------------------------------------------------------


def test_registry_and_lookup() -> None:
    assert NAMES == ["constant", "cubic", "linear"]
    for name in NAMES:
        assert get_basis(name).name == name
        assert get_basis(name.upper()) is BASES[name]
        assert get_basis(BASES[name]) is BASES[name]
    with pytest.raises(ConfigError) as info:
        get_basis("quintic")
    assert "quintic" in str(info.value) and "constant, cubic, linear" in str(info.value)
    with pytest.raises(ConfigError, match="int"):
        get_basis(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 8, 13, 40])
def test_interpolates_at_knots(name: str, K: int) -> None:
    basis = get_basis(name)
    for k in range(K):
        assert basis.coefficients(K, F(k, K)) == unit(K, k)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("K", [1, 2, 3, 6, 17])
def test_partition_of_unity_and_exact_types(name: str, K: int) -> None:
    basis = get_basis(name)
    for t in random_times(random.Random(K), 40):
        for left in (False, True):
            row = basis.coefficients(K, t, left=left)
            assert len(row) == K
            assert all(type(x) is Fraction for x in row)
            assert sum(row) == 1


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("K", [1, 2, 3, 7])
def test_holds_end_value_beyond_last_knot(name: str, K: int) -> None:
    basis = get_basis(name)
    last = F(K - 1, K)
    for t in [last, last + F(1, 10**9), (last + 1) / 2, F(1), F(3, 2)]:
        for left in (False, True):
            if left and t == last and name == "constant" and K > 1:
                continue  # the left limit at the last boundary is the cell before it
            assert basis.coefficients(K, t, left=left) == unit(K, K - 1)


def test_constant_cells_and_left_limits() -> None:
    basis = get_basis("constant")
    K = 6
    for m in range(K):
        assert basis.coefficients(K, F(m, K)) == unit(K, m)
        assert basis.coefficients(K, F(m, K), left=True) == unit(K, max(m - 1, 0))
        inside = F(m, K) + F(1, 7 * K)
        assert basis.coefficients(K, inside) == unit(K, m)
        assert basis.coefficients(K, inside, left=True) == unit(K, m)
    assert basis.coefficients(K, F(1)) == unit(K, K - 1)
    assert basis.coefficients(K, F(1), left=True) == unit(K, K - 1)
    assert basis.coefficients(K, F(0), left=True) == unit(K, 0)
    # Just below a boundary is still the earlier cell; exact arithmetic decides, no epsilon.
    assert basis.coefficients(K, F(2, K) - F(1, 10**30)) == unit(K, 1)


@pytest.mark.parametrize("name", ["linear", "cubic"])
def test_continuous_bases_ignore_left(name: str) -> None:
    basis = get_basis(name)
    for K in (2, 5):
        for t in random_times(random.Random(3), 10) + [F(m, K) for m in range(K)]:
            assert basis.coefficients(K, t, left=True) == basis.coefficients(K, t)


def test_linear_matches_numpy_interp() -> None:
    basis = get_basis("linear")
    for K in (2, 3, 7, 20):
        knots = np.arange(K) / K
        for t in random_times(random.Random(K), 30):
            expected = [np.interp(float(t), knots, np.eye(K)[k]) for k in range(K)]
            np.testing.assert_allclose([float(x) for x in basis.coefficients(K, t)], expected, atol=1e-15)


def _scipy_cardinal(K: int, ts: np.ndarray) -> np.ndarray:
    """len(ts) x K matrix of natural-spline cardinal functions, held beyond the last knot (scipy oracle)."""
    interpolate = pytest.importorskip("scipy.interpolate")
    knots = np.arange(K) / K
    clipped = np.minimum(ts, knots[-1])
    spline = interpolate.CubicSpline(knots, np.eye(K), bc_type="natural")
    return spline(clipped)


@pytest.mark.parametrize("K", [3, 4, 5, 9, 16, 600])  # 600: past the row cache
def test_cubic_matches_scipy_natural_spline(K: int) -> None:
    basis = get_basis("cubic")
    ts = random_times(random.Random(K), 50)
    got = np.array([[float(x) for x in basis.coefficients(K, t)] for t in ts])
    np.testing.assert_allclose(got, _scipy_cardinal(K, np.array([float(t) for t in ts])), atol=1e-12)


def _cubic_through(xs: list[Fraction], ys: list[Fraction]) -> list[Fraction]:
    """Power-basis coefficients of the cubic through 4 points (Newton divided differences, exact)."""
    coef = list(ys)
    for level in range(1, 4):
        for i in range(3, level - 1, -1):
            coef[i] = (coef[i] - coef[i - 1]) / (xs[i] - xs[i - level])
    # Expand the Newton form c0 + c1 (x-x0) + c2 (x-x0)(x-x1) + c3 (x-x0)(x-x1)(x-x2) into powers of x.
    poly = [coef[3]]
    for i in (2, 1, 0):
        shifted = [F(0)] + poly  # x * poly
        for j, p in enumerate(poly):
            shifted[j] -= xs[i] * p
        shifted[0] += coef[i]
        poly = shifted
    return poly  # poly[j] multiplies x^j


def _derivatives_at(poly: list[Fraction], x: Fraction) -> tuple[Fraction, Fraction, Fraction]:
    value = sum((p * x**j for j, p in enumerate(poly)), F(0))
    first = sum((j * p * x ** (j - 1) for j, p in enumerate(poly) if j >= 1), F(0))
    second = sum((j * (j - 1) * p * x ** (j - 2) for j, p in enumerate(poly) if j >= 2), F(0))
    return value, first, second


@pytest.mark.parametrize("K", [3, 4, 6, 11])
def test_cubic_is_piecewise_cubic_c2_and_natural(K: int) -> None:
    basis = get_basis("cubic")
    h = F(1, K)
    pieces: list[list[list[Fraction]]] = []  # pieces[m][k]: polynomial of basis k on segment m
    for m in range(K - 1):
        xs = [m * h + h * F(i, 5) for i in (1, 2, 3, 4)]
        rows = [basis.coefficients(K, x) for x in xs]
        segment = [_cubic_through(xs, [row[k] for row in rows]) for k in range(K)]
        # A fifth point in the segment (and both ends) must lie on the same cubic: really piecewise cubic.
        for probe in (m * h, m * h + F(9, 10) * h, (m + 1) * h):
            row = basis.coefficients(K, probe)
            assert [_derivatives_at(segment[k], probe)[0] for k in range(K)] == list(row)
        pieces.append(segment)
    for k in range(K):
        for m in range(1, K - 1):  # interior knot m joins pieces m-1 and m: value, slope, curvature agree
            assert _derivatives_at(pieces[m - 1][k], m * h) == _derivatives_at(pieces[m][k], m * h)
        assert _derivatives_at(pieces[0][k], F(0))[2] == 0  # natural end conditions
        assert _derivatives_at(pieces[-1][k], (K - 1) * h)[2] == 0
    # Not merely C1: the third derivative jumps somewhere, so the check above is not vacuous.
    assert any(pieces[0][k][3] != pieces[1][k][3] for k in range(K))


@pytest.mark.parametrize("K", [2, 3, 5, 12])
def test_cubic_reproduces_lines(K: int) -> None:
    basis = get_basis("cubic")
    alpha, beta = F(-3, 7), F(11, 5)
    ys = [alpha + beta * F(k, K) for k in range(K)]
    for t in random_times(random.Random(K), 30):
        expected = alpha + beta * min(t, F(K - 1, K))
        assert sum(c * y for c, y in zip(basis.coefficients(K, t), ys, strict=True)) == expected


def test_cubic_with_two_knots_is_linear_and_one_knot_is_constant() -> None:
    cubic, linear = get_basis("cubic"), get_basis("linear")
    for t in random_times(random.Random(2), 30):
        assert cubic.coefficients(2, t) == linear.coefficients(2, t)
        for name in NAMES:
            assert get_basis(name).coefficients(1, t) == (1,)


def test_float_time_is_rejected() -> None:
    for name in NAMES:
        with pytest.raises(TypeError, match="Fraction"):
            get_basis(name).coefficients(4, 0.5)  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            get_basis(name).coefficients(0, F(1, 2))


# --- fit_matrix -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_fit_identity_at_native_depth(name: str) -> None:
    for K in (1, 3, 8):
        P = fit_matrix(name, K, K)
        assert P == tuple(unit(K, k) for k in range(K))


def _float_design(name: str, K: int, L: int) -> np.ndarray:
    """L x K design matrix built without odeify (floor / np.interp / scipy)."""
    ts = np.arange(L) / L
    if name == "constant":
        cells = np.minimum(np.floor(ts * K + 1e-9).astype(int), K - 1)  # +1e-9: jK/L may round below an int
        return np.eye(K)[cells]
    if name == "linear":
        knots = np.arange(K) / K
        return np.stack([np.interp(ts, knots, np.eye(K)[k]) for k in range(K)], axis=1)
    return _scipy_cardinal(K, ts)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("K", "L"), [(8, 35), (4, 12), (3, 7), (5, 6), (12, 36)])
def test_least_squares_matches_numpy(name: str, K: int, L: int) -> None:
    D = _float_design(name, K, L)
    np.testing.assert_allclose(
        np.array([[float(x) for x in row] for row in design(name, K, L)]), D, atol=1e-12
    )
    P = np.array([[float(x) for x in row] for row in fit_matrix(name, K, L)])
    assert P.shape == (K, L)
    data = np.random.default_rng(K * 100 + L).standard_normal((L, 3))
    expected, *_ = np.linalg.lstsq(D, data, rcond=None)
    np.testing.assert_allclose(P @ data, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("L", "K"), [(35, 8), (12, 4), (9, 2), (6, 5), (7, 1)])
def test_exact_round_trip(name: str, L: int, K: int) -> None:
    rng = random.Random(L * K)
    c = [F(rng.randrange(-1000, 1000), rng.randrange(1, 50)) for _ in range(K)]
    D = design(name, K, L)
    data = matmul(tuple(D), c)  # lies exactly on a K-knot function of this basis
    assert matmul(fit_matrix(name, K, L), data) == c  # compression recovers the knots exactly
    refine = fit_matrix(name, L, K)  # L x K: the K-knot function evaluated at the L block positions
    assert len(refine) == L and all(len(row) == K for row in refine)
    assert matmul(refine, c) == data


@pytest.mark.parametrize("name", NAMES)
def test_refinement_rows_are_basis_evaluations(name: str) -> None:
    basis = get_basis(name)
    P = fit_matrix(name, 10, 4)
    assert P == tuple(basis.coefficients(4, F(j, 10)) for j in range(10))
    assert all(sum(row) == 1 for row in P)


@pytest.mark.parametrize("name", NAMES)
def test_compression_preserves_constants(name: str) -> None:
    # Constants lie in every basis' span, so each fit row sums to 1.
    for K, L in [(3, 10), (7, 64)]:
        assert all(sum(row) == 1 for row in fit_matrix(name, K, L))


def test_cubic_fit_agrees_with_direct_normal_equations() -> None:
    # fit_matrix uses a local B-spline basis for cubic; a wrapper without it forces the cardinal design.
    class CardinalOnly:
        name = "cubic-cardinal"

        def coefficients(self, K: int, t: Fraction, left: bool = False) -> tuple[Fraction, ...]:
            return BASES["cubic"].coefficients(K, t, left)

    for K, L in [(3, 7), (6, 20), (9, 11)]:
        assert fit_matrix("cubic", K, L) == fit_matrix(CardinalOnly(), K, L)


def test_singular_fit_raises() -> None:
    class Degenerate:  # every point maps to knot 0: the other knots are never seen
        name = "degenerate"

        def coefficients(self, K: int, t: Fraction, left: bool = False) -> tuple[Fraction, ...]:
            return unit(K, 0)

    with pytest.raises(ConfigError, match="cannot be fitted from 10 blocks"):
        fit_matrix(Degenerate(), 3, 10)


def test_fit_matrix_rejects_bad_sizes() -> None:
    with pytest.raises(ConfigError):
        fit_matrix("linear", 0, 4)
    with pytest.raises(ConfigError):
        fit_matrix("linear", 2, True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown basis"):
        fit_matrix("spline", 2, 4)


# --- validate_knots -------------------------------------------------------------------------------------


def test_validate_knots_accepts_positive_ints() -> None:
    assert validate_knots(1, 6, "linear") == 1
    assert validate_knots(6, 6, "cubic") == 6
    assert validate_knots(np.int64(24), 6, "constant") == 24
    assert validate_knots(MAX_KNOTS, 6, "constant") == MAX_KNOTS


@pytest.mark.parametrize(
    ("knots", "needle"),
    [
        (0, ">= 1"),
        (-4, ">= 1"),
        (True, "bool"),
        (2.5, "float"),
        ("8", "str"),
        (None, "NoneType"),
        (MAX_KNOTS + 1, "maximum"),
    ],
)
def test_validate_knots_rejects(knots: object, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_knots(knots, 6, "linear")
    assert needle in str(info.value)
    if needle != "maximum":
        assert "native" in str(info.value)


def test_validate_knots_checks_basis() -> None:
    with pytest.raises(ConfigError, match="unknown basis"):
        validate_knots(4, 6, "bezier")
