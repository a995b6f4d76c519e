"""Save and load converted models: one safetensors file, the tensors plus a JSON recipe, never pickles.

A saved model is self-contained: its recipe (:mod:`odeify.serialization.recipe`) names the source
architecture as a timm name and build kwargs, never a path or the source weights. ``load`` builds
that architecture with random weights (or takes the ``model=`` you pass), converts it with the
recorded settings, checks every saved tensor against the result, and loads them (with the fold
records and source tensors the file has: what fine-tuning reads, :mod:`odeify.passes.source`).
It opens no path but the one it is given and needs no network, so a file loads the same on any
machine with odeify, torch and timm.
"""

from __future__ import annotations

import copy
import os
import stat
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import safetensors.torch
import torch
import torch.fx as fx
from safetensors import safe_open
from torch import nn

from odeify.compiler.conversion import guard_input_dtype
from odeify.compiler.pipeline import Job
from odeify.compiler.pipelines import CONVERT
from odeify.compiler.record import META
from odeify.core.errors import ModelLoadError, OdeifyError
from odeify.core.fileio import atomic_write_bytes
from odeify.ir.settings import StageSettings
from odeify.models.archs import build_arch
from odeify.models.timm_interface import ConvertedModel
from odeify.passes.fold_bn import FOLDS, drop_fold_records
from odeify.passes.source import attach_sources, drop_sources
from odeify.serialization.recipe import DTYPES, Recipe, integrator_of, parse_recipe, recipe_of

__all__ = ["RECIPE_KEY", "load", "save"]

RECIPE_KEY = "odeify_converted"  # safetensors metadata key of the recipe (JSON)
MAX_BUILD_RATIO = 64  # a file may name an architecture with at most this many times its own elements


def save(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write a converted model (from convert/retarget/load, possibly fine-tuned) to ``path``, atomically.

    A model converted from a custom ``nn.Module`` (not a timm or odeify architecture) cannot be rebuilt
    from the file alone: ``save`` warns, and ``load`` will need ``model=`` an instance of it.
    """
    target = _save_target(path)
    recipe = recipe_of(model)
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
    # own, contiguous CPU copies: safetensors refuses tensors that share storage
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    data = safetensors.torch.save(tensors, metadata={RECIPE_KEY: recipe.to_json()})
    try:
        atomic_write_bytes(target, data)
    except OSError as exc:
        raise OdeifyError(f"cannot write {target}: {exc.strerror or exc}") from exc


def _save_target(path: str | os.PathLike[str]) -> Path:
    """``path`` as a file path that can be written, or an OdeifyError that says why not."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise OdeifyError(f"save needs a file path such as 'model.safetensors', not {path!r}")
    target = Path(path).expanduser()
    if target.is_dir():
        raise OdeifyError(
            f"{target} is a directory; save to a file in it, e.g. {target / 'model.safetensors'}"
        )
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OdeifyError(f"cannot save to {target}: {parent} is a file, not a folder")
            break
    return target


def load(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    *,
    leaf_modules: Sequence[type[nn.Module]] = (),
) -> ConvertedModel:
    """Rebuild a converted model saved with ``save``; in eval mode, outputs identical to the saved one.

    ``model``: an instance of the source architecture, needed only when the source was a custom
    ``nn.Module`` (an un-initialised instance is enough: its weights are ignored). ``leaf_modules``:
    as given to ``convert``.
    """
    path = _load_source(path)
    recipe, header = _read_header(path)
    _check_knot_shapes(recipe, header, path)
    source = _source_model(recipe, header, path, model)
    converted = _rebuild(source, recipe, path, leaf_modules)
    state = _read_tensors(path)
    _match_training_records(converted, state, path)
    _check_tensors(converted, state, path)
    converted.load_state_dict(state, strict=True)
    if recipe.pretrained_cfg:
        converted.pretrained_cfg = {**converted.pretrained_cfg, **recipe.pretrained_cfg}
    return converted.eval()


def _load_source(path: str | os.PathLike[str]) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ModelLoadError(f"load needs the path of a file written by odeify.save, not {path!r}")
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ModelLoadError(f"no converted model at {path}: the file does not exist") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(mode):
        raise ModelLoadError(f"{path} is a directory, not a file written by odeify.save")
    if not stat.S_ISREG(mode):
        raise ModelLoadError(
            f"{path} is not a regular file (a pipe, socket or device); odeify.load reads files"
        )
    return path


def _read_header(path: Path) -> tuple[Recipe, dict[str, tuple[tuple[int, ...], str]]]:
    """The validated recipe and every tensor's (shape, dtype), read from the header alone."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            meta = handle.metadata() or {}
            header = {}
            for key in handle.keys():
                piece = handle.get_slice(key)
                header[key] = (tuple(piece.get_shape()), str(piece.get_dtype()))
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise ModelLoadError(f"{path} is not a safetensors file written by odeify.save: {exc}") from exc
    if RECIPE_KEY not in meta:
        raise ModelLoadError(
            f"{path} holds no odeify recipe: it is not a converted model. To convert a checkpoint, use "
            f"odeify.convert({str(path)!r}) (CLI: odeify convert {path})."
        )
    return parse_recipe(meta[RECIPE_KEY], str(path)), header


def _check_knot_shapes(recipe: Recipe, header: Mapping[str, tuple[tuple[int, ...], str]], path: Path) -> None:
    """Each stage's knot tensors in the file have the recipe's knot count (before anything is built)."""
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


def _source_model(
    recipe: Recipe, header: Mapping[str, tuple[tuple[int, ...], str]], path: Path, model: nn.Module | None
) -> nn.Module:
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

    def settings_for(names: list[str]) -> dict[str, StageSettings]:
        missing = [entry.name for entry in recipe.stages if entry.name not in names]
        if missing:
            raise ModelLoadError(
                f"{path} has a stage {missing[0]!r} that the rebuilt model lacks (it has "
                f"{', '.join(names)}); was it saved from another architecture, or is model= another one?"
            )
        return {
            entry.name: StageSettings(
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


def _match_training_records(model: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Give the rebuilt model the training records the file has: fold records, source tensors.

    The rebuilt model has fold records (its conversion folded BatchNorms), and source tensors of the
    random weights it was built with where its recipe compressed or refined knots: those go, the
    file's take their place. A file saved before fold records existed has none, and loads without
    them (fine-tuning then trains its folded tensors as they are).
    """
    if not any(key.startswith(f"{FOLDS}.") or f".{FOLDS}." in key for key in state):
        drop_fold_records(model)
    drop_sources(model)
    problems = attach_sources(model, dict(state))
    if problems:
        raise ModelLoadError(f"{path}: {'; '.join(problems[:3])}; the file is damaged or was altered")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load_file(str(path), device="cpu")
    except Exception as exc:
        raise ModelLoadError(f"{path}: the tensors cannot be read ({exc}); the file is damaged") from exc


def _check_tensors(model: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Every tensor has the name, shape and dtype the rebuilt model expects, and finite values."""
    own = model.state_dict()
    problems = [f"missing {k}" for k in own if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in own]
    for key in own.keys() & state.keys():
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
