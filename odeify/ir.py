"""``ODEStage``: one run of residual blocks as the ODE dx/dt = F(t, x) on t in [0, 1].

The stage holds a *template* of one block (an fx graph taking ``x`` and one tensor per weight
slot), the knots (each slot's per-knot tensors stacked on a leading axis), and the manifestation
(basis, integrator, steps, backward mode). Its computation is always written by
:mod:`odeify.emit`: inlined into a model graph by the ``lower`` pass, or as small per-step graphs
that this module runs eagerly (and that the adjoint modes re-run in backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn

from odeify.adjoint import AdjointStats
from odeify.bases import get_basis
from odeify.settings import (
    BackwardMode,
    validate_backward,
    validate_checkpoint_every,
    validate_steps,
)
from odeify.tableaus import Integrator, ReversibleHeun, resolve_integrator


@dataclass(frozen=True)
class Slot:
    """One tensor input of the block template.

    ``kind`` is ``param`` (trainable knots), ``buffer`` (non-trainable knots, such as NF-ResNet's
    per-block float constants) or ``shared`` (one tensor for all times, e.g. a blur filter).
    """

    name: str
    kind: Literal["param", "buffer", "shared"]


class ODEStage(nn.Module):
    """A run of ``depth`` residual blocks as one continuous-in-depth stage."""

    def __init__(
        self,
        name: str,
        template: fx.GraphModule,
        slots: list[Slot],
        tensors: dict[str, torch.Tensor],
        form: Literal["post", "pre"],
        depth: int,
        variants: dict[str, list[nn.Module]] | None = None,
        *,
        basis: str = "constant",
        integrator: str | Integrator = "euler",
        steps: int | None = None,
        backward: BackwardMode = "backprop",
    ) -> None:
        super().__init__()
        self.stage_name = name
        self.template = template
        self.slots = list(slots)
        self.form = form
        self.depth = depth
        self.knots = nn.ParameterDict()
        for slot in self.slots:
            tensor = tensors[slot.name]
            if slot.kind == "param":
                self.knots[slot.name] = nn.Parameter(tensor)
            else:
                self.register_buffer(f"{slot.kind}_{slot.name}", tensor)
        self.variants = nn.ModuleDict({key: nn.ModuleList(mods) for key, mods in (variants or {}).items()})
        self.variant_targets = {key.replace("__", "."): key for key in self.variants}
        self.adjoint_stats = AdjointStats()  # what the memory-free backward modes did (odeify.adjoint)
        self.configure(
            basis=basis, integrator=integrator, steps=steps or depth, backward=backward, checkpoint_every=1
        )

    # -- configuration -------------------------------------------------------------------------
    def configure(
        self,
        *,
        basis: str | None = None,
        integrator: str | Integrator | None = None,
        steps: int | None = None,
        backward: BackwardMode | None = None,
        checkpoint_every: int | None = None,
    ) -> ODEStage:
        """Set the manifestation: validates every setting first, so a refused call changes nothing.

        ``checkpoint_every=k`` makes ``backward='checkpoint'`` keep every k-th step's state and
        recompute the k - 1 steps between in backward (memory ~ steps/k + k states).
        """
        current = (
            getattr(self, "basis", None),
            getattr(self, "integrator", None),
            getattr(self, "steps", None),
        )
        new_basis = get_basis(basis).name if basis is not None else current[0]
        new_integrator = resolve_integrator(integrator) if integrator is not None else current[1]
        new_steps = validate_steps(steps, self.stage_name) if steps is not None else current[2]
        new_backward = validate_backward(backward if backward is not None else self.backward, new_integrator)
        if checkpoint_every is not None:
            self.checkpoint_every = validate_checkpoint_every(checkpoint_every, self.stage_name)
        self.basis, self.integrator, self.steps, self.backward = (
            new_basis,
            new_integrator,
            new_steps,
            new_backward,
        )
        return self

    @property
    def draws_random(self) -> bool:
        """Whether a block evaluation may draw random numbers (DropPath, dropout) in train mode."""
        return any(_may_draw_random(m) for m in [*self.template.modules(), *self.variants.modules()])

    @property
    def num_knots(self) -> int:
        for slot in self.slots:
            if slot.kind != "shared":
                return self.slot_tensor(slot).shape[0]
        return self.depth

    def slot_tensor(self, slot: Slot) -> torch.Tensor:
        if slot.kind == "param":
            return self.knots[slot.name]
        return getattr(self, f"{slot.kind}_{slot.name}")

    def slot_attr(self, slot: Slot) -> str:
        """The attribute path of a slot's tensor, relative to this module."""
        return f"knots.{slot.name}" if slot.kind == "param" else f"{slot.kind}_{slot.name}"

    def knot_tensors(self) -> list[torch.Tensor]:
        """Every time-dependent tensor, in slot order: the inputs the step graphs take."""
        return [self.slot_tensor(s) for s in self.slots if s.kind != "shared"]

    # -- exact time bookkeeping ----------------------------------------------------------------
    def row(self, t: Fraction, left: bool) -> tuple[Fraction, ...]:
        """Basis coefficients over the knots at time ``t`` (left limit when ``left``), exactly."""
        rows = self._cached().rows
        if (t, left) not in rows:
            rows[t, left] = tuple(get_basis(self.basis).coefficients(self.num_knots, t, left))
        return rows[t, left]

    def mix_index(self, row: tuple[Fraction, ...]) -> int:
        """Index of a dense coefficient row in the ``mix`` buffer, registering it if new."""
        index = self._cached().mix_index
        if row not in index:
            index[row] = len(index)
            dtype = next((t.dtype for t in self.knot_tensors() if t.is_floating_point()), torch.float32)
            device = next((t.device for t in self.knot_tensors()), torch.device("cpu"))
            rows = sorted(index, key=index.__getitem__)
            mix = torch.tensor([[float(c) for c in r] for r in rows], dtype=dtype, device=device)
            self.register_buffer("mix", mix, persistent=False)
        return index[row]

    def variant_index(self, t: Fraction, left: bool) -> int:
        """The original block whose per-block modules (DropPath rates) serve time ``t``."""
        return get_basis("constant").coefficients(self.depth, t, left).index(1)

    # -- eager execution -----------------------------------------------------------------------
    def unrolled_graph(self) -> fx.GraphModule:
        """The whole stage as one unrolled graph ``x -> x(1)``, as lowering inlines it."""
        from odeify.emit import build_unrolled_graph

        graphs = self._cached().graphs
        if "unrolled" not in graphs:
            graphs["unrolled"] = build_unrolled_graph(self)
        return graphs["unrolled"]

    def step_graph(self, n: int, kind: str = "forward") -> fx.GraphModule:
        """A graph module for one step (``forward``, or approximate ``reverse``) over its knot window."""
        from odeify.emit import build_step_graph

        graphs = self._cached().graphs
        if (n, kind) not in graphs:
            graphs[n, kind] = build_step_graph(self, n, kind)
        return graphs[n, kind]

    def field_graph(self, t: Fraction, left: bool = False) -> fx.GraphModule:
        """A graph module ``(x, knot window...) -> F(t, x)`` at an exact time (left limit when ``left``)."""
        from odeify.emit import build_field_graph

        graphs = self._cached().graphs
        key = (Fraction(t), left, "field")
        if key not in graphs:
            graphs[key] = build_field_graph(self, Fraction(t), left)
        return graphs[key]

    def field(self, t: Fraction, x: torch.Tensor, left: bool = False) -> torch.Tensor:
        """F(t, x) evaluated eagerly at an exact time (a Fraction in [0, 1])."""
        return self.run_graph(self.field_graph(t, left), (x,))

    def run_graph(
        self, graph: fx.GraphModule, state: tuple[torch.Tensor, ...], knots: list[torch.Tensor] | None = None
    ) -> Any:
        """Run a step or field graph on ``state`` and the knot rows it reads (default knots: the stage's)."""
        from odeify.rerun import knot_window_inputs

        return graph(*state, *knot_window_inputs(graph, self.knot_tensors() if knots is None else knots))

    def initial_state(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x, x) if isinstance(self.integrator, ReversibleHeun) else (x,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backward != "backprop" and torch.is_grad_enabled():
            from odeify.adjoint import integrate_with_adjoint

            return integrate_with_adjoint(self, x)
        return self.run_graph(self.unrolled_graph(), (x,))

    def _cached(self) -> _Caches:
        """The graphs and rows built for the current basis, integrator, steps and knot count."""
        signature = (self.basis, self.integrator, self.steps, self.num_knots)
        if getattr(self, "_caches", None) is None or self._caches.signature != signature:
            self._caches = _Caches(signature)
        return self._caches

    def _apply(self, fn, *args, **kwargs):
        self._caches = None  # cached graphs hold references to modules and buffers that .to() replaces
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"name={self.stage_name!r}, form={self.form}, depth={self.depth}, knots={self.num_knots}, "
            f"basis={self.basis}, integrator={self.integrator.name}, steps={self.steps}, "
            f"backward={self.backward}"
        )


@dataclass
class _Caches:
    """What a stage builds for one (basis, integrator, steps, knot count): graphs, exact rows, mix rows."""

    signature: tuple
    graphs: dict[tuple | str, fx.GraphModule] = field(default_factory=dict)
    rows: dict[tuple[Fraction, bool], tuple[Fraction, ...]] = field(default_factory=dict)
    mix_index: dict[tuple[Fraction, ...], int] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict) -> _Caches:
        return _Caches(None)  # a copied stage rebuilds its own (a GraphModule copy loses attributes)


def _may_draw_random(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return bool(getattr(module, "drop_prob", 0))
