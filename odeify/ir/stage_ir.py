"""The stage IR: one run of residual blocks as the ODE dx/dt = F(t, x) on t in [0, 1], as data.

A :class:`StageIR` holds a *template* of one block (an fx graph taking ``x`` and one tensor per
weight slot), the knots (each slot's per-knot tensors stacked on a leading axis), and the
manifestation (basis, integrator, steps, backward mode), plus the exact basis coefficients the
code generator asks for. It runs nothing: :mod:`odeify.codegen.emit` writes its computation as fx graphs
and :class:`odeify.runtime.stage.ODEStage` (the runtime) executes them.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

import torch
import torch.fx as fx
from torch import nn

from odeify.core.budget import check_graph_nodes
from odeify.core.errors import ConfigError
from odeify.ir.settings import (
    BackwardMode,
    validate_backward,
    validate_checkpoint_every,
    validate_steps,
)
from odeify.numerics.bases import get_basis
from odeify.numerics.tableaus import Integrator, ReversibleHeun, resolve_integrator

CACHE_LOCK = threading.RLock()
"""Serialises building a stage's graphs and rows: two threads running a cold stage must not race.

One lock for all stages (a per-stage lock would not survive ``copy.deepcopy``); it is taken only
while caches are built, never while a built graph runs."""


@dataclass(frozen=True)
class Slot:
    """One tensor input of the block template.

    ``kind`` is ``param`` (trainable knots), ``buffer`` (non-trainable knots, such as NF-ResNet's
    per-block float constants) or ``shared`` (one tensor for all times, e.g. a blur filter).
    """

    name: str
    kind: Literal["param", "buffer", "shared"]


class StageIR(nn.Module):
    """A run of ``depth`` residual blocks as one continuous-in-depth stage: template, knots, settings.

    ``inlined`` is set by the ``lower`` pass while the stage's computation is written into a
    converted model's own graph: that graph no longer calls the stage, so :meth:`configure` then
    refuses (it could not take effect) and points to ``odeify.retarget`` / ``odeify.set_backward``.
    """

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
        self.inlined = False
        self.knots = nn.ParameterDict()
        for slot in self.slots:
            tensor = tensors[slot.name]
            if slot.kind == "param":
                self.knots[slot.name] = nn.Parameter(tensor)
            else:
                self.register_buffer(f"{slot.kind}_{slot.name}", tensor)
        self.variants = nn.ModuleDict({key: nn.ModuleList(mods) for key, mods in (variants or {}).items()})
        self.variant_targets = {key.replace("__", "."): key for key in self.variants}
        self.configure(
            basis=basis, integrator=integrator, steps=steps or depth, backward=backward, checkpoint_every=1
        )

    def standalone(self) -> StageIR:
        """A deep copy of this stage that runs on its own (``stage(x)``) and may be configured freely."""
        twin = copy.deepcopy(self)
        twin.inlined = False
        return twin

    # -- configuration -------------------------------------------------------------------------
    def configure(
        self,
        *,
        basis: str | None = None,
        integrator: str | Integrator | None = None,
        steps: int | None = None,
        backward: BackwardMode | None = None,
        checkpoint_every: int | None = None,
    ) -> StageIR:
        """Set the manifestation: validates every setting first, so a refused call changes nothing.

        ``checkpoint_every=k`` makes ``backward='checkpoint'`` keep every k-th step's state and
        recompute the k - 1 steps between in backward (memory ~ steps/k + k states).
        """
        if self.inlined:
            raise ConfigError(
                f"stage '{self.stage_name}' is inlined into a converted model's graph, so configuring it "
                "in place would change nothing the model runs. Use odeify.retarget(model, ...) for a new "
                "manifestation (a new module) or odeify.set_backward(model, mode) (in place)."
            )
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
            checkpoint_every = validate_checkpoint_every(checkpoint_every, self.stage_name)
        evaluations = 2 if isinstance(new_integrator, ReversibleHeun) else new_integrator.stages
        check_graph_nodes(self.stage_name, new_steps, evaluations, len(self.template.graph.nodes))
        if checkpoint_every is not None:
            self.checkpoint_every = checkpoint_every
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
                return int(self.slot_tensor(slot).shape[0])  # an int under jit.trace too (not a traced size)
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

    def initial_state(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The integrator's state at t = 0: (x,), or reversible Heun's pair (y, z) = (x, x)."""
        return (x, x) if isinstance(self.integrator, ReversibleHeun) else (x,)

    # -- exact time bookkeeping ----------------------------------------------------------------
    def row(self, t: Fraction, left: bool) -> tuple[Fraction, ...]:
        """Basis coefficients over the knots at time ``t`` (left limit when ``left``), exactly."""
        rows = self.caches().rows
        if (t, left) not in rows:
            with CACHE_LOCK:
                rows[t, left] = tuple(get_basis(self.basis).coefficients(self.num_knots, t, left))
        return rows[t, left]

    def field_weights(self, t: Fraction, left: bool) -> tuple[tuple[Fraction, ...], int | None]:
        """What a field evaluation at ``t`` reads besides its input: the knot row, and the per-block
        variant where the blocks' own modules differ (None where they do not).

        Two evaluations of one input with equal ``field_weights`` are one evaluation, unless the
        stage draws random numbers: emit's graphs and the reversible backward share by this rule.
        """
        return self.row(t, left), (self.variant_index(t, left) if self.variants else None)

    def variant_index(self, t: Fraction, left: bool) -> int:
        """The original block whose per-block modules (DropPath rates) serve time ``t``."""
        return get_basis("constant").coefficients(self.depth, t, left).index(1)

    def caches(self) -> StageCaches:
        """The graphs and rows built for the current template, basis, integrator, steps and knot count.

        The template's code is part of the key, so editing the template after a forward (and
        recompiling it, as fx requires) rebuilds the graphs instead of running stale ones.
        """
        signature = (self.template.code, self.basis, self.integrator, self.steps, self.num_knots)
        caches = getattr(self, "_caches", None)
        if caches is None or caches.signature != signature:
            with CACHE_LOCK:
                caches = self._caches = StageCaches(signature)
        return caches

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
class StageCaches:
    """What a stage builds for one signature: graphs (by :mod:`odeify.codegen.emit`) and exact basis rows."""

    signature: tuple | None
    graphs: dict[tuple | str, fx.GraphModule] = field(default_factory=dict)
    rows: dict[tuple[Fraction, bool], tuple[Fraction, ...]] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict) -> StageCaches:
        return StageCaches(None)  # a copied stage rebuilds its own (a GraphModule copy loses attributes)


def _may_draw_random(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return bool(getattr(module, "drop_prob", 0))
