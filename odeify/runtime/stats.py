"""``AdjointStats``: what a stage's memory-saving backward passes did, for the user to read.

Kept apart from the runtime that fills it (``odeify.runtime.adjoint``,
``odeify.runtime.reversible``), which receives a stage's record with each call it runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class AdjointStats:
    """What a stage's memory-saving backward passes did; read ``stage.adjoint_stats`` after backward.

    ``reverse``: ``last_errors[n]`` is the last pass's relative error in rebuilding step n's start
    x'_n, ``||step_n(x'_n) - x'_{n+1}|| / ||x'_{n+1}||`` (0 for step 0, which starts from the saved
    input; after a fallback, only the steps tried). ``reversible``: ``last_errors`` is one number,
    the relative gap between the rebuilt initial registers and where the forward started them
    (reversible Heun's y_0 = z_0, ALF's p_0 = 0): 0 when the inverse rebuilt every state bit for
    bit. ``worst_error`` is the largest seen in any pass; a non-finite error (a NaN or inf sample)
    counts as the worst possible (``inf``), never as 0.
    """

    backward_passes: int = 0
    fallbacks: int = 0
    worst_error: float = 0.0
    last_errors: list[float] = field(default_factory=list)

    def record(self, errors: Sequence[Tensor]) -> None:
        """Note one pass's errors (0-dim tensors, read here once: no device sync before)."""
        values = torch.stack([e.float() for e in errors]).tolist()
        self.last_errors = [v if math.isfinite(v) else math.inf for v in values]
        self.worst_error = max(self.worst_error, *self.last_errors)
