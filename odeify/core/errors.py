"""Errors raised where bad input enters odeify, each naming the problem and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class OdeifyError(ValueError):
    """Base class: a user-facing error whose message says what is wrong and what to do.

    A ValueError on purpose: every odeify error but one is a refused input value (an argument, a
    setting, a file's contents), which Python code conventionally catches as ``ValueError``, as it
    does timm's and torch's argument errors. ``except odeify.OdeifyError`` catches odeify's alone.
    The exception is :class:`TrainingDiverged`, a run-time event, which is a RuntimeError as well.
    """


class ModelLoadError(OdeifyError):
    """A model name or checkpoint could not be turned into an nn.Module."""


class TraceError(OdeifyError):
    """torch.fx could not trace the model, or the example input does not fit it."""


class NoResidualBlocksError(OdeifyError):
    """The model has no residual block that odeify can turn into an ODE stage."""


class FallbackWarning(RuntimeWarning):
    """A memory-free backward pass could not stay memory-free, or could not rebuild its states exactly.

    A fallback (the pass redone exactly from the stage input: same gradients, more compute) warns
    once per stage, and ``stage.adjoint_stats.fallbacks`` counts every one; an inexact rebuild
    (``backward='reversible'`` on a field that returned other bits on a re-run) warns on every such
    pass. Both point at the user's line. A category of its own so that a caller that reports the
    counts itself can filter exactly these warnings.
    """


class ConfigError(OdeifyError):
    """A conversion setting (integrator, steps, knots, basis, backward mode, stage name) is invalid."""


class TrainingDiverged(OdeifyError, RuntimeError):
    """A loss or gradient became NaN or infinite; the fine-tuning run stopped before applying it."""


def did_you_mean(name: str, candidates: Iterable[str], n: int = 3) -> str:
    """`` Did you mean: a, b?`` with the names closest to ``name`` (empty when none is close)."""
    close = difflib.get_close_matches(name, list(candidates), n=n)
    return f" Did you mean: {', '.join(close)}?" if close else ""
