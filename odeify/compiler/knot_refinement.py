"""The warning when a stage gets more knots than it has blocks.

A stage's knots interpolate its blocks' weights, so knots beyond one per block add parameters and
no information. A count that is not a multiple of the blocks does worse: the refined weight path
samples the blocks' path between their own times, so a step that read block k reads block k - 1
(on the constant path) or a mix: the model computes something else (the digits model at 50 knots:
99.72% -> 98.33%). ``convert`` and ``retarget`` say so once per call, as the command line prints it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from torch import nn

from odeify.runtime.stage import ODEStage

__all__ = ["KnotRefinementWarning", "warn_refined_knots"]


class KnotRefinementWarning(UserWarning):
    """A stage was given more knots than it has blocks (and, unless a multiple, computes something else)."""


def warn_refined_knots(before: Mapping[str, int], model: nn.Module, stacklevel: int = 3) -> None:
    """Warn, once for the whole model, where a stage's knots grew past its block count.

    ``before``: each stage's knot count before the call (a stage absent is not compared).
    """
    grown = [
        s
        for s in model.modules()
        if isinstance(s, ODEStage) and s.num_knots > max(s.depth, before.get(s.stage_name, s.num_knots))
    ]
    if not grown:
        return
    moved = [s for s in grown if s.num_knots % s.depth]
    parts = ", ".join(f"'{s.stage_name}' ({s.num_knots} knots for {s.depth} blocks)" for s in grown)
    text = (
        f"more knots than blocks: {parts}. The knots interpolate the blocks' weights, so they add parameters "
        "and no information"
    )
    if moved:
        names = ", ".join(f"'{s.stage_name}'" for s in moved)
        text += (
            f"; and where the count is not a multiple of the blocks ({names}) the refined weight path moves "
            "the blocks' weights in depth, so the model computes something else"
        )
    warnings.warn(
        f"{text}. knots='native' (--knots native) keeps each stage as it is, and a multiple of its blocks "
        "what it computes.",
        KnotRefinementWarning,
        stacklevel=stacklevel,
    )
