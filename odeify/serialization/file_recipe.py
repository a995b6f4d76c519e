"""The recipe of a converted model: what rebuilds it from a file alone.

A recipe holds the source architecture as a timm (or odeify) name plus JSON build kwargs (never a
path, never the source weights), the input shape and dtype, the source's data config, every
manifestation setting per stage, and the probe: what the model computed on a fixed seeded input
when it was saved (:mod:`odeify.serialization.probe`). ``odeify.save`` writes it next to the
tensors and ``odeify.load`` reads it back; both check it against one schema
(:mod:`odeify.serialization.file_schema`), so what save writes is what load reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import timm
import torch
import torch.fx as fx
from torch import nn

from odeify.compiler.record import META
from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError, ModelLoadError
from odeify.models.data_config import data_config_entries
from odeify.numerics.tableaus import REVERSIBLE_SCHEMES, SPLITTINGS, TABLEAUS, Tableau, resolve_integrator
from odeify.passes.segments import has_segments
from odeify.runtime.stage import ODEStage

__all__ = [
    "DTYPES",
    "FORMAT",
    "FORMAT_VERSION",
    "Recipe",
    "StageRecipe",
    "integrator_of",
    "recipe_of",
    "stage_module",
]

FORMAT = "odeify.converted"
FORMAT_VERSION = 3  # bump when a recipe changes meaning; load refuses newer ones. 2: the probe;
# 3: the probe checks the source network's output where the model keeps its source tensors
READS = (1, 2, 3)  # older versions load where their probe checks all they hold, or with verify=False
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class StageRecipe:
    """One ODE stage's manifestation."""

    name: str
    module: str  # attribute of the stage in the converted model, e.g. 'layer1_ode'
    knots: int
    basis: str
    integrator: str | dict[str, Any]  # a built-in name, or a tableau {name, a, b, order} as exact strings
    steps: int
    backward: str
    checkpoint_every: int
    fitted_steps: tuple[int, ...] | None = None  # the steps its knots were fitted for; None: never fitted
    corrected_steps: tuple[int, ...] | None = None  # the steps it holds a knot correction for; None: none


@dataclass(frozen=True)
class Recipe:
    """Everything ``odeify.load`` needs besides the tensors."""

    arch: dict[str, Any] | None  # {"name": timm/odeify name, "kwargs": {...}}; None: needs load(model=)
    input_shape: tuple[int, ...]
    dtype: str
    stages: tuple[StageRecipe, ...]
    pretrained_cfg: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    whole_model: bool = False  # the parts between the stages are checkpointed segments too
    probe: dict[str, Any] | None = None  # {"seed", "points": [[name, error], ...]}; None in version 1 files
    steps_multiplier: str | None = None  # the whole-model 'x<m>' the stages' steps came from, if one did
    version: int = FORMAT_VERSION

    def to_body(self) -> dict[str, Any]:
        """The recipe as JSON types (lists, not tuples), the format name included."""
        body = {"format": FORMAT, **asdict(self)}
        body["input_shape"] = list(self.input_shape)
        body["pretrained_cfg"] = {
            k: list(v) if isinstance(v, tuple) else v for k, v in self.pretrained_cfg.items()
        }
        if body["probe"] is None:
            del body["probe"]
        if body["steps_multiplier"] is None:  # written only where asked, so other files stay as before
            del body["steps_multiplier"]
        for stage in body["stages"]:  # written only where known, so files of unfitted models stay as before
            for key in ("fitted_steps", "corrected_steps"):
                if stage[key] is None:
                    del stage[key]
                else:
                    stage[key] = list(stage[key])
        return body

    def to_json(self) -> str:
        return json.dumps(self.to_body(), sort_keys=True, allow_nan=False)


def stage_module(stage_name: str) -> str:
    """The attribute of a stage in a converted model: 'layer3' -> 'layer3_ode' (passes.lift's rule)."""
    return stage_name.replace(".", "_") + "_ode"


# ---------------------------------------------------------------------------------------------------
# Writing: at save time, from the conversion record (odeify.compiler.record) and the stages


def recipe_of(model: nn.Module, probe: dict[str, Any] | None = None) -> Recipe:
    """The recipe of a converted model (its current manifestation, head size and dtype)."""
    record = getattr(model, "meta", {}).get(META) if isinstance(model, fx.GraphModule) else None
    stages = [m for m in model.modules() if isinstance(m, ODEStage)] if isinstance(model, nn.Module) else []
    converted = isinstance(record, Mapping) and "input_shape" in record
    if converted and not stages:
        raise ModelLoadError(_no_stage_message(record, record.get("name") or type(model).__name__))
    if not converted:
        what = type(model).__name__
        raise ModelLoadError(
            f"odeify.save takes a model made by odeify.convert/retarget/load; this {what} "
            f"{'has no ODE stages' if not stages else 'carries no conversion record'}. Convert it first: "
            f"odeify.save(odeify.convert(model), path)."
        )
    arch = record.get("arch")
    if arch is not None and hasattr(model, "num_classes"):  # reset_classifier changes the head size
        arch = {"name": arch["name"], "kwargs": {**arch["kwargs"], "num_classes": model.num_classes}}
    attrs = {id(m): name for name, m in model.named_children()}
    dtype = model_dtype(model)
    return Recipe(
        arch=arch,
        input_shape=tuple(record["input_shape"]),
        dtype=str(dtype).removeprefix("torch."),
        stages=tuple(_stage_recipe(stage, attrs.get(id(stage), "")) for stage in stages),
        pretrained_cfg=data_config_entries(getattr(model, "pretrained_cfg", {}) or {}),
        versions={"odeify": odeify_version(), "torch": torch.__version__, "timm": timm.__version__},
        whole_model=has_segments(model),
        probe=probe,
        steps_multiplier=_multiplier_asked(record, stages),
    )


def _no_stage_message(record: Mapping[str, Any], name: str) -> str:
    """Why a converted model without ODE stages has nothing to save, with the reasons convert recorded."""
    reasons = record.get("not_lifted") or {}
    why = " (" + "; ".join(f"{run}: {reason}" for run, reason in reasons.items()) + ")" if reasons else ""
    return (
        f"odeify.save refuses this {name}: it was converted, but no run of its residual blocks could be "
        f"lifted into an ODE stage{why}, so it has no ODE stages and computes what its source does. A file "
        "of it would hold nothing the source does not: use and save the source model itself. To get stages, "
        "change what a reason names, where it says that can be done, and convert again."
    )


def _multiplier_asked(record: Mapping[str, Any], stages: list[ODEStage]) -> str | None:
    """The recorded whole-model depth multiplier, while the stages still run the steps it gave them."""
    multiplier = record.get("steps_multiplier")
    if multiplier is None or multiplier["steps"] != {s.stage_name: s.steps for s in stages}:
        return None
    return str(multiplier["asked"])


def _stage_recipe(stage: Any, module: str) -> StageRecipe:
    integrator = stage.integrator
    named = {**REVERSIBLE_SCHEMES, **SPLITTINGS}
    if not isinstance(integrator, Tableau) and named.get(integrator.name) != integrator:
        raise ConfigError(
            f"stage '{stage.stage_name}' uses the integrator {integrator!r}, which a saved recipe cannot "
            f"name (it records one of {', '.join(named)} or a tableau): retarget it to a "
            "built-in integrator before saving."
        )
    builtin = not isinstance(integrator, Tableau) or TABLEAUS.get(integrator.name) == integrator
    spec: str | dict[str, Any] = (
        integrator.name
        if builtin
        else {
            "name": integrator.name,
            "a": [[str(v) for v in row] for row in integrator.a],
            "b": [str(v) for v in integrator.b],
            "order": integrator.order,
        }
    )
    return StageRecipe(
        name=stage.stage_name,
        module=module,
        knots=stage.num_knots,
        basis=stage.basis,
        integrator=spec,
        steps=stage.steps,
        backward=stage.backward,
        checkpoint_every=getattr(stage, "checkpoint_every", 1),
        fitted_steps=getattr(stage, "fitted_steps", None),
        corrected_steps=stage.corrected_steps or None,
    )


def odeify_version() -> str:
    import odeify

    return str(odeify.__version__)


def integrator_of(spec: str | Mapping[str, Any]) -> Any:
    """The integrator a (validated) stage recipe names."""
    if isinstance(spec, str):
        return resolve_integrator(spec)
    return Tableau.create(spec["name"], spec["a"], spec["b"], order=spec["order"])
