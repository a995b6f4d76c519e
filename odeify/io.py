"""Save and load converted models as safetensors: weights plus a JSON recipe, never pickles.

A converted model is rebuilt from its recipe (the source model name or checkpoint, the input
shape and each stage's knots, basis, integrator, steps and backward mode) and then receives the
saved weights, so a file only ever holds tensors and strings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import safetensors.torch
import torch.fx as fx
from safetensors import safe_open
from torch import nn

from odeify.conversion import _change_knots, convert, converted_stages
from odeify.errors import ModelLoadError
from odeify.fileio import atomic_write_bytes
from odeify.passes.lower import lower_stages, raise_stages, stage_nodes
from odeify.tableaus import ReversibleHeun, Tableau

RECIPE_KEY = "odeify_converted"


def save(converted: fx.GraphModule, path: str | os.PathLike[str]) -> None:
    """Write ``converted`` (the output of convert/retarget, possibly fine-tuned) atomically."""
    meta = dict(converted.meta.get("odeify", {}))
    recipe = {
        "source": meta.get("source"),
        "load_kwargs": meta.get("load_kwargs", {}),
        "input_shape": meta.get("input_shape"),
        "stages": [_stage_recipe(stage) for stage in converted_stages(converted)],
    }
    tensors = {k: v.detach().contiguous() for k, v in converted.state_dict().items()}
    data = safetensors.torch.save(tensors, metadata={RECIPE_KEY: json.dumps(recipe)})
    atomic_write_bytes(path, data)


def load(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    *,
    leaf_modules: Sequence[type[nn.Module]] = (),
) -> fx.GraphModule:
    """Rebuild a saved converted model; pass ``model`` when it was converted from an nn.Module."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no converted model at '{path}': the file does not exist.")
    recipe = json.loads(_read_metadata(path)[RECIPE_KEY])
    source = model if model is not None else recipe["source"]
    if source is None:
        raise ModelLoadError(
            f"'{path}' was converted from {recipe['source']!r}, which odeify cannot rebuild by name. "
            "Pass the original architecture: odeify.load(path, model=MyModel())."
        )
    gm = convert(source, input_size=recipe["input_shape"], leaf_modules=leaf_modules, **recipe["load_kwargs"])
    gm = raise_stages(gm)
    stages = {stage.stage_name: stage for _, stage in stage_nodes(gm)}
    for entry in recipe["stages"]:
        stage = stages.get(entry["name"])
        if stage is None:
            raise ModelLoadError(
                f"'{path}' has a stage '{entry['name']}' that the rebuilt model lacks "
                f"(it has {', '.join(stages)}); was it saved from another architecture?"
            )
        _change_knots(stage, entry["knots"], entry["basis"])
        stage.configure(
            integrator=_integrator(entry["integrator"]), steps=entry["steps"], backward=entry["backward"]
        )
    gm = lower_stages(gm)
    state = safetensors.torch.load_file(str(path))
    missing, unexpected = gm.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelLoadError(
            f"'{path}' does not match the rebuilt model: missing {list(missing)[:5]}, unexpected "
            f"{list(unexpected)[:5]}. Rebuild with the same odeify version and source model."
        )
    gm.meta["odeify"]["loaded_from"] = str(path)
    return gm


def _stage_recipe(stage) -> dict:
    integrator = stage.integrator
    if isinstance(integrator, ReversibleHeun) or integrator.name in _builtin_names():
        spec: str | dict = integrator.name
    else:
        spec = {
            "name": integrator.name,
            "a": [[str(v) for v in row] for row in integrator.a],
            "b": [str(v) for v in integrator.b],
            "order": integrator.order,
        }
    return {
        "name": stage.stage_name,
        "knots": stage.num_knots,
        "basis": stage.basis,
        "integrator": spec,
        "steps": stage.steps,
        "backward": stage.backward,
    }


def _integrator(spec: str | dict):
    if isinstance(spec, str):
        return spec
    return Tableau.create(spec["name"], spec["a"], spec["b"], order=spec["order"])


def _builtin_names() -> set[str]:
    from odeify.tableaus import TABLEAUS

    return set(TABLEAUS)


def _read_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise ModelLoadError(f"'{path}' is not a safetensors file written by odeify.save: {exc}") from exc
    if RECIPE_KEY not in meta:
        raise ModelLoadError(
            f"'{path}' holds no odeify recipe: it is not a converted model. To convert a checkpoint, "
            "use odeify.convert(path) instead."
        )
    return meta
