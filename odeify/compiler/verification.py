"""Does a conversion compute its source's function? One seeded input decides.

Converting at native depth (Euler, one step and one knot per block) must reproduce the source to
round-off. :func:`measure` runs both on one seeded random input and compares the outputs: the max
absolute difference and its ratio to the largest source output, against a tolerance for the dtype.
``odeify.convert`` measures every native conversion (``verify=False`` skips it) and raises
:class:`VerificationError` past the tolerance; ``odeify.verify``
(:func:`odeify.compiler.conversion.verify`) measures any converted model against its source.
This module imports no conversion code, so that the conversion can import it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError, OdeifyError

__all__ = ["VERIFY_SEED", "VERIFY_TOLERANCE", "NotOneTensor", "Verification", "VerificationError", "measure"]

VERIFY_SEED = 0
VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
"""Largest max relative error :func:`measure` accepts. Measured (random non-trivial weights, 64x64
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
    return Verification(diff, relative, VERIFY_TOLERANCE.get(dtype, 1e-2), shape)
