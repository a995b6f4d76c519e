"""The learning-rate schedule of a fine-tuning run: linear warm-up, then cosine to zero."""

from __future__ import annotations

import math

__all__ = ["learning_rate_factor"]


def learning_rate_factor(step: int, total: int, warmup: float) -> float:
    """The schedule at optimizer step ``step`` of ``total``: linear warm-up, then cosine to 0."""
    warm = int(warmup * total)
    if step < warm:
        return (step + 1) / (warm + 1)
    progress = (step - warm) / max(1, total - warm)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
