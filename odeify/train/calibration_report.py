"""What calibration reports: each stage's residual before and after its fit, at each listed depth, and
the run's images, time and memory (:func:`odeify.train.calibration.calibrate`'s second result)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LEFT_AS_EXACT", "LEFT_AS_SOURCE", "CalibrationReport", "DepthFit", "StageFit"]


@dataclass
class DepthFit:
    """One listed depth of a stage's fit: the stage's step count there, its output's relative residual
    before and after, and the network output's where it was fitted too."""

    depth: str
    steps: int
    before: float
    after: float
    output: tuple[float, float] | None = None

    def __str__(self) -> str:
        output = f", output residual {self.output[0]:.4f} -> {self.output[1]:.4f}" if self.output else ""
        steps = f"{self.steps} step{'s' if self.steps != 1 else ''}"
        return f"at {self.depth} ({steps}) residual {self.before:.4f} -> {self.after:.4f}{output}"


LEFT_AS_SOURCE = "it runs its source stage's blocks as they are"
LEFT_AS_EXACT = "it computes its source stage exactly: residual 0 on the calibration images"


@dataclass
class StageFit:
    """One stage's calibration: its relative residual on the calibration images before and after;
    None for a stage left as it is because it computes its source stage exactly (``why`` says how).
    ``output``: the network output's relative residual before and after, where it was fitted too.
    ``depths``: each listed depth's residuals, where ``calibrate`` was given ``steps``; ``before``,
    ``after`` and ``output`` are then the first listed depth's."""

    stage: str
    before: float | None
    after: float | None
    iterations: int
    seconds: float
    output: tuple[float, float] | None = None
    depths: list[DepthFit] = field(default_factory=list)
    why: str = LEFT_AS_SOURCE

    @property
    def fitted(self) -> bool:
        return self.before is not None

    def __str__(self) -> str:
        if not self.fitted:
            return f"{self.stage}: left as it is ({self.why})"
        if self.depths:
            fits = "; ".join(str(depth) for depth in self.depths)
            return f"{self.stage}: {fits} ({self.iterations} steps, {self.seconds:.1f} s)"
        output = f", output residual {self.output[0]:.4f} -> {self.output[1]:.4f}" if self.output else ""
        return (
            f"{self.stage}: residual {self.before:.4f} -> {self.after:.4f}{output} "
            f"({self.iterations} steps, {self.seconds:.1f} s)"
        )


@dataclass
class CalibrationReport:
    """What :func:`calibrate` did: the images, the time, the depths fitted (empty: the model's own),
    and each stage's fit."""

    images: int
    seconds: float
    stages: list[StageFit] = field(default_factory=list)
    depths: list[str] = field(default_factory=list)
    memory: tuple[float, float, float | None] | None = None
    """The activations' memory budget and what was spilled to a temporary file (MiB), and the
    process's peak memory during the calibration (MiB: resident on the CPU, allocated on a GPU; None
    where unknown)."""

    @property
    def fit_seconds(self) -> float:
        """The time in the stages' fits (their residuals before and after included)."""
        return sum(fit.seconds for fit in self.stages)

    def __str__(self) -> str:
        at = f" at depths {', '.join(self.depths)}" if self.depths else ""
        head = (
            f"calibrated on {self.images} images{at} in {self.seconds:.1f} s (fits {self.fit_seconds:.1f} s)"
        )
        if self.memory is not None:
            budget, spilled, peak = self.memory
            on_disk = f", {spilled:.1f} MiB more in a temporary file" if spilled else ""
            head += f", activations within {budget:g} MiB of memory{on_disk}"
            head += f", peak memory {peak:.0f} MiB" if peak is not None else ""
        return "\n".join([head + ":", *(f"  {fit}" for fit in self.stages)])
