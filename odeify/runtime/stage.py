"""``ODEStage``: the runtime module of one ODE stage (the IR of :mod:`odeify.ir.stage_ir`, made runnable).

Its computation is always written by :mod:`odeify.codegen.emit`: inlined into a model graph by the
``lower`` pass, or as the stage's own unrolled graph, which ``forward`` runs. With a memory-saving
backward mode, while autograd records, ``forward`` hands over to the autograd Function that
:data:`MEMORY_SAVING` names for the mode: it runs the per-step (or per-field) graphs under
``no_grad`` and re-runs them in backward (docs/backward-modes.md).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch

from odeify.codegen import emit
from odeify.core.errors import ConfigError
from odeify.ir.settings import BACKWARD_MODES
from odeify.ir.stage_ir import StageIR
from odeify.runtime.adjoint import CheckpointAdjoint, ReverseAdjoint
from odeify.runtime.rerun import StageCall, StageFunction, knot_window_inputs, training_batchnorm
from odeify.runtime.reversible import LatticeAdjoint
from odeify.runtime.stats import AdjointStats

MEMORY_SAVING: dict[str, type[StageFunction]] = {
    "checkpoint": CheckpointAdjoint,
    "reverse": ReverseAdjoint,
    "reversible": LatticeAdjoint,
}
"""The one table of memory-saving backward modes: the autograd Function that runs each. Its names are
``odeify.ir.settings.BACKWARD_MODES`` but ``backprop``, which runs the unrolled graph."""
if set(MEMORY_SAVING) != set(BACKWARD_MODES) - {"backprop"}:  # one source of the names: fail on import
    raise ImportError(f"MEMORY_SAVING covers {sorted(MEMORY_SAVING)}, BACKWARD_MODES is {BACKWARD_MODES}")


class ODEStage(StageIR):
    """A run of ``depth`` residual blocks as one continuous-in-depth stage (see :class:`StageIR`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.adjoint_stats = AdjointStats()  # what the memory-free backward modes did

    def unrolled_graph(self) -> emit.StepGraph:
        """The whole stage as one unrolled graph ``x -> x(1)``, as lowering inlines it."""
        return emit.unrolled_graph(self)

    def step_graph(self, n: int, kind: str = "forward") -> emit.StepGraph:
        """A graph for one step (``forward``, or approximate ``reverse``) over its knot window."""
        return emit.step_graph(self, n, kind)

    def field_graph(self, t: Fraction, left: bool = False) -> emit.StepGraph:
        """A graph ``(x, knot window...) -> F(t, x)`` at an exact time (left limit when ``left``)."""
        return emit.field_graph(self, Fraction(t), left)

    def field(
        self, t: Fraction, x: torch.Tensor, left: bool = False, inputs: tuple[torch.Tensor, ...] = ()
    ) -> torch.Tensor:
        """F(t, x) evaluated eagerly at an exact time (a Fraction in [0, 1])."""
        return self.run_graph(self.field_graph(t, left), (x,), inputs=inputs)

    def run_graph(
        self,
        graph: emit.StepGraph,
        state: tuple[torch.Tensor, ...],
        knots: list[torch.Tensor] | None = None,
        inputs: tuple[torch.Tensor, ...] = (),
    ) -> Any:
        """Run a step or field graph on ``state``, the knot rows it reads (default knots: the stage's)
        and the stage's constant ``inputs``."""
        knots = self.knot_tensors() if knots is None else knots
        return graph(*state, *knot_window_inputs(graph, knots), *inputs)

    def _apply(self, fn, *args: Any, **kwargs: Any):
        return super()._apply(_per_knot_layout(fn), *args, **kwargs)

    def forward(self, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        """``x`` integrated over the stage, given its constant ``inputs`` (:attr:`StageIR.inputs`).

        The memory-saving backward when gradients are on; else the unrolled graph. While
        ``torch.export``, ``torch.jit.trace`` or ONNX record the model, an eval-mode stage runs its
        unrolled graph (the backward mode matters only in training, and the custom backward cannot
        be recorded); a training-mode one is refused, naming the fix."""
        if self.backward != "backprop" and torch.is_grad_enabled():
            if not recording():
                return integrate_with_adjoint(self, x, inputs)
            if self.training:
                raise ConfigError(
                    f"stage '{self.stage_name}' is in training mode with backward '{self.backward}', "
                    "whose custom backward cannot be exported or traced. Export the model in eval mode "
                    "(model.eval(): the backward mode matters only in training), or set "
                    "odeify.set_backward(model, 'backprop') to export the training graph."
                )
        return self.run_graph(self.unrolled_graph(), (x,), inputs=inputs)


# A deliberate graph break under torch.compile: the Functions run Python loops over cached step
# graphs, record random draws and call autograd in backward, none of which dynamo can trace; the
# rest of a compiled model (the segments between stages) still compiles.
@torch.compiler.disable
def integrate_with_adjoint(
    stage: ODEStage, x: torch.Tensor, inputs: tuple[torch.Tensor, ...] = ()
) -> torch.Tensor:
    """Run ``stage`` on ``x`` (and its constant ``inputs``) with the memory-saving backward named by
    ``stage.backward``."""
    function = MEMORY_SAVING.get(stage.backward)
    if function is None:
        raise ConfigError(
            f"stage '{stage.stage_name}' has backward={stage.backward!r}; the memory-saving runtime runs "
            f"{', '.join(MEMORY_SAVING)} (backprop goes through the unrolled graph)."
        )
    _check_batchnorm(stage)
    _check_inputs(stage, inputs)
    knots = stage.knot_tensors()
    weights = {id(p) for p in stage.weight_parameters()}  # reach the step graphs as the knot inputs
    extras = [p for p in stage.parameters() if p.requires_grad and id(p) not in weights]
    if not (x.requires_grad or any(t.requires_grad for t in (*knots, *extras))):
        with torch.no_grad():
            return stage(x, *inputs)
    call = StageCall(stage, stage.adjoint_stats, len(knots), tuple(inputs))
    return function.run(call, x, [*knots, *extras])


def _check_inputs(stage: ODEStage, inputs: tuple[torch.Tensor, ...]) -> None:
    """The memory-saving modes take constant inputs: re-runs pass them as they are, undifferentiated."""
    given = zip(stage.inputs, inputs, strict=True)
    trainable = [name for name, value in given if getattr(value, "requires_grad", False)]
    if trainable:
        raise ConfigError(
            f"stage '{stage.stage_name}' takes {', '.join(trainable)} as a constant input, but it requires "
            f"grad, which backward '{stage.backward}' does not compute. Use "
            "odeify.set_backward(model, 'backprop'), or compute it from tensors that need no gradient."
        )


def _check_batchnorm(stage: ODEStage) -> None:
    """Refuse train-mode BatchNorm: a re-run would update running stats twice, on other batch stats."""
    name = training_batchnorm(stage)
    if name is not None:
        raise ConfigError(
            f"stage '{stage.stage_name}' holds BatchNorm '{name}' in training mode, but "
            f"backward={stage.backward!r} re-runs steps in backward, which would update its running "
            "statistics a second time (and a reconstructed state has other batch statistics). "
            "Fold it into the conv before it (odeify.convert does) or freeze it with .eval()."
        )


def recording() -> bool:
    """Whether torch.jit.trace or torch.export (and so ONNX's exporters) is recording the model."""
    return torch.jit.is_tracing() or torch.compiler.is_exporting()


def _per_knot_layout(fn):
    """``fn`` for ``Module._apply``, taking 5-D knot stacks of conv weights as their 4-D knots.

    ``model.to(memory_format=torch.channels_last)`` converts every 4-D tensor and refuses other
    ranks, so a stack (K, out, in, kh, kw) of conv weights would fail. Applied to the stack seen as
    (K * out, in, kh, kw), the conversion gives each knot (a view ``stack[k]``, as the step graphs
    read it) the layout a channels_last conv weight has.
    """

    def apply(tensor: torch.Tensor) -> torch.Tensor:
        try:
            return fn(tensor)
        except RuntimeError:
            if tensor.dim() != 5:
                raise
            return fn(tensor.flatten(0, 1)).unflatten(0, tensor.shape[:2])

    return apply
