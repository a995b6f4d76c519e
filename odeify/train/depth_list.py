"""The depths a fine-tuning run trains one file for (``Recipe.depths``), as the recipe checks them.

Kept apart from :mod:`odeify.train.depths` (which runs them) so that the recipe, made before any model
exists, can check a depth list without importing the training loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from odeify.core.errors import ConfigError
from odeify.ir.settings import StepsSpec, parse_steps

__all__ = ["MAX_DEPTHS", "depth_specs", "depths_text"]

MAX_DEPTHS = 8
"""Depths one run trains for: a few latency budgets, not a sweep (each is validated every epoch)."""


def depth_specs(depths: str | Sequence[int | str]) -> tuple[StepsSpec, ...]:
    """The depths of ``Recipe.depths`` ('native,x0.5,x0.25', or a sequence), checked: two or more,
    each a step count, 'native' or a multiplier (those that give a model the same steps are merged
    against the model: :meth:`odeify.train.depths.DepthPlan.of`)."""
    items = depths.split(",") if isinstance(depths, str) else list(depths)
    specs = tuple(_spec(item) for item in items)
    if not 2 <= len(specs) <= MAX_DEPTHS:
        raise ConfigError(
            f"depths lists 2 to {MAX_DEPTHS} depths to train one file for, e.g. "
            f"'native,x0.5,x0.25'; got {depths!r:.80}. For one depth, give it as steps (--steps)."
        )
    return specs


def depths_text(depths: str | Sequence[int | str]) -> str:
    """The canonical text of a depth list: 'native,x0.5,2'."""
    return ",".join(str(spec) for spec in depth_specs(depths))


def _spec(item: int | str) -> StepsSpec:
    text = item.strip() if isinstance(item, str) else item
    if isinstance(text, str) and text.isdigit():
        text = int(text)
    return parse_steps(text)
