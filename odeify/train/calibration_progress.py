"""What calibration says while it fits a stage: each depth's relative error so far and the time left.

As a fine-tuning epoch does (:class:`odeify.train.progress.BatchProgress`): tqdm's bar on a terminal;
in a log file, a pipe or with TQDM_DISABLE set, a log line every tenth of the stage's steps and at
its last, so that a long fit (a ViT at three depths: minutes in one stage) is never silent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from odeify.train.progress import LOGGER, bar_wanted

__all__ = ["FitProgress"]

LINES = 10
"""Log lines per stage's fit where there is no bar."""


class FitProgress:
    """One stage's fit: ``iterations`` steps at ``depths``; ``seconds``: the stage's time share, if any."""

    def __init__(
        self, title: str, depths: Sequence[str], iterations: int, seconds: float | None, show: bool
    ) -> None:
        self.title, self.depths, self.iterations, self.seconds = title, list(depths), iterations, seconds
        self.started, self.done, self.bar, self.lines = time.perf_counter(), 0, None, False
        if not show or iterations < 1:
            return
        if not bar_wanted():
            self.lines = True
            return
        from tqdm import tqdm

        self.bar = tqdm(total=iterations, desc=title, leave=False)

    def step(self, errors: Sequence[float]) -> None:
        """One optimizer step done; ``errors``: each depth's squared relative error on its batch."""
        self.done += 1
        per_depth = ", ".join(f"{d} {e:.4f}" for d, e in zip(self.depths, errors, strict=True))
        if self.bar is not None:
            self.bar.update()
            self.bar.set_postfix_str(per_depth)
            return
        interval = math.ceil(self.iterations / LINES)
        if self.lines and (self.done % interval == 0 or self.done == self.iterations):
            LOGGER.info(
                f"{self.title}: step {self.done}/{self.iterations}, error at {per_depth}; "
                f"{time.perf_counter() - self.started:.1f} s, about {self.left():.0f} s left in this stage"
            )

    def left(self) -> float:
        """Seconds left in the stage's fit at the pace so far, within its time share."""
        elapsed = time.perf_counter() - self.started
        left = elapsed / max(1, self.done) * (self.iterations - self.done)
        return left if self.seconds is None else max(0.0, min(left, self.seconds - elapsed))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
