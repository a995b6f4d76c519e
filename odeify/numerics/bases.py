"""Weights over depth: linear bases B_k(t) over K knots, with coefficients computed exactly.

A stage with K knots puts knot k at t_k = k/K on t in [0, 1] and sets theta(t) = sum_k B_k(t) theta_k
(docs/design-math.md). The coefficients depend only on (basis, K, t), so they are computed once at
compile time in `fractions.Fraction`: a float time would misplace cell boundaries and the left limits
that keep a piecewise-constant field inside its cell. No floats appear in this module.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Protocol, runtime_checkable

from odeify.core.errors import ConfigError

__all__ = [
    "BASES",
    "MAX_KNOTS",
    "Basis",
    "ConstantBasis",
    "CubicBasis",
    "LinearBasis",
    "fit_matrix",
    "get_basis",
    "validate_knots",
]

MAX_KNOTS = 4096
# Rows are cached per (K, t) because compile code asks for the same times for every parameter; past this K a
# cubic row holds thousands of Fractions with ~K-digit denominators, so those are recomputed, not kept.
_CACHE_MAX_K = 512

_ZERO = Fraction(0)
_ONE = Fraction(1)

Row = tuple[Fraction, ...]
Matrix = tuple[Row, ...]


@runtime_checkable
class Basis(Protocol):
    """A linear basis over K equispaced knots: theta(t) = sum_k coefficients(K, t)[k] * theta_k."""

    name: str

    def coefficients(self, K: int, t: Fraction, left: bool = False) -> Row:
        """The K coefficients B_k(t); `left` asks for the left limit theta(t-) where that differs."""
        ...


def _check_count(K: object, what: str = "K") -> int:
    if isinstance(K, bool) or not isinstance(K, numbers.Integral) or int(K) < 1:
        raise ConfigError(f"{what} must be an int >= 1, got {K!r}.")
    return int(K)


def _as_time(t: object) -> Fraction:
    """Exact time in [0, 1]; values outside are clamped (the field holds its end values)."""
    if isinstance(t, bool) or not isinstance(t, numbers.Rational):
        raise TypeError(
            f"basis time must be an exact Fraction or int (never a float), got {type(t).__name__} {t!r}."
        )
    ft = t if isinstance(t, Fraction) else Fraction(int(t.numerator), int(t.denominator))
    return min(max(ft, _ZERO), _ONE)


def _unit(K: int, k: int) -> Row:
    row = [_ZERO] * K
    row[k] = _ONE
    return tuple(row)


# --- constant -------------------------------------------------------------------------------------------


@lru_cache(maxsize=2048)
def _constant_row(K: int, t: Fraction, left: bool) -> Row:
    x = t * K
    m = x.numerator // x.denominator  # floor, exact
    if left and x.denominator == 1 and m >= 1:
        m -= 1  # exactly on a cell boundary: the left limit belongs to the cell before it
    return _unit(K, min(max(m, 0), K - 1))


@dataclass(frozen=True)
class ConstantBasis:
    """Piecewise constant: cell [k/K, (k+1)/K) holds theta_k (the last cell extends to t = 1)."""

    name: str = "constant"

    def coefficients(self, K: int, t: Fraction, left: bool = False) -> Row:
        """One-hot row of the cell containing t; with left=True a boundary t = m/K maps to cell m-1."""
        return _constant_row(_check_count(K), _as_time(t), bool(left))


# --- linear ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=2048)
def _linear_row(K: int, t: Fraction) -> Row:
    x = t * K
    if x >= K - 1:
        return _unit(K, K - 1)  # at or beyond the last knot: hold the end value
    m = x.numerator // x.denominator
    w = x - m
    row = [_ZERO] * K
    row[m] = 1 - w
    row[m + 1] = w
    return tuple(row)


@dataclass(frozen=True)
class LinearBasis:
    """Hat functions through the knots (piecewise linear interpolation); continuous, so `left` is moot."""

    name: str = "linear"

    def coefficients(self, K: int, t: Fraction, left: bool = False) -> Row:
        """Hat-function weights at t: two adjacent nonzeros inside the knots, the last knot beyond them."""
        return _linear_row(_check_count(K), _as_time(t))


# --- cubic ----------------------------------------------------------------------------------------------
#
# Natural cubic spline through (k/K, y_k), h = 1/K. The second derivatives M satisfy M_0 = M_{K-1} = 0 and
# M_{p-1} + 4 M_p + M_{p+1} = 6 K^2 (y_{p-1} - 2 y_p + y_{p+1}) for the N = K - 2 interior knots. With T the
# N x N matrix tridiag(1, 4, 1) and theta_n its leading principal minors (theta_0 = 1, theta_1 = 4,
# theta_n = 4 theta_{n-1} - theta_{n-2}), T^{-1}[p][q] = (-1)^(p+q) theta_{min-1} theta_{N-max} / theta_N
# (1-based), all integers over one denominator, so each row of the map y -> M is exact integer work.
# On segment m with w = t K - m, A = 1 - w, B = w:
#   s(t) = A y_m + B y_{m+1} + (h^2 / 6) ((A^3 - A) M_m + (B^3 - B) M_{m+1}),
# and (h^2 / 6) * 6 K^2 = 1, which leaves integer second differences of T^{-1} rows over theta_N.


@lru_cache(maxsize=64)
def _minors(N: int) -> tuple[int, ...]:
    """theta_0..theta_N, the leading principal minors of tridiag(1, 4, 1)."""
    theta = [1, 4]
    while len(theta) <= N:
        theta.append(4 * theta[-1] - theta[-2])
    return tuple(theta[: N + 1])


def _curvature_row(K: int, p: int) -> tuple[int, ...]:
    """Cached `_curvature_row_uncached` for moderate K."""
    return _curvature_row_cached(K, p) if K <= _CACHE_MAX_K else _curvature_row_uncached(K, p)


def _curvature_row_uncached(K: int, p: int) -> tuple[int, ...]:
    """Integers sigma with M_p = 6 K^2 / theta_N * sum_k sigma[k] y_k (zero row at the two end knots)."""
    N = K - 2
    if p <= 0 or p >= K - 1:
        return (0,) * K
    theta = _minors(N)

    def z(q: int) -> int:  # theta_N * T^{-1}[p][q], zero outside the interior
        if q < 1 or q > N:
            return 0
        lo, hi = min(p, q), max(p, q)
        sign = -1 if (p + q) % 2 else 1
        return sign * theta[lo - 1] * theta[N - hi]

    zs = [z(q) for q in range(-1, K + 1)]  # zs[q + 1] = z(q)
    return tuple(zs[k] - 2 * zs[k + 1] + zs[k + 2] for k in range(K))


def _cubic_row(K: int, t: Fraction) -> Row:
    """Cached `_cubic_row_uncached` for moderate K."""
    return _cubic_row_cached(K, t) if K <= _CACHE_MAX_K else _cubic_row_uncached(K, t)


def _cubic_row_uncached(K: int, t: Fraction) -> Row:
    if K == 1:
        return (_ONE,)
    x = t * K
    if x >= K - 1:
        return _unit(K, K - 1)  # at or beyond the last knot: hold the end value
    m = x.numerator // x.denominator
    w = x - m
    if w == 0:
        return _unit(K, m)  # on a knot (the general formula gives the same, at O(K) big-int cost)
    u, v = w.numerator, w.denominator
    theta_n = _minors(K - 2)[K - 2]
    alpha = (v - u) * ((v - u) ** 2 - v * v)  # v^3 (A^3 - A)
    beta = u * (u * u - v * v)  # v^3 (B^3 - B)
    den = v**3 * theta_n
    left_curv, right_curv = _curvature_row(K, m), _curvature_row(K, m + 1)
    nums = [alpha * sl + beta * sr for sl, sr in zip(left_curv, right_curv, strict=True)]
    nums[m] += (v - u) * v * v * theta_n  # A, over the common denominator
    nums[m + 1] += u * v * v * theta_n  # B
    return tuple(Fraction(n, den) for n in nums)


_curvature_row_cached = lru_cache(maxsize=2048)(_curvature_row_uncached)
_cubic_row_cached = lru_cache(maxsize=512)(_cubic_row_uncached)


# For least squares the same spline space has a local basis: uniform cubic B-splines b_i centred on
# knots i = -1..K, with c_{-1} = 2 c_0 - c_1 and c_K = 2 c_{K-1} - c_{K-2} (s'' = 0 at both ends), leaving
# c_0..c_{K-1} free. Then s(k/K) = (c_{k-1} + 4 c_k + c_{k+1}) / 6, which is c_k at both end knots.


@lru_cache(maxsize=4096)
def _cubic_local_row(K: int, t: Fraction) -> Row:
    if K <= 2:
        return _cubic_row(K, t)  # K = 1: a constant; K = 2: the line, for which the cardinal basis is local
    x = t * K
    if x >= K - 1:
        return _unit(K, K - 1)  # held at s(last knot) = c_{K-1}
    m = x.numerator // x.denominator
    w = x - m
    w2, w3 = w * w, w * w * w
    spline_values = (
        (1 - w) ** 3 / 6,
        (3 * w3 - 6 * w2 + 4) / 6,
        (-3 * w3 + 3 * w2 + 3 * w + 1) / 6,
        w3 / 6,
    )
    row = [_ZERO] * K
    for i, value in zip(range(m - 1, m + 3), spline_values, strict=True):
        if i == -1:
            row[0] += 2 * value
            row[1] -= value
        elif i == K:
            row[K - 1] += 2 * value
            row[K - 2] -= value
        else:
            row[i] += value
    return tuple(row)


@lru_cache(maxsize=64)
def _cubic_local_at_knots(K: int) -> Matrix:
    if K <= 2:
        return tuple(_unit(K, k) for k in range(K))
    sixth, two_thirds = Fraction(1, 6), Fraction(2, 3)
    rows = [_unit(K, 0)]
    for k in range(1, K - 1):
        row = [_ZERO] * K
        row[k - 1], row[k], row[k + 1] = sixth, two_thirds, sixth
        rows.append(tuple(row))
    rows.append(_unit(K, K - 1))
    return tuple(rows)


@dataclass(frozen=True)
class CubicBasis:
    """C2 natural cubic spline through the knots (cardinal basis), held constant beyond the last knot."""

    name: str = "cubic"

    def coefficients(self, K: int, t: Fraction, left: bool = False) -> Row:
        """Values at t of the K cardinal splines (spline through unit vector e_k); continuous in t."""
        return _cubic_row(_check_count(K), _as_time(t))

    def _local_row(self, K: int, t: Fraction) -> Row:
        """Natural cubic splines in the B-spline basis (for least squares; see `_design`)."""
        return _cubic_local_row(_check_count(K), _as_time(t))

    def _local_at_knots(self, K: int) -> Matrix:
        """Values of the local basis functions at the knots, E[k][i] = phi_i(k/K)."""
        return _cubic_local_at_knots(_check_count(K))


BASES: dict[str, Basis] = {b.name: b for b in (ConstantBasis(), LinearBasis(), CubicBasis())}


def get_basis(name: str | Basis) -> Basis:
    """Look a basis up by name (case-insensitive); a Basis object passes through."""
    if isinstance(name, str):
        key = name.strip().lower()
        if key in BASES:
            return BASES[key]
        raise ConfigError(f"unknown basis {name!r}; known bases: {', '.join(sorted(BASES))}.")
    if isinstance(name, Basis):
        return name
    raise ConfigError(f"basis must be one of {', '.join(sorted(BASES))}, got {type(name).__name__}.")


# --- fitting knots to blocks ----------------------------------------------------------------------------


def _solve_exact(gram: Sequence[Sequence[Fraction]], rhs: Sequence[Sequence[Fraction]]) -> Matrix | None:
    """Solve gram @ X = rhs exactly (Gaussian elimination, then back substitution); None if singular.

    Zero entries are skipped throughout, so banded systems (local bases) cost O(n * band * width).
    """
    n = len(gram)
    rows = [list(gram[i]) + list(rhs[i]) for i in range(n)]
    total = len(rows[0]) if rows else 0
    for col in range(n):
        pivot = next((r for r in range(col, n) if rows[r][col] != 0), None)
        if pivot is None:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        prow = rows[col]
        inv = 1 / prow[col]
        nonzero = [(j, e * inv) for j in range(col, total) if (e := prow[j]) != 0]
        for j, e in nonzero:
            prow[j] = e
        for r in range(col + 1, n):
            factor = rows[r][col]
            if factor != 0:
                target = rows[r]
                for j, e in nonzero:
                    target[j] -= factor * e
    for col in range(n - 1, -1, -1):  # pivot rows are normalized; clear the entries above each pivot
        prow = rows[col]
        nonzero = [(j, e) for j in range(n, total) if (e := prow[j]) != 0]
        for r in range(col):
            factor = rows[r][col]
            if factor != 0:
                target = rows[r]
                target[col] = _ZERO
                for j, e in nonzero:
                    target[j] -= factor * e
    return tuple(tuple(row[n:]) for row in rows)


def _design(basis: Basis, K: int, L: int) -> tuple[list[Row], Matrix | None]:
    """Rows of the L x K least-squares design matrix, and the change of basis to the cardinal one.

    A basis may offer `_local_row(K, t)` (a local basis of the same function space) and
    `_local_at_knots(K)` (its values at the knots, E). The projection is basis independent, so
    P = E (D^T D)^{-1} D^T with the local D: banded, small numbers, and far cheaper than the dense
    cardinal cubic design.
    """
    local_row = getattr(basis, "_local_row", None)
    at_knots = getattr(basis, "_local_at_knots", None)
    if local_row is not None and at_knots is not None:
        return [local_row(K, Fraction(j, L)) for j in range(L)], at_knots(K)
    return [basis.coefficients(K, Fraction(j, L)) for j in range(L)], None


@lru_cache(maxsize=256)
def _fit_matrix_cached(basis: Basis, K: int, L: int) -> Matrix:
    if K == L:
        return tuple(_unit(K, k) for k in range(K))
    if K > L:
        # Refinement: evaluate the L-knot interpolant at the K new knots.
        return tuple(basis.coefficients(L, Fraction(j, K)) for j in range(K))
    # Compression: least-squares projection of the L samples onto K-knot functions of this basis.
    design, to_cardinal = _design(basis, K, L)
    gram = [[_ZERO] * K for _ in range(K)]
    transposed = [[_ZERO] * L for _ in range(K)]  # D^T
    for j, row in enumerate(design):
        nonzero = [(k, e) for k, e in enumerate(row) if e != 0]
        for k, e in nonzero:
            transposed[k][j] = e
            for k2, e2 in nonzero:
                gram[k][k2] += e * e2
    solution = _solve_exact(gram, transposed)
    if solution is None:
        raise ConfigError(
            f"{K} knots cannot be fitted from {L} blocks with the {basis.name!r} basis: the least-squares "
            "system is singular. Use a different number of knots or another basis."
        )
    if to_cardinal is None:
        return solution
    return tuple(
        tuple(
            sum((e * solution[i][j] for i, e in enumerate(to_cardinal[k]) if e != 0), _ZERO) for j in range(L)
        )
        for k in range(K)
    )


def fit_matrix(basis: str | Basis, K: int, L: int) -> Matrix:
    """The K x L matrix P with knots = P @ data, for data sampled at the L block positions k/L.

    K == L: identity. K < L: least-squares fit P = (D^T D)^{-1} D^T, D[j][k] = B_k^(K)(j/L).
    K > L: refinement, P[j][k] = B_k^(L)(j/K), the L-knot interpolant evaluated at the new knots.
    """
    b = get_basis(basis)
    K = _check_count(K, "K (knots)")
    L = _check_count(L, "L (blocks)")
    try:
        hash(b)
    except TypeError:
        return _fit_matrix_cached.__wrapped__(b, K, L)
    return _fit_matrix_cached(b, K, L)


def validate_knots(knots: object, L: int, basis: str | Basis) -> int:
    """Check a requested knot count for a stage of L blocks and return it as an int.

    Any K in [1, MAX_KNOTS] is accepted: fewer knots than blocks compresses by least squares, more
    refines. The caller resolves 'native' (K = L) before calling.
    """
    b = get_basis(basis)
    _check_count(L, "L (blocks)")
    if isinstance(knots, bool) or not isinstance(knots, numbers.Integral):
        raise ConfigError(
            f"knots must be a positive int (or 'native' for one knot per block, here {L}); "
            f"got {type(knots).__name__} {knots!r}."
        )
    K = int(knots)
    if K < 1:
        raise ConfigError(
            f"knots must be >= 1 (1 = one shared weight set; 'native' = {L}, one per block); got {K}."
        )
    if K > MAX_KNOTS:
        raise ConfigError(
            f"knots = {K} exceeds the maximum of {MAX_KNOTS} for the {b.name!r} basis; a stage of {L} blocks "
            f"rarely needs more than a few times {L}. Use a smaller value."
        )
    return K
