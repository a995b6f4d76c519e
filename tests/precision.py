"""Judging low-precision results by an exact reference, never by another low-precision result.

Two float32 computations of the same function in different orders (backprop through the unrolled
graph, a memory-free pass, a fused kernel) differ by round-off whose size depends on the CPU's
kernels: a fixed tolerance between them passes on one machine and fails on another, and it judges
the more accurate side by the less accurate one. Here a float32 (or bf16) result is compared with
the float64 result of the same model, and its error may be at most ``factor`` times the error of the
plain computation (float32 backprop) measured in the same run, with a floor of a few ulps for the
case where the plain computation happens to be nearly exact.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn

ULPS_FLOOR = 8
"""The plain computation's error is taken as at least 8 ulps of its dtype (float32: 9.5e-7)."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, computed in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(torch.float64).tiny))


def as_float64(module: nn.Module) -> nn.Module:
    """A float64 copy of ``module`` with the same weights: the exact reference of its computation."""
    return copy.deepcopy(module).double()


def errors(results: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Each result's relative distance from its float64 counterpart."""
    assert results.keys() == exact.keys()
    return {name: rel(results[name], exact[name]) for name in exact}


def assert_as_accurate_as(
    got: Mapping[str, torch.Tensor],
    plain: Mapping[str, torch.Tensor],
    exact: Mapping[str, torch.Tensor],
    factor: float,
) -> dict[str, float]:
    """Every ``got[name]`` is within ``factor`` x the plain computation's own error of ``exact[name]``.

    ``plain`` is the same quantity from the ordinary computation at ``got``'s precision (e.g. float32
    backprop), ``exact`` from float64. Returns the ratios, for a test to report or check further.
    """
    ratios = {}
    for name in exact:
        eps = torch.finfo(plain[name].dtype).eps
        own = max(rel(plain[name], exact[name]), ULPS_FLOOR * eps)
        error = rel(got[name], exact[name])
        ratios[name] = error / own
        assert error <= factor * own, (
            f"{name}: {error:.3g} from float64, but the plain {plain[name].dtype} computation is "
            f"{own:.3g} from it (allowed: {factor} x)"
        )
    return ratios
