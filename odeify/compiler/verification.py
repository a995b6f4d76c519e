"""Does a conversion compute its source's function? One seeded input decides.

Converting at native depth (Euler, one step and one knot per block) must reproduce the source to
round-off. :func:`measure` runs both on one seeded random input and compares the outputs: the max
absolute difference and its ratio to the largest source output, against an allowance measured on that
input from the round-off of the source and of the conversion (:func:`allowance`), as ``odeify.load``'s
probe measures its own (:mod:`odeify.serialization.probe`): a fixed tolerance refused correct
conversions of ill-conditioned float32 models.
``odeify.convert`` measures every native conversion (``verify=False`` skips it) and raises
:class:`VerificationError` past the allowance; ``odeify.verify``
(:func:`odeify.compiler.conversion.verify`) measures any converted model against its source.
This module imports no conversion code, so that the conversion can import it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError, OdeifyError

__all__ = [
    "ROUNDOFF_FACTOR",
    "VERIFY_FLOOR",
    "VERIFY_SEED",
    "NotOneTensor",
    "Verification",
    "VerificationError",
    "allowance",
    "measure",
]

VERIFY_SEED = 0
VERIFY_FLOOR = {torch.float32: 1e-4, torch.float64: 1e-10}
"""The allowance is never below this max relative error (other dtypes: :data:`ROUNDOFF_FACTOR` x
their eps). It was the whole tolerance before the allowance followed the round-off, and still
decides on well-conditioned models (random non-trivial weights): fp32 errors of 1.8e-7 (digits,
32x32), 8e-7 (resnet18) and 1.3e-6 (resnet50, 64x64); fp64 2.5e-16 to 4e-15. A wrong weight is far
above it (a 0.05 shift in one knot bias moves the digits model's output by 1.9e-2); at its edge, a
shift of one knot bias value that moves the output by 2.5x the floor is refused and one of 0.25x
passes (digits: 2.5e-3 and 2.5e-4 on a value of 3.0e-2; tests/test_verify.py)."""
ROUNDOFF_FACTOR = 4.0
"""A conversion may be this many times the larger of two round-offs from the source (and at least
:data:`VERIFY_FLOOR`): the source's own and the converted model's own, each its relative distance from
a float64 copy of itself on the check's input, at least one unit round-off of the dtype.

Why: a fixed tolerance refused correct float32 conversions of ill-conditioned models as odeify bugs.
Measured (``make_test_model`` weights, the pretrained input size, one thread; float32 error / the
source's round-off / the conversion's): halonet_h1 (256, seed 0) 4.6e-2 / 6.0e-2 / 4.5e-2;
visformer_tiny (224) seed 2 4.6e-3 / 2.4e-3 / 7.0e-3, seed 8 1.6e-3 / 1.5e-3 / 1.7e-4, seed 13
1.2e-4 / 1.4e-5 / 9.6e-5; regnety_016 (224) seed 1 1.9e-4 / 6.1e-4 / 4.6e-4, at 64x64 seed 13
3.5e-4 / 4.3e-4 / 9.0e-5: all refused by the fixed 1e-4, all accepted now, while their float64
conversions agree with their sources to 1e-14 to 5e-13 (halonet_h1 8.6e-11).

Why the conversion's round-off too: it computes in another order (folded BatchNorms, other kernels),
and on an ill-conditioned model its own round-off can be several times the source's. Over 62
models (visformer_tiny at 224, seeds 2, 4, 8 to 15; regnety_016 at 224, 10 seeds, at 64, 10, and at
32, 14; regnety_002 at 64, 14; halonet_h1; digits, resnet18, resnet50) the error is at most 1.7x the
larger of the two round-offs, but up to 8.6x the source's alone (visformer seed 13; 5.2x
regnety_016 seed 0, 4.1x visformer seed 4). The conversion's round-off cannot excuse a wrong
weight: its float64 copy carries the same weight, so the wrong weight moves both alike. It is
measured only where the source's does not settle the check (visformer seed 13 above): the source's
float64 run costs every check 0.01 s on digits, 0.3 s on visformer_tiny at 224 and 0.8 s on
resnet50 at 64x64 (one thread).

Float64 has no wider dtype in torch (no float128 on any device), so its round-off is estimated as a
float32 copy's, scaled by the ratio of the unit round-offs (2^-29), as the load probe does; a float32
copy that does not compute the model (a relative distance of 1 or more: overflow) gives no estimate
and leaves the floor. The same rule rather than the fixed 1e-10: halonet_h1's float64 conversion is
8.6e-11 from its source on the check's input, within 1.2x of 1e-10, against an estimated round-off
of 3.7e-11 (allowance 1.5e-10; the conversion's 5.6e-11); on the other models above the floor decides.

bfloat16 and float16 (digits): the conversion is 2.6x and 2.7x the source's round-off from the source
(bfloat16 0.0142 against 0.0054, float16 1.2e-3 against 4.4e-4), since folding a BatchNorm rounds its
weights once more; the allowance is 4x the dtype's eps (bfloat16 0.031). A 0.5 shift of one knot bias
of the digits model moves its bfloat16 output by 0.18, 6x past it; a 0.05 shift (1.8e-2) is within
bfloat16's own noise."""


@dataclass(frozen=True)
class Verification:
    """The measured distance of a converted model from its source on one seeded input, with what
    it was judged against: ``tolerance``, the allowance (:func:`allowance`) from the source's own
    round-off on that input and, where that does not settle it, the converted model's
    (``converted_roundoff``, None when not measured); relative, as ``relative_error``."""

    max_abs_diff: float
    relative_error: float
    tolerance: float
    source_roundoff: float
    converted_roundoff: float | None
    input_shape: tuple[int, ...]

    @property
    def passed(self) -> bool:
        return self.relative_error <= self.tolerance

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


class VerificationError(OdeifyError):
    """A native conversion does not reproduce its source: likely an odeify bug, to report.

    ``verification`` holds the measurement; ``converted`` the finished model (in the requested
    manifestation, the measurement recorded on it), for a report or a closer look.
    """

    def __init__(self, verification: Verification, converted: nn.Module) -> None:
        self.verification = verification
        self.converted = converted
        check = verification
        super().__init__(
            f"odeify.convert: the native conversion does not reproduce the source: max relative error "
            f"{check.relative_error:.3g} on a seeded {'x'.join(map(str, check.input_shape))} input exceeds "
            f"the allowance {check.tolerance:.3g}: {ROUNDOFF_FACTOR:g}x the larger of the source's own "
            f"round-off on that input ({check.source_roundoff:.3g}, its distance from a float64 copy of "
            f"itself; for a float64 model a float32 copy's, scaled) and the converted model's "
            f"({check.converted_roundoff:.3g}), or a fixed floor. Round-off does not explain it: this is "
            "likely an odeify bug. Please report this model (its architecture and how it was built); "
            "verify=False (CLI: --no-verify) skips "
            "the check."
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
    :data:`VERIFY_SEED`, on the source's device) and measure the distance of their outputs and the
    source's own round-off; the converted model's too where the source's does not allow the distance
    (:func:`allowance`), which spares its copy's run on most models. Neither module is changed.
    Raises :class:`NotOneTensor` when an output is not one tensor."""
    dtype = model_dtype(source)
    device = next((t.device for t in (*source.parameters(), *source.buffers())), torch.device("cpu"))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(VERIFY_SEED), dtype=dtype).to(device)
    modes = converted.training, source.training
    try:
        expected, actual = _run(source.eval(), x), _run(converted.eval(), x)
    finally:
        converted.train(modes[0])
        source.train(modes[1])
    diff = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    relative = diff / scale if scale else float(diff > 0)
    source_roundoff = _roundoff(source, x, expected, scale)
    tolerance = allowance(dtype, source_roundoff)
    converted_roundoff = None
    if not relative <= tolerance:  # the converted model's own round-off may excuse it (NaN never)
        converted_roundoff = _roundoff(converted, x, actual, scale)
        tolerance = allowance(dtype, source_roundoff, converted_roundoff)
    return Verification(diff, relative, tolerance, source_roundoff, converted_roundoff, shape)


def allowance(dtype: torch.dtype, *roundoffs: float) -> float:
    """The largest relative error a conversion in ``dtype`` may have: :data:`ROUNDOFF_FACTOR` x the
    largest finite relative round-off (at least the dtype's eps), and at least :data:`VERIFY_FLOOR`.
    A round-off that is not finite (a copy that overflows) vouches for nothing and is left out."""
    measured = [r for r in roundoffs if math.isfinite(r)]
    return max(VERIFY_FLOOR.get(dtype, 0.0), ROUNDOFF_FACTOR * max([torch.finfo(dtype).eps, *measured]))


def _roundoff(model: nn.Module, x: torch.Tensor, output: torch.Tensor, scale: float) -> float:
    """``model``'s relative round-off on ``x``: the max distance of its ``output`` from a float64
    copy's, over ``scale`` (0 when ``scale`` is 0); for a float64 model, a float32 copy's distance
    scaled to float64's unit round-off (see :data:`ROUNDOFF_FACTOR`). inf, which vouches for nothing,
    where the copy does not compute the model's function (a relative distance not below 1: a float32
    copy of a float64 model that overflows)."""
    if output.dtype == torch.float64:
        low = _run(_copy_in(model, torch.float32), x.float()).double()
        distance, unit = (low - output).abs().max().item(), torch.finfo(torch.float32).eps
    else:
        exact = _run(_copy_in(model, torch.float64), x.double())
        distance, unit = (output.double() - exact).abs().max().item(), torch.finfo(output.dtype).eps
    relative = distance / scale if scale else 0.0
    if not relative < 1:
        return math.inf
    return relative * torch.finfo(output.dtype).eps / unit


def _copy_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """An eval-mode copy of ``model`` in ``dtype``, each floating tensor cast straight from the model's:
    never a whole copy in the model's dtype first (a large model's float64 copy is the check's peak)."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(_cast(param.detach(), dtype), param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = _cast(buffer.detach(), dtype)
    return copy.deepcopy(model, memo).to(dtype).eval()


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``tensor`` in ``dtype`` where it is floating, else of its own dtype."""
    return tensor.to(dtype if tensor.is_floating_point() else tensor.dtype, copy=True)


def _run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model``'s output on ``x`` without autograd; :class:`NotOneTensor` unless it is one tensor."""
    with torch.no_grad():
        output = model(x)
    if not isinstance(output, torch.Tensor):
        raise NotOneTensor(output)
    return output
