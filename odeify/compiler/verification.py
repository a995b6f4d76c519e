"""Does a conversion compute its source's function? One seeded input decides.

Converting at native depth (Euler, one step and one knot per block) must reproduce the source to
round-off. :func:`measure` runs both on one seeded random input and compares the outputs: the max
absolute difference and its ratio to the largest source output, against a tolerance that follows the
dtype's round-off (fixed for float32 and float64, measured for the others).
``odeify.convert`` measures every native conversion (``verify=False`` skips it) and raises
:class:`VerificationError` past the tolerance; ``odeify.verify``
(:func:`odeify.compiler.conversion.verify`) measures any converted model against its source.
This module imports no conversion code, so that the conversion can import it.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from torch import nn

from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError, OdeifyError

__all__ = [
    "ROUNDOFF_FACTOR",
    "VERIFY_SEED",
    "VERIFY_TOLERANCE",
    "NotOneTensor",
    "Verification",
    "VerificationError",
    "measure",
]

VERIFY_SEED = 0
VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
"""Largest max relative error :func:`measure` accepts. Measured (random non-trivial weights, 64x64
inputs): fp32 2e-7 (digits), 8e-7 (resnet18), 1.1e-6 (resnet50); fp64 3e-15 to 4e-15. The limits
leave about 100x (fp32) and 1e4x (fp64) for deeper models, while a wrong weight (a 0.05 shift in one
knot bias moves the digits model's output by 1.8e-2) is far above them. Other dtypes (bfloat16,
float16) get :data:`ROUNDOFF_FACTOR` times their measured round-off instead."""
ROUNDOFF_FACTOR = 4.0
"""A bfloat16 or float16 conversion may be this many times the source's own round-off from the source:
its relative distance from its float64 copy on the check's input, at least one unit round-off of the
dtype (the load probe's allowance is measured the same way, :mod:`odeify.serialization.probe`).
Measured (seeded inputs; digits, and resnet18 and resnet50 at 64x64 with random non-trivial weights):
the native conversion is 0.9x to 2.3x that round-off away from the source (bfloat16: digits 0.0142
against one ulp 0.0078, its round-off being 0.0042), since folding a BatchNorm rounds its weights
once more. A 0.5 shift of one knot bias of the digits model moves its bfloat16 output by 0.18, 6x
past the allowance; a 0.05 shift (1.8e-2) is within bfloat16's own noise."""


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


class VerificationError(OdeifyError):
    """A native conversion does not reproduce its source: an odeify bug to report.

    ``verification`` holds the measurement; ``converted`` the finished model (in the requested
    manifestation, the measurement recorded on it), for a report or a closer look.
    """

    def __init__(self, verification: Verification, converted: nn.Module) -> None:
        self.verification = verification
        self.converted = converted
        super().__init__(
            f"odeify.convert: the native conversion does not reproduce the source: max relative error "
            f"{verification.relative_error:.3g} on a seeded {'x'.join(map(str, verification.input_shape))} "
            f"input exceeds the tolerance {verification.tolerance:.0e}. Please report this model (its "
            "architecture and how it was built); verify=False (CLI: --no-verify) skips the check."
        )


class NotOneTensor(ConfigError):
    """A model returns something other than one tensor, which :func:`measure` cannot compare.

    ``reason`` says what it returns, for the record of a conversion that skipped its check.
    """

    def __init__(self, output: object) -> None:
        self.reason = f"the model returns a {type(output).__name__}, not one tensor"
        super().__init__(
            "verify compares models with one tensor output; this model returns another type "
            "(CLI: pass --no-verify)."
        )


def measure(converted: nn.Module, source: nn.Module, shape: tuple[int, ...]) -> Verification:
    """Run ``converted`` and ``source`` in eval mode on one random input of ``shape`` (seeded with
    :data:`VERIFY_SEED`, on the source's device) and measure the distance of their outputs; neither
    module is changed. Raises :class:`NotOneTensor` when an output is not one tensor."""
    dtype = model_dtype(source)
    device = next((t.device for t in (*source.parameters(), *source.buffers())), torch.device("cpu"))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(VERIFY_SEED), dtype=dtype).to(device)
    modes = converted.training, source.training
    try:
        with torch.no_grad():
            expected, actual = source.eval()(x), converted.eval()(x)
    finally:
        converted.train(modes[0])
        source.train(modes[1])
    for output in (expected, actual):
        if not isinstance(output, torch.Tensor):
            raise NotOneTensor(output)
    diff = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    relative = diff / scale if scale else float(diff > 0)
    tolerance = VERIFY_TOLERANCE.get(dtype) or _roundoff_tolerance(source, x, expected)
    return Verification(diff, relative, tolerance, shape)


def _roundoff_tolerance(source: nn.Module, x: torch.Tensor, expected: torch.Tensor) -> float:
    """:data:`ROUNDOFF_FACTOR` times the relative round-off of ``source``'s output ``expected`` (on
    ``x``, in the source's dtype), measured against a float64 copy of the source; at least one unit
    round-off of the dtype."""
    twin = copy.deepcopy(source).double().eval()
    with torch.no_grad():
        exact = twin(x.double())
    if not isinstance(exact, torch.Tensor):
        raise NotOneTensor(exact)
    scale = exact.abs().max().item()
    roundoff = (expected.double() - exact).abs().max().item() / scale if scale else 0.0
    return ROUNDOFF_FACTOR * max(roundoff, torch.finfo(expected.dtype).eps)
