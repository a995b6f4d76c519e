"""Save and load converted models: one safetensors file, the tensors plus a JSON recipe, never pickles.

A saved model is self-contained: its recipe (:mod:`odeify.serialization.file_recipe`) names the
source architecture as a timm name and build kwargs, never a path or the source weights. ``load`` builds
that architecture with random weights (or takes the ``model=`` you pass), converts it with the
recorded settings, checks every saved tensor against the result, loads them (with the fold
records and source tensors the file has: what fine-tuning reads, :mod:`odeify.ir.source_tensors`),
checks the fold records (:mod:`odeify.serialization.records`) and that the result computes what
was saved, its source network included (:mod:`odeify.serialization.probe`). It opens
no path but the one it is given and needs no network, so a file loads the same on any machine
with odeify, torch and timm.

``save`` checks what it writes with load's own rules (:mod:`odeify.serialization.file_schema`, the
tensor checks below, the resource budgets): a model load would refuse is refused before anything is
written, with the same words.

What a file may not decide: whether it is checked. A current-version file without its probe is
refused (``save`` always writes one); an older one whose probe does not check all it holds (none
in version 1; not the source network in version 2) loads only when the caller passes
``verify=False``, with a warning; the probe's allowance is measured on the rebuilt model, never
read from the file.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn

from odeify.compiler.conversion import check_materialized, converted_stages, guard_input_dtype, relower
from odeify.compiler.pipeline import Job
from odeify.compiler.pipelines import CONVERT
from odeify.compiler.record import META
from odeify.core.budget import check_input_bytes
from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError, ModelLoadError, OdeifyError
from odeify.core.fileio import atomic_write_tensors, read_header, read_tensors
from odeify.core.paths import MODEL_SUFFIX, input_file, output_file
from odeify.ir.fold_records import FOLDS, drop_fold_records, fold_records
from odeify.ir.settings import DepthMultiplier, StageRequest
from odeify.ir.source_tensors import attach_sources, drop_sources
from odeify.models.archs import build_arch
from odeify.models.timm_interface import META_TIMM, ConvertedModel
from odeify.serialization.file_recipe import DTYPES, FORMAT_VERSION, Recipe, integrator_of, recipe_of
from odeify.serialization.file_schema import RecipeError, parse_recipe, validate_recipe
from odeify.serialization.probe import PROBE_PREFIX, check_probe, record_probe
from odeify.serialization.records import check_fold_records

__all__ = ["RECIPE_KEY", "is_converted_file", "load", "save"]

RECIPE_KEY = "odeify_converted"  # safetensors metadata key of the recipe (JSON)
MAX_BUILD_RATIO = 64  # a file may name an architecture with at most this many times its own elements
_WRITTEN_BY_SAVE = "a safetensors file written by odeify.save"
Header = Mapping[str, tuple[tuple[int, ...], str]]


def save(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write a converted model (from convert/retarget/load, possibly fine-tuned) to ``path``, atomically.

    ``path`` ends in ``.safetensors``. A model converted from a custom ``nn.Module`` (not a timm or
    odeify architecture) cannot be rebuilt from the file alone: ``save`` warns, and ``load`` will
    need ``model=`` an instance of it. A model that ``load`` would refuse (a NaN weight, a head or
    input larger than a file may ask for, a tableau name that is not a Python name, a classifier
    replaced after conversion) is refused.
    """
    target = output_file(path, "odeify.save", suffix=MODEL_SUFFIX)
    recipe = recipe_of(model)
    _check_saved(recipe, target)  # before any work: what load's schema and budgets refuse
    _refuse_other_classifier(model, recipe, target)
    check_materialized(model, "odeify.save")
    _refuse_unloadable(model.state_dict(), target)
    try:
        probe, probe_tensors = record_probe(model)
    except ConfigError as exc:  # the probe at the model's input size is over a budget: so would load's be
        raise _refused(target, str(exc)) from None
    if probe is None:
        raise _refused(target, "the model has no tensor output to probe (a stage's or its own)")
    overflowing = [name for name, error in probe["points"] if not math.isfinite(error)]
    if overflowing:
        raise _refused(
            target,
            f"its own {model_dtype(model)} round-off at probe point {overflowing[0]!r} is "
            "not finite: its tensors hold values so large that it overflows, so no probe can check it",
        )
    recipe = recipe_of(model, probe)
    tensors = _file_tensors(model.state_dict())
    if recipe.arch is None:
        record = model.meta.get(META, {})
        source, why = record.get("name", "the source module"), record.get("arch_unknown_because")
        warnings.warn(
            f"{target}: odeify cannot rebuild this model's source by name ({why}); "
            f"loading it will need an instance of it: odeify.load({str(target)!r}, model={source}(...)) "
            f"(its weights are ignored).",
            UserWarning,
            stacklevel=2,
        )
    try:
        atomic_write_tensors(target, {**tensors, **probe_tensors}, {RECIPE_KEY: recipe.to_json()})
    except OSError as exc:
        raise OdeifyError(f"cannot write {target}: {exc.strerror or exc}") from exc


def _file_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state``'s tensors as the file takes them: on the CPU, contiguous, each alone in its storage
    (safetensors refuses tensors that share memory). Copied only where they are not: a copy of every
    tensor was 1.6 GiB of save's peak on a 412M-parameter model."""
    owners = Counter(_storage_of(t) for t in state.values())
    return {key: _as_written(t, alone=owners[_storage_of(t)] == 1) for key, t in state.items()}


def _storage_of(tensor: torch.Tensor) -> tuple[str, int]:
    """Where ``tensor``'s memory is (device, address): tensors of one storage share it."""
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def _as_written(tensor: torch.Tensor, alone: bool) -> torch.Tensor:
    """``tensor`` where a file can take it as it is (``alone`` in its storage), else a copy that can."""
    if alone and tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach()
    return tensor.detach().to("cpu", copy=True).contiguous()


def _refused(target: Path, problem: str) -> OdeifyError:
    """Save's refusal of what load would refuse (``problem``: the check's own words, a sentence)."""
    return OdeifyError(
        f"odeify.save refuses to write {target}: {problem.rstrip('. ')}; odeify.load would refuse the file"
    )


def _refuse_unloadable(tensors: Mapping[str, torch.Tensor], target: Path) -> None:
    """What load's tensor checks would refuse: mixed dtypes, NaN or inf values."""
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
    problems = [f"{k} is {t.dtype}, the model needs {dtype}" for k, t in tensors.items()
                if t.is_floating_point() and t.dtype != dtype]  # fmt: skip
    problems += [f"{k} holds non-finite values (NaN or inf)" for k, t in tensors.items()
                 if t.is_floating_point() and not bool(torch.isfinite(t).all())]  # fmt: skip
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise _refused(target, "; ".join(problems[:3]) + more)


def _check_saved(recipe: Recipe, target: Path) -> None:
    """The recipe about to be written passes load's schema and input budget."""
    try:
        validate_recipe(_round_trip(recipe))
        check_input_bytes("the recorded input", recipe.input_shape, DTYPES[recipe.dtype].itemsize)
    except RecipeError as exc:
        raise _refused(target, exc.problem) from None
    except OdeifyError as exc:
        raise _refused(target, str(exc)) from None


def _refuse_other_classifier(model: nn.Module, recipe: Recipe, target: Path) -> None:
    """The model's classifier is the one its recipe rebuilds (built on the meta device to compare).

    A classifier replaced after conversion (``model.fc = nn.Linear(..., bias=False)``, another class
    count set by hand) is not in the recipe, so load would build another one and refuse the file;
    ``reset_classifier`` records what it changes. Compared: the module at the classifier's name in
    both (``head.head.l``, a Linear, in iFormer), not the rebuilt source's ``get_classifier()``, which
    may be the whole head around it (iFormer's RepVitClassifier, its norm included).
    """
    if recipe.arch is None or not isinstance(model, ConvertedModel):
        return
    try:
        name, head = model.meta[META_TIMM]["classifier"], model.get_classifier()
    except (KeyError, OdeifyError):  # no single named classifier: the rebuilt graph decides
        return
    rebuilt = build_arch(recipe.arch["name"], recipe.arch["kwargs"], device="meta").get_submodule(name)
    if _tensor_shapes(head) != _tensor_shapes(rebuilt):
        raise _refused(
            target,
            f"its classifier {name} ({_describe(head)}) is not the one its recipe rebuilds "
            f"({recipe.arch['name']!r} with {recipe.arch['kwargs'].get('num_classes')} classes: "
            f"{_describe(rebuilt)}), so it was replaced after conversion. Change the class count with "
            "model.reset_classifier(n), or change the source model's head and convert it again",
        )


def _tensor_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """A module's parameters' shapes (its buffers are the source tensors fine-tuning keeps, if any)."""
    return {key: tuple(value.shape) for key, value in module.named_parameters()}


def _describe(module: nn.Module) -> str:
    shapes = ", ".join(f"{key} {'x'.join(map(str, shape))}" for key, shape in _tensor_shapes(module).items())
    return f"{type(module).__name__}: {shapes or 'no tensors'}"


def _round_trip(recipe: Recipe) -> object:
    """The recipe as load will parse it (JSON types: lists, not tuples; a NaN kept for the schema to name)."""
    import json

    return json.loads(json.dumps(recipe.to_body()))


def load(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    *,
    leaf_modules: Sequence[type[nn.Module]] = (),
    verify: bool = True,
) -> ConvertedModel:
    """Rebuild a converted model saved with ``save``; in eval mode, outputs identical to the saved one.

    ``model``: an instance of the source architecture, needed only when the source was a custom
    ``nn.Module`` (an un-initialised instance is enough: its weights are ignored). ``leaf_modules``:
    as given to ``convert``. ``verify=False``: skip the probe, for a file you trust that it cannot
    check (saved by an older odeify: format 1 has no probe, format 2's does not cover the source
    network), with a warning; the schema, tensor and fold-record checks still run. A current-version
    file without its probe is refused either way.
    """
    path = input_file(path, "converted model", error=ModelLoadError)
    recipe, header = _read_header(path)
    check_input_bytes(f"{path}: the recorded input", recipe.input_shape, DTYPES[recipe.dtype].itemsize)
    _check_knot_shapes(recipe, header, path)
    source = _source_model(recipe, header, path, model)
    converted = _rebuild(source, recipe, path, leaf_modules)
    state = read_tensors(path, ModelLoadError, _WRITTEN_BY_SAVE)
    probe = {k: state.pop(k) for k in [k for k in state if k.startswith(PROBE_PREFIX)]}
    _match_training_records(converted, state, path, recipe.version, verify)
    _restore_corrections(converted, recipe)
    _check_tensors(converted, state, path)
    converted.load_state_dict(state, strict=True)
    check_fold_records(converted, source, path)
    del state, source  # copied into converted: their memory can go before the probe runs
    _restore_fitted_steps(converted, recipe)
    if any(stage.correction() is not None for stage in converted_stages(converted)):
        relower(converted)  # its graph reads the corrections loaded at the stages' own depth
    _restore_multiplier(converted, recipe)
    if recipe.pretrained_cfg:
        converted.pretrained_cfg = {**converted.pretrained_cfg, **recipe.pretrained_cfg}
    _check_probe_present(recipe, path, verify)  # after the checks that name what else is wrong
    if verify:
        check_probe(converted, recipe.probe, probe, str(path))  # type: ignore[arg-type]
    else:
        warnings.warn(
            f"{path}: loaded with verify=False: its probe was not run, so nothing shows that it computes "
            "what was saved; use it only if you trust the file",
            UserWarning,
            stacklevel=2,
        )
    return converted.eval()


def _restore_corrections(converted: nn.Module, recipe: Recipe) -> None:
    """Give each stage the per-depth knot corrections its recipe records, zero until the file's
    tensors are loaded into them (their names and shapes are checked with every other tensor's)."""
    corrected = {entry.name: entry.corrected_steps or () for entry in recipe.stages}
    for stage in converted_stages(converted):
        for steps in corrected[stage.stage_name]:
            stage.hold_zero_correction(steps)


def _restore_fitted_steps(converted: nn.Module, recipe: Recipe) -> None:
    """Give each stage the steps its knots were fitted for, as recorded (rebuilding resets them)."""
    fitted = {entry.name: entry.fitted_steps for entry in recipe.stages}
    for stage in converted_stages(converted):
        stage.fitted_steps = fitted[stage.stage_name]


def _restore_multiplier(converted: fx.GraphModule, recipe: Recipe) -> None:
    """Record what the file's whole-model depth multiplier became, as convert and retarget do."""
    if recipe.steps_multiplier is not None:
        depths = {stage.stage_name: stage.depth for stage in converted_stages(converted)}
        multiplier = DepthMultiplier.of(recipe.steps_multiplier, depths)
        converted.meta[META]["steps_multiplier"] = multiplier.to_dict()


def is_converted_file(path: str | os.PathLike[str]) -> bool:
    """True for a file written by :func:`save` (it carries odeify's recipe in its metadata)."""
    path = Path(path)
    if not path.is_file() or path.suffix != MODEL_SUFFIX:
        return False
    try:
        return RECIPE_KEY in read_header(path, OdeifyError, "a safetensors file").metadata
    except OdeifyError:  # not a readable safetensors file: loading it as a model says what is wrong
        return False


def _check_probe_present(recipe: Recipe, path: Path, verify: bool) -> None:
    """A current file has its probe; an older one without it loads only with ``verify=False``."""
    if recipe.probe is not None:
        return
    if recipe.version == FORMAT_VERSION:
        raise ModelLoadError(
            f"{path} has no probe, which odeify.save always writes (format {FORMAT_VERSION}): without it "
            "nothing shows that the file computes what was saved. It was damaged or altered; save the "
            "model again from its source."
        )
    if verify:
        raise ModelLoadError(
            f"{path} was saved by an older odeify (format {recipe.version}) with no probe, so nothing shows "
            "that it computes what was saved. If you trust the file, load it unchecked with "
            "odeify.load(path, verify=False) (CLI: --no-verify), then save it again to record a probe."
        )


def _read_header(path: Path) -> tuple[Recipe, dict[str, tuple[tuple[int, ...], str]]]:
    """The validated recipe and every tensor's (shape, dtype), read from the header alone."""
    header = read_header(path, ModelLoadError, _WRITTEN_BY_SAVE)
    if RECIPE_KEY not in header.metadata:
        raise ModelLoadError(
            f"{path} holds no odeify recipe: it is not a converted model. To convert a checkpoint, use "
            f"odeify.convert({str(path)!r}) (CLI: odeify convert {path})."
        )
    recipe = parse_recipe(header.metadata[RECIPE_KEY], str(path))
    probes = [k for k in header.tensors if k.startswith(PROBE_PREFIX)]
    expected = [PROBE_PREFIX + name for name, _ in (recipe.probe or {}).get("points", [])]
    if sorted(probes) != sorted(expected):
        raise ModelLoadError(
            f"{path}: the probe tensors {sorted(probes)[:3]} do not match its recipe's probe points "
            f"{sorted(expected)[:3]}; the file is damaged or was altered"
        )
    return recipe, {k: v for k, v in header.tensors.items() if not k.startswith(PROBE_PREFIX)}


def _check_knot_shapes(recipe: Recipe, header: Header, path: Path) -> None:
    """Each stage's knot tensors in the file have the recipe's knot count, and every knot tensor in the
    file belongs to a stage of the recipe (checked before anything is built: no knot count from the
    recipe is believed without the tensors that hold it)."""
    claimed: set[str] = set()
    for stage in recipe.stages:
        prefix = f"{stage.module}.knots."
        found = {k: shape for k, (shape, _) in header.items() if k.startswith(prefix)}
        if not found:
            raise ModelLoadError(f"{path}: stage {stage.name!r} has no knot tensors ({prefix}*) in the file")
        wrong = [f"{k} {shape}" for k, shape in found.items() if not shape or shape[0] != stage.knots]
        if wrong:
            raise ModelLoadError(
                f"{path}: stage {stage.name!r} says {stage.knots} knots but the file's knot tensors are "
                f"{', '.join(wrong[:3])}; the file is damaged or was altered"
            )
        claimed |= found.keys()
    stray = sorted(k for k in header if ".knots." in k and k not in claimed)
    if stray:
        raise ModelLoadError(
            f"{path}: the knot tensors {', '.join(stray[:3])} belong to no stage of its recipe; the file is "
            "damaged or was altered (does the recipe lack a stage?)"
        )


def _source_model(recipe: Recipe, header: Header, path: Path, model: nn.Module | None) -> nn.Module:
    """The source architecture with random weights: ``model`` if given, else built from the recipe."""
    dtype = DTYPES[recipe.dtype]
    if model is not None:
        if not isinstance(model, nn.Module) or isinstance(model, fx.GraphModule):
            raise ModelLoadError(
                f"load(model=...) takes an instance of the source architecture (an nn.Module that is not "
                f"converted), not {type(model).__name__}"
            )
        return copy.deepcopy(model).to(dtype)
    if recipe.arch is None:
        raise ModelLoadError(
            f"{path} was converted from a custom nn.Module, which odeify cannot rebuild by name. Pass an "
            f"instance of it (its weights are ignored): odeify.load({str(path)!r}, model=MyModel())"
        )
    name, kwargs = recipe.arch["name"], recipe.arch["kwargs"]
    planned = sum(t.numel() for t in build_arch(name, kwargs, device="meta").state_dict().values())
    held = sum(_numel(shape) for shape, _ in header.values())
    if planned > MAX_BUILD_RATIO * held + 2**20:
        raise ModelLoadError(
            f"{path} names {name!r} with {kwargs}, which has {planned:,} parameters, but the file holds only "
            f"{held:,} tensor elements; a converted model keeps at least 1/{MAX_BUILD_RATIO} of its source. "
            f"The file is damaged or was altered."
        )
    return build_arch(name, kwargs).to(dtype)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _rebuild(
    source: nn.Module, recipe: Recipe, path: Path, leaf_modules: Sequence[type[nn.Module]]
) -> ConvertedModel:
    """Convert ``source`` and give each stage the recorded manifestation."""
    try:
        return _convert_as_recorded(source, recipe, path, leaf_modules)
    except ModelLoadError:
        raise
    except OdeifyError as exc:  # a setting the recipe passed to convert/configure was refused
        raise ModelLoadError(f"{path}: its recipe asks for what odeify refuses: {exc}") from exc


def _convert_as_recorded(
    source: nn.Module, recipe: Recipe, path: Path, leaf_modules: Sequence[type[nn.Module]]
) -> ConvertedModel:
    """The convert pipeline, with the recipe's manifestation for each stage."""

    def settings_for(names: list[str]) -> dict[str, StageRequest]:
        recorded = [entry.name for entry in recipe.stages]
        extra = [name for name in recorded if name not in names]
        missing = [name for name in names if name not in recorded]
        if extra or missing:
            what = (
                f"a stage {extra[0]!r} that the rebuilt model lacks"
                if extra
                else f"no entry for stage {missing[0]!r}"
            )
            raise ModelLoadError(
                f"{path}: its recipe has {what} (the rebuilt model has {', '.join(names)}); was it saved "
                "from another architecture, is model= another one, or was the recipe altered?"
            )
        return {
            entry.name: StageRequest(
                knots=entry.knots,
                basis=entry.basis,
                integrator=integrator_of(entry.integrator),
                steps=entry.steps,
                backward=entry.backward,
                checkpoint_every=entry.checkpoint_every,
            )
            for entry in recipe.stages
        }

    job = Job(
        source=source.eval(),
        name=type(source).__name__,
        input_shape=recipe.input_shape,
        leaf_modules=leaf_modules,
        settings_for=settings_for,
        whole_model=recipe.whole_model,
    )
    with torch.no_grad():
        return guard_input_dtype(CONVERT.run(job).gm)


def _match_training_records(
    model: nn.Module, state: Mapping[str, torch.Tensor], path: Path, version: int, verify: bool
) -> None:
    """Give the rebuilt model the training records the file has: fold records, source tensors.

    The rebuilt model has fold records (its conversion folded BatchNorms), and source tensors of the
    random weights it was built with where its recipe compressed or refined knots: those go, the
    file's take their place. A format 3 file always has the rebuilt model's fold records; an older
    one saved before they existed has none, and loads without them only with ``verify=False``
    (fine-tuning then trains its folded tensors as they are).
    """
    if not any(key.startswith(f"{FOLDS}.") or f".{FOLDS}." in key for key in state):
        if (version == FORMAT_VERSION or verify) and any(fold_records(m) for m in model.modules()):
            raise ModelLoadError(
                f"{path} holds no fold records ({FOLDS}.*), which odeify.save writes for every folded "
                f"BatchNorm (format {FORMAT_VERSION}): without them fine-tuning would train the folded "
                "tensors themselves, which its first steps destroy. "
                + (
                    "The file was damaged or altered; save the model again from its source."
                    if version == FORMAT_VERSION
                    else f"It was saved by an older odeify (format {version}) or altered. If you trust it, "
                    "load it with odeify.load(path, verify=False) (CLI: --no-verify)."
                )
            )
        drop_fold_records(model)
    drop_sources(model)
    problems = attach_sources(model, dict(state))
    if problems:
        raise ModelLoadError(f"{path}: {'; '.join(problems[:3])}; the file is damaged or was altered")


def _check_tensors(model: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Every tensor has the name, shape and dtype the rebuilt model expects, and finite values."""
    own = model.state_dict()
    problems = [f"missing {k}" for k in own if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in own]
    for key in (k for k in own if k in state):  # in the model's order: the order save names them in
        mine, theirs = own[key], state[key]
        if theirs.shape != mine.shape:
            problems.append(f"{key} has shape {tuple(theirs.shape)}, the model needs {tuple(mine.shape)}")
        elif theirs.dtype != mine.dtype:
            problems.append(f"{key} is {theirs.dtype}, the model needs {mine.dtype}")
        elif theirs.is_floating_point() and not bool(torch.isfinite(theirs).all()):
            problems.append(f"{key} holds non-finite values (NaN or inf)")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ModelLoadError(
            f"{path} does not fit the model its recipe rebuilds: {'; '.join(problems[:3])}{more}. The file "
            f"is damaged or was altered; odeify.save writes tensors that match."
        )
