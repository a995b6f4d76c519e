"""``ODEStage``: the runtime module of one ODE stage (the IR of :mod:`odeify.ir.stage_ir`, made runnable).

Its computation is always written by :mod:`odeify.codegen.emit`: inlined into a model graph by the
``lower`` pass, or as the stage's own unrolled graph, which ``forward`` runs. With a memory-saving
backward mode ``forward`` hands over to :mod:`odeify.runtime.adjoint`, which runs the per-step graphs and
re-runs them in backward.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch
import torch.fx as fx

from odeify.codegen import emit
from odeify.core.errors import ConfigError
from odeify.ir.stage_ir import StageIR
from odeify.runtime.adjoint import integrate_with_adjoint
from odeify.runtime.rerun import knot_window_inputs
from odeify.runtime.stats import AdjointStats


class ODEStage(StageIR):
    """A run of ``depth`` residual blocks as one continuous-in-depth stage (see :class:`StageIR`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.adjoint_stats = AdjointStats()  # what the memory-free backward modes did

    def unrolled_graph(self) -> fx.GraphModule:
        """The whole stage as one unrolled graph ``x -> x(1)``, as lowering inlines it."""
        return emit.unrolled_graph(self)

    def step_graph(self, n: int, kind: str = "forward") -> fx.GraphModule:
        """A graph module for one step (``forward``, or approximate ``reverse``) over its knot window."""
        return emit.step_graph(self, n, kind)

    def field_graph(self, t: Fraction, left: bool = False) -> fx.GraphModule:
        """A graph module ``(x, knot window...) -> F(t, x)`` at an exact time (left limit when ``left``)."""
        return emit.field_graph(self, Fraction(t), left)

    def field(self, t: Fraction, x: torch.Tensor, left: bool = False) -> torch.Tensor:
        """F(t, x) evaluated eagerly at an exact time (a Fraction in [0, 1])."""
        return self.run_graph(self.field_graph(t, left), (x,))

    def run_graph(
        self, graph: fx.GraphModule, state: tuple[torch.Tensor, ...], knots: list[torch.Tensor] | None = None
    ) -> Any:
        """Run a step or field graph on ``state`` and the knot rows it reads (default knots: the stage's)."""
        return graph(*state, *knot_window_inputs(graph, self.knot_tensors() if knots is None else knots))

    def _apply(self, fn, *args: Any, **kwargs: Any):
        return super()._apply(_per_knot_layout(fn), *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The memory-saving backward when gradients are on; else the unrolled graph. While
        ``torch.export``, ``torch.jit.trace`` or ONNX record the model, an eval-mode stage runs its
        unrolled graph (the backward mode matters only in training, and the custom backward cannot
        be recorded); a training-mode one is refused, naming the fix."""
        if self.backward != "backprop" and torch.is_grad_enabled():
            if not recording():
                return integrate_with_adjoint(self, x)
            if self.training:
                raise ConfigError(
                    f"stage '{self.stage_name}' is in training mode with backward '{self.backward}', "
                    "whose custom backward cannot be exported or traced. Export the model in eval mode "
                    "(model.eval(): the backward mode matters only in training), or set "
                    "odeify.set_backward(model, 'backprop') to export the training graph."
                )
        return self.run_graph(self.unrolled_graph(), (x,))


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
