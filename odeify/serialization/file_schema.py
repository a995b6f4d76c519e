"""The schema of a saved model's recipe, applied on both sides: ``load`` reads what ``save`` checked.

A file is data from anywhere, so :func:`parse_recipe` validates its recipe (known keys, types,
ranges, format version, names) before anything acts on it, with bounds on every number
(:mod:`odeify.core.limits`) so a few hundred bytes cannot ask for a huge build. ``odeify.save`` runs
the same :func:`validate_recipe` on the recipe it is about to write and refuses, with the same
words, a model that load would refuse.

Names become code: a stage, module or tableau name is printed in ``odeify inspect --code`` listings
and tables, so each must be a Python identifier (a stage name: identifiers joined by dots, as a
module path).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from odeify.core.errors import ConfigError, ModelLoadError
from odeify.core.fileio import read_json
from odeify.core.limits import (
    MAX_BATCH,
    MAX_IN_CHANS,
    MAX_NAME,
    MAX_RECIPE_BYTES,
    MAX_SIDE,
    MAX_STAGES,
    MAX_STEPS,
    MAX_TABLEAU_DIGITS,
    MAX_TABLEAU_ORDER,
    MAX_TABLEAU_STAGES,
)
from odeify.ir.settings import BACKWARD_MODES, parse_steps
from odeify.models.archs import check_arch_name, check_file_kwargs
from odeify.models.data_config import check_data_config
from odeify.numerics.bases import BASES, MAX_KNOTS
from odeify.numerics.tableaus import KNOWN_INTEGRATORS
from odeify.serialization.file_recipe import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    READS,
    Recipe,
    StageRecipe,
    stage_module,
)

__all__ = ["PROBE_OUTPUT", "PROBE_SOURCE", "RecipeError", "parse_recipe", "validate_recipe"]

PROBE_OUTPUT = "output"  # the probe point of the whole model's output (the others are stage names)
PROBE_SOURCE = "source:output"  # its source network's output (format 3; no stage name has a ':')
_DIGITS = MAX_TABLEAU_DIGITS
MAX_FITTED_DEPTHS = 16  # depths one file is fitted for: a few (native, x0.5, x0.25), not a sweep
_RATIONAL = re.compile(rf"-?\d{{1,{_DIGITS}}}(/\d{{1,{_DIGITS}}})?")  # how Fraction prints; no exponents
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STAGE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
_LOADING = "the file is damaged or was not written by odeify.save"


class RecipeError(ModelLoadError):
    """A recipe breaks the schema; ``problem`` says how, without saying where it was found.

    ``whole``: the problem says what to do itself (a newer or older format), so a reader adds no
    guess about damage.
    """

    def __init__(self, problem: str, whole: bool = False) -> None:
        super().__init__(problem)
        self.problem, self.whole = problem, whole


def parse_recipe(text: object, where: str) -> Recipe:
    """Validate a recipe's JSON text against the schema; one ModelLoadError names the first problem."""
    body = read_json(text, where, ModelLoadError, MAX_RECIPE_BYTES, "the recipe")
    try:
        return validate_recipe(body)
    except RecipeError as exc:
        raise ModelLoadError(f"{where}: {exc.problem}" + ("" if exc.whole else f"; {_LOADING}")) from None


def validate_recipe(body: object) -> Recipe:
    """The Recipe ``body`` (parsed JSON) describes; RecipeError names the first rule it breaks."""
    _expect(isinstance(body, dict), "the recipe must be a JSON object")
    version = _version(body)  # type: ignore[arg-type]
    known = {"format", *(f.name for f in fields(Recipe))} - ({"probe"} if version == 1 else set())
    extra = sorted(set(body) - known)  # type: ignore[arg-type]
    _expect(not extra, f"unknown recipe keys {[k[:40] for k in extra[:5]]}")
    for key in ("arch", "input_shape", "dtype", "stages"):
        _expect(key in body, f"the recipe has no {key!r}")  # type: ignore[operator]
    stages = _stages(body["stages"])  # type: ignore[index]
    shape = _input_shape(body["input_shape"])  # type: ignore[index]
    return Recipe(
        arch=_arch(body["arch"]),  # type: ignore[index]
        input_shape=shape,
        dtype=_choice(body["dtype"], DTYPES, "dtype"),  # type: ignore[index]
        stages=stages,
        pretrained_cfg=_pretrained_cfg(body.get("pretrained_cfg", {}), shape[1]),  # type: ignore[union-attr]
        versions=_versions(body.get("versions", {})),  # type: ignore[union-attr]
        whole_model=_flag(body.get("whole_model", False), "whole_model"),  # type: ignore[union-attr]
        probe=_probe(body.get("probe"), stages, version) if version >= 2 else None,  # type: ignore[union-attr]
        steps_multiplier=_steps_multiplier(body.get("steps_multiplier")),  # type: ignore[union-attr]
        version=version,
    )


def _expect(ok: bool, problem: str) -> None:
    if not ok:
        raise RecipeError(problem)


def _version(body: Mapping[str, Any]) -> int:
    """The format version; a missing, mistyped or unknown one is named for what it is."""
    if "format" not in body and "version" not in body and "source" in body:
        raise RecipeError(
            "the recipe has no format version: it was written by an older odeify (before self-contained "
            "files), which recorded a path to the source checkpoint. Convert the source again and save it "
            "with this odeify.",
            whole=True,
        )
    _expect(
        body.get("format") == FORMAT,
        f"the recipe's format must be {FORMAT!r}, not {body.get('format')!r:.60}",
    )
    _expect("version" in body, "the recipe has no format version")
    version = body["version"]
    _expect(
        _is_int(version, -math.inf, math.inf), f"the format version must be an integer, not {version!r:.40}"
    )
    if version > FORMAT_VERSION:
        from odeify.serialization.file_recipe import odeify_version

        raise RecipeError(
            f"written by a newer odeify (format version {version}; this odeify {odeify_version()} reads up "
            f"to {FORMAT_VERSION}). Upgrade odeify: pip install -U odeify",
            whole=True,
        )
    _expect(version in READS, f"unknown format version {version}: odeify's formats are numbered from 1")
    return version


def _steps_multiplier(value: object) -> str | None:
    """Absent, or a depth multiplier as --steps takes it ('x0.5')."""
    if value is None:
        return None
    ok = isinstance(value, str) and value.startswith("x")
    try:
        ok = ok and parse_steps(value) == value
    except ConfigError:
        ok = False
    _expect(ok, f"steps_multiplier must be a depth multiplier such as 'x0.5', not {value!r:.40}")
    return value  # type: ignore[return-value]


def _flag(value: object, what: str) -> bool:
    _expect(isinstance(value, bool), f"{what} must be true or false, not {value!r:.40}")
    return value  # type: ignore[return-value]


def _is_int(value: object, lo: float = 0, hi: float = 2**31) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _choice(value: object, options: Sequence[str] | Mapping[str, Any], what: str) -> str:
    _expect(isinstance(value, str) and value in options, f"{what} must be one of {sorted(options)}")
    return value  # type: ignore[return-value]


def _arch(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    _expect(isinstance(value, dict) and set(value) == {"name", "kwargs"}, "arch must be {name, kwargs}")
    name = _reworded(check_arch_name, value["name"])  # type: ignore[index]
    return {"name": name, "kwargs": _reworded(check_file_kwargs, value["kwargs"])}  # type: ignore[index]


def _reworded(check, value: object) -> Any:
    """``check(value, where)`` from odeify.models.archs, its ModelLoadError as a RecipeError."""
    try:
        return check(value, "arch")
    except RecipeError:
        raise
    except ModelLoadError as exc:
        raise RecipeError(str(exc)) from None


def _input_shape(value: object) -> tuple[int, ...]:
    ok = isinstance(value, list) and len(value) == 4 and _is_int(value[0], 1, MAX_BATCH)
    ok = ok and _is_int(value[1], 1, MAX_IN_CHANS) and all(_is_int(v, 1, MAX_SIDE) for v in value[2:])  # type: ignore[index]
    _expect(
        ok,
        f"input_shape must be [N, C, H, W] with N <= {MAX_BATCH}, C <= {MAX_IN_CHANS} and H, W <= "
        f"{MAX_SIDE}, not {value!r:.60}",
    )
    return tuple(value)  # type: ignore[arg-type]


def _fitted_steps(value: object, at: str, key: str = "fitted_steps") -> tuple[int, ...] | None:
    """A stage's fitted (or corrected) step counts: absent, or a sorted list of distinct step counts."""
    if value is None:
        return None
    ok = isinstance(value, list) and 1 <= len(value) <= MAX_FITTED_DEPTHS
    ok = ok and all(_is_int(v, 1, MAX_STEPS) for v in value) and value == sorted(set(value))
    _expect(ok, f"{at}: {key} must be a sorted list of 1 to {MAX_FITTED_DEPTHS} distinct step counts")
    return tuple(value)  # type: ignore[arg-type]


def _stages(value: object) -> tuple[StageRecipe, ...]:
    _expect(isinstance(value, list) and 1 <= len(value) <= MAX_STAGES, f"stages: a list of 1 to {MAX_STAGES}")
    keys = {f.name for f in fields(StageRecipe)}
    optional = {"fitted_steps", "corrected_steps"}
    stages = []
    for i, entry in enumerate(value):  # type: ignore[arg-type]
        at = f"stage {i}"
        _expect(
            isinstance(entry, dict) and keys - optional <= set(entry) <= keys,
            f"{at}: a stage has the keys {sorted(keys - optional)} (and may have {sorted(optional)})",
        )
        name = entry["name"]
        ok = isinstance(name, str) and len(name) <= 100 and bool(_STAGE_NAME.fullmatch(name))
        _expect(ok, f"{at}: a stage name is a module path of Python names like 'layer1', not {name!r:.60}")
        _expect(
            entry["module"] == stage_module(name),
            f"{at}: stage {name!r} is the module {stage_module(name)!r} of the converted model, "
            f"not {entry['module']!r:.60}",
        )
        _expect(_is_int(entry["knots"], 1, MAX_KNOTS), f"{at}: knots must be an integer in [1, {MAX_KNOTS}]")
        _expect(_is_int(entry["steps"], 1, MAX_STEPS), f"{at}: steps must be an integer in [1, {MAX_STEPS}]")
        every = entry["checkpoint_every"]
        _expect(_is_int(every, 1, entry["steps"]), f"{at}: checkpoint_every must be an integer in [1, steps]")
        _choice(entry["basis"], BASES, f"{at}: basis")
        _choice(entry["backward"], BACKWARD_MODES, f"{at}: backward")
        _integrator(entry["integrator"], at)
        fitted = _fitted_steps(entry.get("fitted_steps"), at)
        corrected = _fitted_steps(entry.get("corrected_steps"), at, "corrected_steps")
        _expect(
            corrected is None or set(corrected) <= set(fitted or ()),
            f"{at}: corrected_steps must be among its fitted_steps (a correction is fitted for its depth)",
        )
        entry = {**entry, "fitted_steps": fitted, "corrected_steps": corrected}
        stages.append(StageRecipe(**entry))
    names = [s.name for s in stages]
    twice = sorted({n for n in names if names.count(n) > 1})
    _expect(not twice, f"the stage {twice[0] if twice else ''!r} is listed twice")
    return tuple(stages)


def _integrator(value: object, at: str) -> None:
    """A built-in name, or a small tableau of exact rational strings (checked before any parsing)."""
    if isinstance(value, str):
        _choice(value, KNOWN_INTEGRATORS, f"{at}: integrator")
        return
    _expect(isinstance(value, dict) and set(value) == {"name", "a", "b", "order"}, f"{at}: integrator keys")
    b, a = value["b"], value["a"]  # type: ignore[index]
    s = len(b) if isinstance(b, list) else 0
    _expect(1 <= s <= MAX_TABLEAU_STAGES, f"{at}: a tableau has 1 to {MAX_TABLEAU_STAGES} stages")
    square = isinstance(a, list) and len(a) == s and all(isinstance(r, list) and len(r) == s for r in a)
    _expect(square, f"{at}: a tableau's a is an s x s list of lists")
    entries = [*b, *(v for row in a for v in row)]
    exact = all(isinstance(v, str) and _RATIONAL.fullmatch(v) for v in entries)
    _expect(
        exact, f"{at}: tableau entries must be exact rationals like '2/3' (at most {_DIGITS} digits each)"
    )
    name, order = value["name"], value["order"]  # type: ignore[index]
    ok = isinstance(name, str) and len(name) <= MAX_NAME and bool(_IDENTIFIER.fullmatch(name))
    _expect(
        ok,
        f"{at}: a tableau name is a Python name of 1 to {MAX_NAME} characters like 'rk4', not {name!r:.80}",
    )
    _expect(_is_int(order, 1, MAX_TABLEAU_ORDER), f"{at}: a tableau order is in [1, {MAX_TABLEAU_ORDER}]")


def _pretrained_cfg(value: object, channels: int) -> dict[str, Any]:
    try:
        return check_data_config(value, "pretrained_cfg", channels=channels)
    except ModelLoadError as exc:
        raise RecipeError(str(exc)) from None


def _versions(value: object) -> dict[str, str]:
    ok = isinstance(value, dict) and set(value) <= {"odeify", "torch", "timm"}
    ok = ok and all(isinstance(v, str) and len(v) <= 64 for v in value.values())  # type: ignore[union-attr]
    _expect(ok, "versions must map odeify/torch/timm to short strings")
    return dict(value)  # type: ignore[arg-type]


def _probe(value: object, stages: Sequence[StageRecipe], version: int) -> dict[str, Any] | None:
    """{"seed": int, "points": [[name, error], ...]}: each point a stage (once, in order), the output or
    (format 3) the source network's output. ``error``: the round-off measured when saving, which
    load shows in a refusal and never uses as its allowance (the probe measures its own)."""
    if value is None:
        return None
    _expect(isinstance(value, dict) and set(value) == {"seed", "points"}, "probe must be {seed, points}")
    _expect(_is_int(value["seed"]), "probe seed must be an integer in [0, 2^31]")  # type: ignore[index]
    points = value["points"]  # type: ignore[index]
    allowed = [s.name for s in stages] + [PROBE_OUTPUT] + ([PROBE_SOURCE] if version >= 3 else [])
    _expect(isinstance(points, list) and 1 <= len(points) <= MAX_STAGES + 2, "probe points: a short list")
    for point in points:
        ok = isinstance(point, list) and len(point) == 2 and isinstance(point[0], str)
        ok = ok and isinstance(point[1], (int, float)) and not isinstance(point[1], bool)
        _expect(
            ok and math.isfinite(point[1]) and point[1] >= 0,
            "probe points are [stage or 'output', error >= 0]",
        )
        _expect(
            point[0] in allowed,
            f"the probe has a point {point[0]!r:.60}, which is neither a stage of the recipe nor 'output' "
            "(was a stage entry removed?)",
        )
    names = [p[0] for p in points]
    _expect(len(set(names)) == len(names), "a probe point is listed twice")
    return {"seed": value["seed"], "points": [list(p) for p in points]}  # type: ignore[index]
