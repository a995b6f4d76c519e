"""``SplitStage``: a run of transformer blocks as one stage of p sub-fields, dx/dt = F_1 + ... + F_p.

A period-p run (a ViT block's attention and MLP halves: p = 2; Swin's unshifted attention, MLP,
shifted attention, MLP: p = 4, each MLP template reshaping the (B, H, W, C) state to tokens and
back) has one template per sub-block and one knot stack per sub-field slot; all p fields share the
stage's knot count, basis and times, so retargeting knots or basis refits every stack alike. Its
integrator is a splitting scheme (:mod:`odeify.numerics.splitting`): ``lie_trotter`` (at native
steps the network itself), ``strang``, or one whose sub-steps are reversible scheme steps
(``alf`` and ``reversible_heun`` mean their Lie-Trotter splittings here; ``strang_alf``,
``strang_reversible_heun``). The code generator writes each sub-step with one writer per
sub-field, through a :class:`FieldView` (a sub-field seen as a one-field stage). Checkpoint and
reverse backward run the split step graphs like any stage's; ``reversible`` runs a reversible
splitting's register program on the lattice (:mod:`odeify.runtime.reversible`).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn

from odeify.core.budget import check_graph_nodes
from odeify.core.errors import ConfigError
from odeify.ir.settings import (
    StageSettings,
    validate_backward,
    validate_checkpoint_every,
    validate_midpoints,
    validate_steps,
)
from odeify.ir.stage_ir import Slot, may_draw_random, template_inputs
from odeify.numerics.bases import get_basis
from odeify.numerics.tableaus import (
    REVERSIBLE_SCHEMES,
    SPLITTINGS,
    TABLEAUS,
    ReversibleScheme,
    Splitting,
    Tableau,
)
from odeify.runtime.stage import ODEStage

BlockForm = Literal["post", "pre"]


class FieldView:
    """One sub-field of a split stage as the code generator reads a stage: template, slots, times.

    A view: the tensors and modules stay the split stage's (``template_attr`` and the slots'
    attribute paths point into it), so a writer with the split stage's prefix emits them correctly.
    """

    def __init__(self, stage: SplitStage, index: int) -> None:
        start = sum(stage.field_sizes[:index])
        self.stage = stage
        self.stage_name = stage.stage_name
        self.template = stage.field_templates[index]
        self.template_attr = f"field_templates.{index}"
        self.slots = stage.slots[start : start + stage.field_sizes[index]]
        self.variant_targets = stage.field_variant_targets[index]
        self.variants = {key: stage.variants[key] for key in self.variant_targets.values()}
        self.form = stage.field_forms[index]
        self.depth = stage.depth
        self.steps = stage.steps
        self.num_knots = stage.num_knots
        self.draws_random = stage.draws_random

    def row(self, t: Fraction, left: bool) -> tuple[Fraction, ...]:
        return self.stage.row(t, left)

    def variant_index(self, t: Fraction, left: bool) -> int:
        return self.stage.variant_index(t, left)

    def field_weights(self, t: Fraction, left: bool) -> tuple[tuple[Fraction, ...], int | None]:
        return self.row(t, left), (self.variant_index(t, left) if self.variants else None)

    def slot_attr(self, slot: Slot) -> str:
        return self.stage.slot_attr(slot)


class SplitStage(ODEStage):
    """A run of ``depth`` periods of p residual sub-blocks as one stage of p sub-fields.

    ``templates[i]``, ``slots[i]``, ``tensors[i]`` and ``variants[i]`` are sub-field i's, as lifting
    extracts a period-1 run's; slot names and variant keys clashing between fields get an ``F<i>_``
    prefix. ``integrator='euler'`` (convert's default) means ``lie_trotter``: one Euler sub-step per
    sub-field, the network at native steps; ``alf`` and ``reversible_heun`` mean
    ``lie_trotter_alf`` and ``lie_trotter_reversible_heun``; other tableaus are refused.
    """

    def __init__(
        self,
        name: str,
        templates: Sequence[fx.GraphModule],
        slots: Sequence[Sequence[Slot]],
        tensors: Sequence[dict[str, torch.Tensor]],
        variants: Sequence[dict[str, list[nn.Module]]],
        forms: Sequence[BlockForm],
        depth: int,
        **settings: Any,
    ) -> None:
        all_slots: list[Slot] = []
        all_tensors: dict[str, torch.Tensor] = {}
        all_variants: dict[str, list[nn.Module]] = {}
        targets: list[dict[str, str]] = []
        for i, (field_slots, field_tensors, field_variants) in enumerate(
            zip(slots, tensors, variants, strict=True)
        ):
            for slot in field_slots:
                unique = _unique(slot.name, all_tensors, i)
                all_slots.append(Slot(unique, slot.kind))
                all_tensors[unique] = field_tensors[slot.name]
            field_targets = {}
            for key, modules in field_variants.items():
                unique = _unique(key, all_variants, i)
                all_variants[unique] = modules
                field_targets[key.replace("__", ".")] = unique
            targets.append(field_targets)
        # plain attributes read by _validated, which StageIR.__init__ calls
        self.field_sizes = tuple(len(s) for s in slots)
        self.field_forms = tuple(forms)
        self.field_variant_targets = tuple(targets)
        self.field_nodes = tuple(len(t.graph.nodes) for t in templates)
        super().__init__(
            name, templates[0], all_slots, all_tensors, forms[0], depth, all_variants, **settings
        )
        self.field_templates = nn.ModuleList(templates)
        if self.backward == "reversible":  # _validated ran before the templates were attributes
            self._refuse_random_glue()

    @property
    def num_fields(self) -> int:
        return len(self.field_sizes)

    def field_views(self) -> list[FieldView]:
        """Each sub-field as the code generator reads a stage (see :class:`FieldView`)."""
        return [FieldView(self, i) for i in range(self.num_fields)]

    def _validated(self, wanted: StageSettings) -> StageSettings:
        """``wanted`` checked for a split stage: a splitting scheme (``euler``, ``alf`` and
        ``reversible_heun`` read as their Lie-Trotter splittings)."""
        name = self.stage_name
        integrator = wanted.integrator
        if isinstance(integrator, Tableau) and integrator == TABLEAUS["euler"]:
            integrator = SPLITTINGS["lie_trotter"]
        if isinstance(integrator, ReversibleScheme) and REVERSIBLE_SCHEMES.get(integrator.name) == integrator:
            integrator = SPLITTINGS[f"lie_trotter_{integrator.name}"]
        if not isinstance(integrator, Splitting):
            fields = " + ".join(f"F_{i + 1}" for i in range(self.num_fields))
            raise ConfigError(
                f"stage '{name}' is a split stage (dx/dt = {fields}, one sub-field per sub-block of "
                f"each transformer block), and integrator='{integrator.name}' would integrate the "
                "summed field, which is not the network at native steps and is not built for split "
                f"stages. Use one of {', '.join(SPLITTINGS)} ('lie_trotter' is the network at native "
                "steps, 'strang' is second order, the '_alf' and '_reversible_heun' ones run "
                "backward='reversible'; 'euler', 'alf' and 'reversible_heun' mean their 'lie_trotter' "
                "splittings here)."
            )
        settings = StageSettings(
            get_basis(wanted.basis).name,
            integrator,
            validate_steps(wanted.steps, name),
            validate_backward(wanted.backward, integrator),
            validate_checkpoint_every(wanted.checkpoint_every, name),
        )
        if integrator.reversible:
            evaluations = integrator.scheme(self.num_fields).evals_per_step
            knots, fields = self.num_knots, self.num_fields
            validate_midpoints(integrator, settings.basis, knots, settings.steps, name, fields)
        else:
            evaluations = len(integrator.substeps(self.num_fields)) * TABLEAUS[integrator.substep].stages
        if settings.backward == "reversible" and hasattr(self, "field_templates"):
            self._refuse_random_glue()
        check_graph_nodes(name, settings.steps, evaluations, max(self.field_nodes))
        return settings

    def _refuse_random_glue(self) -> None:
        """Refuse glue (the reshapes between sub-blocks that a sub-field holds) that draws random numbers."""
        found = _random_glue(self.field_templates)
        if found is not None:
            field, node = found
            raise ConfigError(
                f"stage '{self.stage_name}': sub-field F_{field + 1} holds glue '{node}' between its "
                "sub-blocks that may draw random numbers, and backward='reversible' is built and tested "
                "for the draws of the sub-blocks themselves only (DropPath, dropout, replayed in "
                "backward). Use backward='checkpoint' (exact gradients, memory ~ steps/k + k states), "
                "or set that dropout's rate to 0."
            )

    def reversible_scheme(self) -> ReversibleScheme | None:
        """A reversible splitting's register program over this stage's fields, else None."""
        integrator = self.integrator
        reversible = isinstance(integrator, Splitting) and integrator.reversible
        return integrator.scheme(self.num_fields) if reversible else None

    @property
    def draws_random(self) -> bool:
        return any(may_draw_random(m) for t in [*self.field_templates, self.variants] for m in t.modules())

    @property
    def inputs(self) -> tuple[str, ...]:
        """Every sub-field's constant inputs, each once, in field order."""
        names = (template_inputs(view.template, len(view.slots)) for view in self.field_views())
        return tuple(dict.fromkeys(name for field in names for name in field))

    def graph_signature(self) -> tuple:
        return (*super().graph_signature(), *(t.code for t in self.field_templates))

    def extra_repr(self) -> str:
        return f"fields={self.num_fields}, " + super().extra_repr()


_RANDOM_FUNCTIONS = (
    torch.nn.functional.dropout,
    torch.nn.functional.dropout1d,
    torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d,
    torch.nn.functional.alpha_dropout,
    torch.dropout,
    torch.rand,
    torch.randn,
    torch.rand_like,
    torch.randn_like,
    torch.bernoulli,
)
"""Functions a glue node may call that draw random numbers (a module's draws: ``may_draw_random``)."""


def _random_glue(templates: Sequence[fx.GraphModule]) -> tuple[int, str] | None:
    """The first glue node (named ``glue_*``) that may draw random numbers, as (field, node name)."""
    for i, template in enumerate(templates):
        modules = dict(template.named_modules())
        for node in template.graph.nodes:
            if node.name.startswith("glue_") and (
                (node.op == "call_module" and may_draw_random(modules[node.target]))
                or (node.op == "call_function" and node.target in _RANDOM_FUNCTIONS)
            ):
                return i, node.name
    return None


def _unique(name: str, taken: dict, field: int) -> str:
    """``name``, or ``F<field + 1>_name`` (then with a counter) where another field has it."""
    candidate, count = name, 0
    while candidate in taken:
        count += 1
        candidate = f"F{field + 1}_{name}" if count == 1 else f"F{field + 1}_{name}_{count}"
    return candidate
