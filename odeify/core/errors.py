"""Errors raised where bad input enters odeify, each naming the problem and the fix."""

from __future__ import annotations


class OdeifyError(ValueError):
    """Base class: a user-facing error whose message says what is wrong and what to do."""


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
