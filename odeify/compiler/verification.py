"""``odeify.verify``: does a conversion compute its source's function? One seeded input decides.

Converting at native depth (Euler, one step and one knot per block) must reproduce the source to
round-off. :func:`verify` runs both on one seeded random input and compares the outputs: the max
absolute difference and its ratio to the largest source output, against a tolerance for the dtype.
``odeify convert`` runs it by default (``--no-verify`` skips it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from odeify.compiler.analysis import input_shape_for
from odeify.compiler.conversion import check_converted
from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError

__all__ = ["VERIFY_SEED", "VERIFY_TOLERANCE", "Verification", "verify"]

VERIFY_SEED = 0
VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
"""Largest max relative error :func:`verify` accepts. Measured (random non-trivial weights, 64x64
inputs): fp32 2e-7 (digits), 8e-7 (resnet18), 1.1e-6 (resnet50); fp64 3e-15 to 4e-15. The limits
leave about 100x (fp32) and 1e4x (fp64) for deeper models, while a wrong weight (a 0.05 shift in one
knot bias moves the digits model's output by 1.8e-2) is far above them."""


@dataclass(frozen=True)
class Verification:
    """The measured distance of a converted model from its source on one seeded input."""

    max_abs_diff: float
    relative_error: float
    tolerance: float
    input_shape: tuple[int, ...]

    @property
    def passed(self) -> bool:
        return self.relative_error <= self.tolerance

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


def verify(converted: nn.Module, source: nn.Module, input_size: Sequence[int] | None = None) -> Verification:
    """Compare ``converted`` (at its own manifestation; native depth reproduces the source) with
    ``source`` on one random input of ``input_size`` (C, H, W; default: the size the model was
    converted at), seeded with :data:`VERIFY_SEED`. Both run in eval mode; neither is changed."""
    check_converted(converted, "verify")
    traced = getattr(converted, "meta", {}).get("odeify", {}).get("input_shape")
    shape = tuple(traced) if input_size is None and traced else input_shape_for(source, input_size)
    dtype = model_dtype(source)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(VERIFY_SEED), dtype=dtype)
    modes = converted.training, source.training
    with torch.no_grad():
        expected, actual = source.eval()(x), converted.eval()(x)
    converted.train(modes[0])
    source.train(modes[1])
    if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
        raise ConfigError(
            "verify compares models with one tensor output; this model returns another type "
            "(CLI: pass --no-verify)."
        )
    diff = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    relative = diff / scale if scale else float(diff > 0)
    return Verification(diff, relative, VERIFY_TOLERANCE.get(dtype, 1e-2), shape)
