"""The recipe of a converted model: what rebuilds it from a file alone, and its schema.

A recipe holds the source architecture as a timm (or odeify) name plus JSON build kwargs (never a
path, never the source weights), the input shape and dtype, the source's data config, and every
manifestation setting per stage; ``odeify.save`` writes it next to the tensors and ``odeify.load``
reads it back. A file is data from anywhere, so :func:`parse_recipe` validates it against the schema
(known keys, types, ranges, format version) before anything acts on it, with bounds on every number
so a few hundred bytes cannot ask for a huge build.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import timm
import torch
import torch.fx as fx
from torch import nn

from odeify.compiler.record import META
from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError, ModelLoadError
from odeify.ir.settings import BACKWARD_MODES
from odeify.models.archs import DATA_CONFIG_KEYS, check_arch_name, check_file_kwargs
from odeify.numerics.bases import BASES, MAX_KNOTS
from odeify.numerics.tableaus import (
    KNOWN_INTEGRATORS,
    REVERSIBLE_SCHEMES,
    TABLEAUS,
    Tableau,
    resolve_integrator,
)
from odeify.passes.segments import has_segments
from odeify.runtime.stage import ODEStage

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Recipe",
    "StageRecipe",
    "parse_recipe",
    "recipe_of",
]

FORMAT = "odeify.converted"
FORMAT_VERSION = 1  # bump when a recipe changes meaning; load refuses newer ones
MAX_RECIPE_BYTES = 256 * 1024
MAX_STAGES = 64
MAX_STEPS = 100_000  # the graph-size budget (odeify.core.budget) bounds the work further, per stage
MAX_TABLEAU_STAGES = 16
MAX_TABLEAU_ORDER = 8  # the order conditions to check grow fast with the order
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_RATIONAL = re.compile(r"-?\d{1,20}(/\d{1,20})?")  # how Fraction prints; no exponents, no huge numbers
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,99}")


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

    def to_json(self) -> str:
        body = {"format": FORMAT, "version": FORMAT_VERSION, **asdict(self)}
        body["input_shape"] = list(self.input_shape)
        return json.dumps(body, sort_keys=True)


# ---------------------------------------------------------------------------------------------------
# Writing: at save time, from the conversion record (odeify.compiler.record) and the stages


def recipe_of(model: nn.Module) -> Recipe:
    """The recipe of a converted model (its current manifestation, head size and dtype)."""
    record = getattr(model, "meta", {}).get(META) if isinstance(model, fx.GraphModule) else None
    stages = [m for m in model.modules() if isinstance(m, ODEStage)] if isinstance(model, nn.Module) else []
    if not isinstance(record, Mapping) or "input_shape" not in record or not stages:
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
        pretrained_cfg=_data_cfg(getattr(model, "pretrained_cfg", {}) or {}),
        versions={"odeify": _odeify_version(), "torch": torch.__version__, "timm": timm.__version__},
        whole_model=has_segments(model),
    )


def _stage_recipe(stage: Any, module: str) -> StageRecipe:
    integrator = stage.integrator
    if not isinstance(integrator, Tableau) and REVERSIBLE_SCHEMES.get(integrator.name) != integrator:
        raise ConfigError(
            f"stage '{stage.stage_name}' uses the integrator {integrator!r}, which a saved recipe cannot "
            f"name (it records one of {', '.join(REVERSIBLE_SCHEMES)} or a tableau): retarget it to a "
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
    )


def _odeify_version() -> str:
    import odeify

    return str(odeify.__version__)


# ---------------------------------------------------------------------------------------------------
# Reading: the schema


class _Bad(ModelLoadError):
    pass


def parse_recipe(text: str, where: str) -> Recipe:
    """Validate a recipe's JSON text against the schema; one ModelLoadError names the first problem."""
    if not isinstance(text, str) or len(text) > MAX_RECIPE_BYTES:
        raise ModelLoadError(f"{where}: the recipe is not a string of at most {MAX_RECIPE_BYTES} bytes")
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"{where}: the recipe is not valid JSON ({exc})") from None
    _expect(isinstance(body, dict), where, "the recipe must be a JSON object")
    version = body.get("version")
    if body.get("format") != FORMAT or not _is_int(version):
        raise ModelLoadError(
            f"{where}: the recipe has no format version: it was written by an older odeify (before "
            f"self-contained files), which recorded a path to the source checkpoint. Convert the source "
            f"again and save it with this odeify."
        )
    if version > FORMAT_VERSION:
        raise ModelLoadError(
            f"{where}: written by a newer odeify (format version {version}; this odeify "
            f"{_odeify_version()} reads up to {FORMAT_VERSION}). Upgrade odeify: pip install -U odeify"
        )
    _expect(version == FORMAT_VERSION, where, f"unknown format version {version}")
    known = {"format", "version", *(f.name for f in fields(Recipe))}
    extra = sorted(set(body) - known)
    _expect(not extra, where, f"unknown recipe keys {extra[:5]}")
    return Recipe(
        arch=_arch(body.get("arch"), where),
        input_shape=_input_shape(body.get("input_shape"), where),
        dtype=_choice(body.get("dtype"), DTYPES, where, "dtype"),
        stages=_stages(body.get("stages"), where),
        pretrained_cfg=_pretrained_cfg(body.get("pretrained_cfg", {}), where),
        versions=_versions(body.get("versions", {}), where),
        whole_model=_flag(body.get("whole_model", False), where, "whole_model"),
    )


def _flag(value: object, where: str, what: str) -> bool:
    _expect(isinstance(value, bool), where, f"{what} must be true or false, not {value!r}")
    return value  # type: ignore[return-value]


def _expect(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise _Bad(f"{where}: {message}; the file is damaged or was not written by odeify.save")


def _is_int(value: object, lo: int = 0, hi: int = 2**31) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _choice(value: object, options: Sequence[str] | Mapping[str, Any], where: str, what: str) -> str:
    _expect(isinstance(value, str) and value in options, where, f"{what} must be one of {sorted(options)}")
    return value  # type: ignore[return-value]


def _arch(value: object, where: str) -> dict[str, Any] | None:
    if value is None:
        return None
    _expect(
        isinstance(value, dict) and set(value) == {"name", "kwargs"}, where, "arch must be {name, kwargs}"
    )
    name = check_arch_name(value["name"], f"{where} (arch)")
    return {"name": name, "kwargs": check_file_kwargs(value["kwargs"], f"{where} (arch kwargs)")}


def _input_shape(value: object, where: str) -> tuple[int, ...]:
    ok = isinstance(value, list) and len(value) == 4 and _is_int(value[0], 1, 64)
    ok = ok and all(_is_int(v, 1, 4096) for v in value[1:])  # type: ignore[index]
    _expect(ok, where, "input_shape must be [N, C, H, W] with N <= 64 and C, H, W <= 4096")
    return tuple(value)  # type: ignore[arg-type]


def _stages(value: object, where: str) -> tuple[StageRecipe, ...]:
    _expect(isinstance(value, list) and 1 <= len(value) <= MAX_STAGES, where, f"stages: 1 to {MAX_STAGES}")
    keys = {f.name for f in StageRecipe.__dataclass_fields__.values()}
    stages = []
    for i, entry in enumerate(value):  # type: ignore[arg-type]
        at = f"{where} (stage {i})"
        _expect(isinstance(entry, dict) and set(entry) == keys, at, f"a stage has the keys {sorted(keys)}")
        for key in ("name", "module"):
            ok = isinstance(entry[key], str) and bool(_NAME.fullmatch(entry[key]))
            _expect(ok, at, f"a stage {key} is a Python name like 'layer1' or 'layer1_ode'")
        _expect(_is_int(entry["knots"], 1, MAX_KNOTS), at, f"knots must be an integer in [1, {MAX_KNOTS}]")
        _expect(_is_int(entry["steps"], 1, MAX_STEPS), at, f"steps must be an integer in [1, {MAX_STEPS}]")
        _expect(_is_int(entry["checkpoint_every"], 1, entry["steps"]), at, "checkpoint_every in [1, steps]")
        _choice(entry["basis"], BASES, at, "basis")
        _choice(entry["backward"], BACKWARD_MODES, at, "backward")
        _integrator(entry["integrator"], at)
        stages.append(StageRecipe(**entry))
    return tuple(stages)


def _integrator(value: object, where: str) -> None:
    """A built-in name, or a small tableau of exact rational strings (checked before any parsing)."""
    if isinstance(value, str):
        _choice(value, KNOWN_INTEGRATORS, where, "integrator")
        return
    _expect(isinstance(value, dict) and set(value) == {"name", "a", "b", "order"}, where, "integrator keys")
    b, a = value["b"], value["a"]  # type: ignore[index]
    s = len(b) if isinstance(b, list) else 0
    _expect(1 <= s <= MAX_TABLEAU_STAGES, where, f"a tableau has 1 to {MAX_TABLEAU_STAGES} stages")
    square = isinstance(a, list) and len(a) == s and all(isinstance(r, list) and len(r) == s for r in a)
    _expect(square, where, "a tableau's a is an s x s list of lists")
    entries = [*b, *(v for row in a for v in row)]
    exact = all(isinstance(v, str) and _RATIONAL.fullmatch(v) for v in entries)
    _expect(exact, where, "tableau entries must be exact rationals like '2/3' (at most 20 digits each)")
    name, order = value["name"], value["order"]  # type: ignore[index]
    _expect(isinstance(name, str) and 0 < len(name) <= 64, where, "a tableau name has 1 to 64 characters")
    _expect(_is_int(order, 1, MAX_TABLEAU_ORDER), where, f"a tableau order is in [1, {MAX_TABLEAU_ORDER}]")


def integrator_of(spec: str | Mapping[str, Any]) -> Any:
    """The integrator a (validated) stage recipe names."""
    if isinstance(spec, str):
        return resolve_integrator(spec)
    return Tableau.create(spec["name"], spec["a"], spec["b"], order=spec["order"])


_DATA_KEYS: dict[str, type] = {"architecture": str, **DATA_CONFIG_KEYS}


def _data_cfg(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-able data-config entries of a pretrained_cfg (what timm.data reads), as JSON types."""
    out: dict[str, Any] = {}
    for key, kind in _DATA_KEYS.items():
        value = cfg.get(key)
        if isinstance(value, tuple):
            value = list(value)
        if kind is float and _is_int(value, -(2**31)):
            value = float(value)  # type: ignore[arg-type]
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            out[key] = value
    return out


def _pretrained_cfg(value: object, where: str) -> dict[str, Any]:
    _expect(isinstance(value, dict), where, "pretrained_cfg must be an object")
    extra = sorted(set(value) - set(_DATA_KEYS))  # type: ignore[arg-type]
    _expect(not extra, where, f"unknown pretrained_cfg keys {extra[:5]}")
    cfg = _data_cfg(value)  # type: ignore[arg-type]
    short = len(cfg) == len(value) and len(json.dumps(cfg)) <= 4096  # type: ignore[arg-type]
    _expect(short, where, "pretrained_cfg values must have the types timm uses, 4 KiB in all")
    for key in ("input_size", "test_input_size", "min_input_size", "pool_size", "mean", "std"):
        if key in cfg:
            ok = len(cfg[key]) <= 4 and all(_is_number(v) for v in cfg[key])
            _expect(ok, where, f"pretrained_cfg {key} must be a short list of numbers")
            cfg[key] = tuple(cfg[key])
    return cfg


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _versions(value: object, where: str) -> dict[str, str]:
    ok = isinstance(value, dict) and set(value) <= {"odeify", "torch", "timm"}
    ok = ok and all(isinstance(v, str) and len(v) <= 64 for v in value.values())  # type: ignore[union-attr]
    _expect(ok, where, "versions must map odeify/torch/timm to short strings")
    return dict(value)  # type: ignore[arg-type]
