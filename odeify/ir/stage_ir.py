"""The stage IR: one run of residual blocks as the ODE dx/dt = F(t, x) on t in [0, 1], as data.

A :class:`StageIR` holds a *template* of one block (an fx graph taking ``x`` and one tensor per
weight slot), the knots (each slot's per-knot tensors stacked on a leading axis), and the
manifestation (one frozen :class:`~odeify.ir.settings.StageSettings`: basis, integrator, steps,
backward mode), plus the exact basis coefficients the code generator asks for. It runs nothing and
caches nothing: :mod:`odeify.codegen.emit` writes (and caches) its computation as fx graphs and
:class:`odeify.runtime.stage.ODEStage` (the runtime) executes them.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Literal

import torch
import torch.fx as fx
from torch import nn

from odeify.core.budget import check_graph_nodes
from odeify.core.errors import ConfigError
from odeify.ir.settings import (
    BackwardMode,
    StageSettings,
    validate_backward,
    validate_checkpoint_every,
    validate_midpoints,
    validate_steps,
)
from odeify.numerics.bases import get_basis
from odeify.numerics.tableaus import Integrator, ReversibleScheme, Splitting, resolve_integrator

CORRECTION_PREFIX = "steps_"
"""A correction's key in :attr:`StageIR.corrections`: ``steps_<n>``, the step count it is read at."""


def _setting(name: str, doc: str) -> property:
    """A read-only view of one field of a stage's ``settings`` (change them with ``configure``)."""
    return property(lambda stage: getattr(stage.settings, name), doc=doc)


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

    template_attr = "template"
    """Where the block template sits in this module (the code generator calls its modules there)."""

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
        self.fitted_steps: tuple[int, ...] | None = None
        """The step counts this stage's knots were fitted for (by calibration or fine-tuning at those
        depths), or None: never fitted, the knots are the blocks' own or a least-squares weight path."""
        self.corrections = nn.ModuleDict()
        """Per-depth corrections of the knots: ``steps_<n>`` -> one tensor per trainable slot, added to
        the knots while the stage runs ``n`` steps (see :meth:`knot_tensors`)."""
        self.knots = nn.ParameterDict()
        for slot in self.slots:
            tensor = tensors[slot.name]
            if slot.kind == "param":
                self.knots[slot.name] = nn.Parameter(tensor)
            else:
                self.register_buffer(f"{slot.kind}_{slot.name}", tensor)
        self.variants = nn.ModuleDict({key: nn.ModuleList(mods) for key, mods in (variants or {}).items()})
        self.variant_targets = {key.replace("__", "."): key for key in self.variants}
        self._generation = 0  # bumped when Module._apply replaces tensors: built graphs hold them
        wanted = StageSettings(basis, resolve_integrator(integrator), steps or depth, backward)
        self.settings = self._validated(wanted)

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
        old = self.settings
        self.settings = self._validated(
            StageSettings(
                old.basis if basis is None else basis,
                old.integrator if integrator is None else resolve_integrator(integrator),
                old.steps if steps is None else steps,
                old.backward if backward is None else backward,
                old.checkpoint_every if checkpoint_every is None else checkpoint_every,
            )
        )
        return self

    def _validated(self, wanted: StageSettings) -> StageSettings:
        """``wanted`` with every entry checked (names resolved), or a ConfigError naming the fix."""
        name = self.stage_name
        if isinstance(wanted.integrator, Splitting):
            raise ConfigError(
                f"integrator='{wanted.integrator.name}' splits a stage's field into the sub-fields of a "
                f"transformer block (attention, MLP), but stage '{name}' is one residual block per step: "
                "give it a tableau such as 'euler', 'heun' or 'rk4'."
            )
        settings = StageSettings(
            get_basis(wanted.basis).name,
            wanted.integrator,
            validate_steps(wanted.steps, name),
            validate_backward(wanted.backward, wanted.integrator),
            validate_checkpoint_every(wanted.checkpoint_every, name),
        )
        integrator = settings.integrator
        check_graph_nodes(name, settings.steps, integrator.evals_per_step, len(self.template.graph.nodes))
        validate_midpoints(integrator, settings.basis, self.num_knots, settings.steps, name)
        return settings

    basis = _setting("basis", "The weight path's basis, by name.")
    integrator = _setting("integrator", "The integrator: a Tableau or a reversible scheme.")
    steps = _setting("steps", "Integration steps over t in [0, 1].")
    backward = _setting("backward", "The backward mode.")
    checkpoint_every = _setting("checkpoint_every", "backward='checkpoint' keeps every k-th step's state.")

    @property
    def draws_random(self) -> bool:
        """Whether a block evaluation may draw random numbers (DropPath, dropout) in train mode."""
        return any(may_draw_random(m) for m in [*self.template.modules(), *self.variants.modules()])

    @property
    def inputs(self) -> tuple[str, ...]:
        """The names of the stage's constant inputs, which it takes after ``x`` (``stage(x, *inputs)``):
        values every block of its run read alike from outside it (a rotary ViT's position table)."""
        return template_inputs(self.template, len(self.slots))

    @property
    def num_knots(self) -> int:
        for slot in self.slots:
            if slot.kind != "shared":
                return static_size(self.slot_tensor(slot))
        return self.depth

    def slot_tensor(self, slot: Slot) -> torch.Tensor:
        if slot.kind == "param":
            return self.knots[slot.name]
        return getattr(self, f"{slot.kind}_{slot.name}")

    def slot_attr(self, slot: Slot) -> str:
        """The attribute path of a slot's tensor, relative to this module."""
        return f"knots.{slot.name}" if slot.kind == "param" else f"{slot.kind}_{slot.name}"

    def knot_tensors(self) -> list[torch.Tensor]:
        """Every time-dependent tensor, in slot order: the inputs the step graphs take.

        At a step count with a correction (:meth:`correction`) a trainable slot reads its knots plus
        the correction, the knots detached: that depth's gradient trains its correction alone, so
        training it leaves every other depth's weights as they were."""
        correction = self.correction()
        return [
            self.slot_tensor(s).detach() + correction[s.name]
            if correction is not None and s.name in correction
            else self.slot_tensor(s)
            for s in self.slots
            if s.kind != "shared"
        ]

    # -- per-depth corrections -----------------------------------------------------------------
    @property
    def corrected_steps(self) -> tuple[int, ...]:
        """The step counts this stage holds a knot correction for, in increasing order."""
        return tuple(sorted(int(key.removeprefix(CORRECTION_PREFIX)) for key in self.corrections))

    def correction(self, steps: int | None = None) -> nn.ParameterDict | None:
        """The correction read at ``steps`` (default: the stage's own step count), or None."""
        key = f"{CORRECTION_PREFIX}{self.steps if steps is None else steps}"
        return self.corrections[key] if key in self.corrections else None  # type: ignore[return-value]

    def set_correction(self, steps: int, tensors: dict[str, torch.Tensor]) -> None:
        """Hold ``tensors`` (one per trainable slot, each its knot stack's shape) as the correction
        read at ``steps``; replaces one held there."""
        if steps == self.depth:
            raise ConfigError(
                f"stage '{self.stage_name}': native depth ({steps} steps) reads the knots themselves; a "
                "correction is for another depth."
            )
        names = [s.name for s in self.slots if s.kind == "param"]
        if sorted(tensors) != sorted(names):
            raise ConfigError(
                f"stage '{self.stage_name}': a correction has one tensor per trainable slot "
                f"({', '.join(names)}), got {', '.join(sorted(tensors)) or 'none'}."
            )
        for name in names:
            if tensors[name].shape != self.knots[name].shape:
                raise ConfigError(
                    f"stage '{self.stage_name}': the correction of {name} has shape "
                    f"{tuple(tensors[name].shape)}, its knots {tuple(self.knots[name].shape)}."
                )
        self.corrections[f"{CORRECTION_PREFIX}{steps}"] = nn.ParameterDict(
            {
                name: nn.Parameter(tensors[name], requires_grad=self.knots[name].requires_grad)
                for name in names
            }
        )

    def hold_zero_correction(self, steps: int) -> None:
        """Hold a correction of zeros at ``steps`` (to be trained, or loaded into)."""
        self.set_correction(steps, {name: torch.zeros_like(knots) for name, knots in self.knots.items()})

    def correction_attr(self, slot: Slot) -> str:
        """The attribute path, relative to this module, of ``slot``'s correction at the stage's steps."""
        return f"corrections.{CORRECTION_PREFIX}{self.steps}.{slot.name}"

    def drop_corrections(self) -> None:
        """Forget every correction (the knots change meaning: refitted, or the source's again)."""
        self.corrections = nn.ModuleDict()

    def weight_parameters(self) -> list[nn.Parameter]:
        """The trainable tensors the knot inputs come from: the knots and every correction."""
        return [*self.knots.values(), *(p for c in self.corrections.values() for p in c.parameters())]

    def reversible_scheme(self) -> ReversibleScheme | None:
        """The register program of a reversible integrator (the integrator itself here), else None."""
        return self.integrator if isinstance(self.integrator, ReversibleScheme) else None

    @property
    def state_starts(self) -> tuple[Literal["input", "zero"], ...]:
        """Where each component of the integrator's state starts: (x,) for a tableau, a reversible
        scheme's registers at x or 0 (reversible Heun's (y, z) both at x, ALF's (z, v) at (x, 0))."""
        scheme = self.reversible_scheme()
        return ("input",) if scheme is None else tuple(r.start for r in scheme.registers)

    def initial_state(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The integrator's state at t = 0 (see :attr:`state_starts`)."""
        return tuple(x if start == "input" else torch.zeros_like(x) for start in self.state_starts)

    # -- exact time bookkeeping ----------------------------------------------------------------
    def row(self, t: Fraction, left: bool) -> tuple[Fraction, ...]:
        """Basis coefficients over the knots at time ``t`` (left limit when ``left``), exactly."""
        return _row(self.basis, self.num_knots, t, left)

    def field_weights(self, t: Fraction, left: bool) -> tuple[tuple[Fraction, ...], int | None]:
        """What a field evaluation at ``t`` reads besides its input: the knot row, and the per-block
        variant where the blocks' own modules differ (None where they do not).

        Two evaluations of one input with equal ``field_weights`` are one evaluation, unless the
        stage draws random numbers: emit's graphs and the reversible backward share by this rule.
        """
        return self.row(t, left), (self.variant_index(t, left) if self.variants else None)

    def variant_index(self, t: Fraction, left: bool) -> int:
        """The original block whose per-block modules (DropPath rates) serve time ``t``."""
        return _row("constant", self.depth, t, left).index(1)

    def graph_signature(self) -> tuple:
        """What a built graph of this stage depends on besides its inputs (emit's cache key).

        The template's code is part of it, so editing the template after a forward (and
        recompiling it, as fx requires) rebuilds the graphs instead of running stale ones.
        """
        settings = self.settings
        return (
            self.template.code,
            settings.basis,
            settings.integrator,
            settings.steps,
            self.num_knots,
            self._generation,
        )

    def _apply(self, fn, *args, **kwargs):
        self._generation += 1  # built graphs hold references to modules and buffers that .to() replaces
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"name={self.stage_name!r}, form={self.form}, depth={self.depth}, knots={self.num_knots}, "
            f"basis={self.basis}, integrator={self.integrator.name}, steps={self.steps}, "
            f"backward={self.backward}"
        )


@lru_cache(maxsize=65536)
def template_inputs(template: fx.GraphModule, num_slots: int) -> tuple[str, ...]:
    """A block template's constant inputs: its placeholders between ``x`` (the first) and its
    ``num_slots`` slots (the last), as lifting orders them."""
    names = [node.name for node in template.graph.nodes if node.op == "placeholder"]
    return tuple(names[1 : len(names) - num_slots])


def _row(basis: str, knots: int, t: Fraction, left: bool) -> tuple[Fraction, ...]:
    """Exact basis coefficients, computed once per (basis, knot count, time, side) in the process."""
    return tuple(get_basis(basis).coefficients(knots, t, left))


def may_draw_random(module: nn.Module) -> bool:
    """Whether ``module`` draws random numbers in train mode (dropout with p > 0, DropPath)."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return bool(getattr(module, "drop_prob", 0))


def static_size(tensor: torch.Tensor) -> int:
    """``tensor``'s leading size as an int. A knot stack's size is fixed when the graph is built, so
    under ``torch.jit.trace`` (where a size is a traced value) its conversion is right: the tracer's
    warning that it might not be is silenced there, and only there (warning filters are global)."""
    if not torch.jit.is_tracing():
        return tensor.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return int(tensor.shape[0])
