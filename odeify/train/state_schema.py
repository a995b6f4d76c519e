"""The schema of a training state, with the discipline of a saved model's recipe: checked before use.

``--resume`` reads a training state written after an epoch; a damaged or altered one must end in
one clear error, not a traceback from deep inside the optimizer. :func:`validate_record` checks the
JSON record (version, epoch, step, history, the run's settings with the command line's in
:data:`RECORDED`, the optimizer's groups and scalars) and :func:`check_tensors` the tensors against
the model and optimizer they are about to be loaded into (names, shapes, dtypes). Each error names
the field and what it holds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from odeify.core.errors import ConfigError
from odeify.core.limits import MAX_EPOCHS
from odeify.models.data_config import DATA_CONFIG_FLAGS, TRAIN_AUGMENTATION_KEYS
from odeify.train.recipe import Recipe

__all__ = ["RECORDED", "StateError", "check_tensors", "validate_record", "validate_tensor_names"]

STATE_VERSION = 1
_RECORD_KEYS = ("epoch", "step", "history", "run", "param_groups", "optimizer_scalars")
_HISTORY_FIELDS = {
    "epoch": "int",
    "val_accuracy": "fraction",
    "train_loss": "number?",
    "train_accuracy": "fraction?",
    "seconds": "number?",
    "lr": "number?",
    "val_accuracy_raw": "fraction?",
    "val_loss": "number?",
    "peak_memory_mib": "number?",
    "depth_accuracy": "fractions",
    "knots": "counts",
    "steps": "counts",
    "torchcompile": "name?",
}
_TENSOR_NAME = re.compile(r"(model|ema|sources)\..+|ema_rng|optim\.(\d+)\.([A-Za-z_][A-Za-z0-9_]*)")
_PER_PARAMETER = {
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "momentum_buffer",
    "square_avg",
    "acc_delta",
    "sum",
}


RECORDED = (
    "model", "data", "integrator", "steps", "knots", "basis", "backward", "arch", "num_classes",
    "checkpoint", "model_kwargs", "pretrained", "ema", *DATA_CONFIG_FLAGS, "leaf", "deterministic", "teacher",
    "log_interval",
    *TRAIN_AUGMENTATION_KEYS,  # timm train.py's names, argparse dests and Augmentation fields
)  # fmt: skip
"""The command-line settings ``odeify finetune`` records with a run (``run["cli"]``, argparse dests)."""
_RECORDED_TYPES: dict[str, tuple[type, ...]] = {
    "steps": (str, int), "knots": (str, int), "num_classes": (int,), "pretrained": (bool,), "ema": (bool,),
    "deterministic": (bool,), "log_interval": (int,), "input_size": (int,), "leaf": (str,),
    "img_size": (int,),
    "mean": (float,), "std": (float,), "crop_pct": (float,), "no_aug": (bool,), "scale": (float,),
    "ratio": (float,), "hflip": (float,), "vflip": (float,), "color_jitter": (float,), "reprob": (float,),
}  # fmt: skip
"""The types of the recorded command-line settings that are not strings (what argparse produced; of
the items of the lists in _RECORDED_LISTS)."""
_RECORDED_LISTS = ("input_size", "leaf", "mean", "std", "scale", "ratio", "model_kwargs")


class StateError(ConfigError):
    """A training state breaks the schema; the message says which field and what it holds."""


def _expect(ok: bool, problem: str) -> None:
    if not ok:
        raise StateError(problem)


def _is_int(value: object, lo: int = 0, hi: int = 2**63 - 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_record(record: object) -> dict[str, Any]:
    """``record`` if it is a training state's JSON record this odeify can resume; else StateError."""
    _expect(isinstance(record, dict), "the record must be a JSON object")
    version = record.get("version")  # type: ignore[union-attr]
    _expect(_is_int(version, -(2**63)), f"its version must be an integer, not {version!r:.40}")
    _expect(version <= STATE_VERSION, f"it has version {version}: written by a newer odeify; upgrade odeify")
    _expect(version == STATE_VERSION, f"it has version {version}, this odeify reads version {STATE_VERSION}")
    for key in _RECORD_KEYS:
        _expect(key in record, f"it has no {key!r}")  # type: ignore[operator]
    extra = sorted(set(record) - {"version", "started_from", *_RECORD_KEYS})  # type: ignore[arg-type]
    _expect(not extra, f"it has unknown entries {[k[:40] for k in extra[:3]]}")
    epoch, step = record["epoch"], record["step"]  # type: ignore[index]
    _expect(
        _is_int(epoch, 1, MAX_EPOCHS), f"its epoch must be an integer in [1, {MAX_EPOCHS}], not {epoch!r:.40}"
    )
    _expect(_is_int(step), f"its step must be a non-negative integer, not {step!r:.40}")
    _history(record["history"], epoch)  # type: ignore[index]
    _run(record["run"], epoch)  # type: ignore[index]
    _param_groups(record["param_groups"])  # type: ignore[index]
    _scalars(record["optimizer_scalars"])  # type: ignore[index]
    return record  # type: ignore[return-value]


def _history(history: object, epoch: int) -> None:
    _expect(
        isinstance(history, list) and len(history) == epoch + 1,
        f"its history must list the epochs 0 to {epoch}, one entry each",
    )
    for index, entry in enumerate(history):  # type: ignore[arg-type]
        at = f"history entry {index}"
        _expect(
            isinstance(entry, dict) and set(entry) <= set(_HISTORY_FIELDS), f"{at} must be an epoch record"
        )
        _expect({"epoch", "val_accuracy"} <= set(entry), f"{at} has no epoch or val_accuracy")
        _expect(entry["epoch"] == index, f"{at} is for epoch {entry['epoch']!r:.20}, not {index}")
        for key, kind in _HISTORY_FIELDS.items():
            if key in entry:
                _expect(
                    _of_kind(entry[key], kind),
                    f"{at}: {key} must be {_kind_text(kind)}, not {entry[key]!r:.40}",
                )


def _of_kind(value: object, kind: str) -> bool:
    if kind.endswith("?") and value is None:
        return True
    kind = kind.rstrip("?")
    if kind == "int":
        return _is_int(value)
    if kind == "fraction":
        return _is_number(value) and 0 <= value <= 1  # type: ignore[operator]
    if kind == "number":
        return _is_number(value)
    if kind == "name":  # a torch.compile backend, with its mode: printable, no comma (a summary.csv cell)
        return isinstance(value, str) and 0 < len(value) <= 64 and value.isprintable() and "," not in value
    if kind == "fractions":
        return isinstance(value, dict) and all(
            isinstance(k, str) and len(k) <= 16 and _of_kind(v, "fraction") for k, v in value.items()
        )
    return isinstance(value, dict) and all(isinstance(k, str) and _is_int(v, 1) for k, v in value.items())


_KIND_TEXT = {
    "int": "an integer",
    "fraction": "a number in [0, 1]",
    "number": "a finite number",
    "counts": "a map of stage names to positive integers",
    "fractions": "a map of depths to numbers in [0, 1]",
    "name": "a short name without commas",
}


def _kind_text(kind: str) -> str:
    return _KIND_TEXT[kind.rstrip("?")] + (" or null" if kind.endswith("?") else "")


def _run(run: object, epoch: int) -> None:
    _expect(isinstance(run, dict), "its run settings must be an object")
    for key in ("recipe", "refine_at", "seed", "max_batches", "world_size"):
        _expect(key in run, f"its run settings have no {key!r}")  # type: ignore[operator]
    _recipe(run["recipe"], epoch)  # type: ignore[index]
    refine = run["refine_at"]  # type: ignore[index]
    _expect(
        isinstance(refine, list) and all(_is_int(e, 2, MAX_EPOCHS) for e in refine),
        f"its refine_at must be a list of epochs >= 2, not {refine!r:.60}",
    )
    _expect(_is_int(run["seed"]), f"its seed must be a non-negative integer, not {run['seed']!r:.40}")  # type: ignore[index]
    batches = run["max_batches"]  # type: ignore[index]
    _expect(
        batches is None or _is_int(batches, 1),
        f"its max_batches must be a positive integer or null, not {batches!r:.40}",
    )
    _expect(_is_int(run["world_size"], 1, 2**20), "its world_size must be a positive integer")  # type: ignore[index]
    if "cli" in run:  # type: ignore[operator]
        _cli(run["cli"])  # type: ignore[index]


def _cli(recorded: object) -> None:
    """The recorded command-line settings: each of :data:`RECORDED` null or of the type argparse gives."""
    _expect(isinstance(recorded, dict), "its cli settings must be an object")
    for key in RECORDED:
        value = recorded.get(key)  # type: ignore[union-attr]
        _expect(
            value is None or _recorded_ok(key, value),
            f"its cli setting {key} is {value!r:.60}, which the command line never records",
        )


def _recorded_ok(key: str, value: object) -> bool:
    kinds = _RECORDED_TYPES.get(key, (str,))
    if key in _RECORDED_LISTS:
        return isinstance(value, list) and all(type(v) in kinds for v in value)
    return type(value) in kinds


def _recipe(recipe: object, epoch: int) -> None:
    """The recorded Recipe: its fields with their types, valid as a Recipe, with at least ``epoch`` epochs."""
    _expect(isinstance(recipe, dict), "its recipe must be an object")
    known = {f.name: f for f in fields(Recipe)}
    extra = sorted(set(recipe) - set(known))  # type: ignore[arg-type]
    _expect(not extra, f"its recipe has unknown fields {extra[:3]}")
    for name, value in recipe.items():  # type: ignore[union-attr]
        kind = str(known[name].type)  # the annotation's text: 'int', 'str', 'float', 'float | None'
        _expect(
            _of_type(value, kind), f"its recipe's {name} must be {kind.replace('|', 'or')}, not {value!r:.40}"
        )
    try:
        built = Recipe(**recipe)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise StateError(f"its recipe is refused: {exc}") from None
    _expect(
        built.epochs >= epoch, f"its recipe has {built.epochs} epochs but the state is after epoch {epoch}"
    )


def _of_type(value: object, kind: str) -> bool:
    if value is None:
        return "None" in kind
    if kind == "int":
        return _is_int(value, 1)
    if kind == "bool":
        return isinstance(value, bool)
    if kind.startswith("str"):
        return isinstance(value, str)
    return _is_number(value)


def _param_groups(groups: object) -> None:
    _expect(
        isinstance(groups, list) and len(groups) >= 1, "its optimizer param_groups must be a non-empty list"
    )
    seen: list[int] = []
    for index, group in enumerate(groups):  # type: ignore[arg-type]
        params = group.get("params") if isinstance(group, dict) else None
        ok = isinstance(params, list) and all(_is_int(p) for p in params)
        _expect(ok, f"its optimizer param_groups[{index}] must hold a list of parameter indices")
        seen += params  # type: ignore[operator]
    _expect(
        sorted(seen) == list(range(len(seen))),
        "its optimizer groups must number the parameters 0 to n-1 once",
    )


def _scalars(scalars: object) -> None:
    def scalar(x: object) -> bool:
        return x is None or isinstance(x, bool) or _is_number(x)

    def entry(key: object, values: object) -> bool:
        if not (isinstance(key, str) and key.isdigit() and isinstance(values, dict)):
            return False
        return all(isinstance(name, str) and scalar(x) for name, x in values.items())

    ok = isinstance(scalars, dict) and all(entry(k, v) for k, v in scalars.items())
    _expect(ok, "its optimizer_scalars must map parameter indices to {name: number}")


def validate_tensor_names(names: list[str], parameters: int) -> None:
    """Every tensor name is one a training state holds: model.*, ema.*, sources.* (the source tensors
    fine-tuning trains, :mod:`odeify.train.parametrization`), ema_rng, optim.<index>.<name>."""
    for name in names:
        match = _TENSOR_NAME.fullmatch(name)
        _expect(match is not None, f"it holds a tensor named {name!r:.60}, which no training state has")
        if match.group(2) is not None:  # type: ignore[union-attr]
            index = int(match.group(2))  # type: ignore[union-attr]
            _expect(index < parameters, f"its tensor {name} is for parameter {index}, of {parameters}")


def check_tensors(
    state: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    average: nn.Module | None,
    sources: nn.Module | None = None,
) -> None:
    """The state's tensors fit the model, its weight average, its source tensors and its optimizer
    (names, shapes, dtypes)."""
    _same_tensors(state["model"], model.state_dict(), "model")
    if sources is not None:
        _same_tensors(state["sources"], sources.state_dict(), "source")
    if average is not None:
        _same_tensors(state["ema"], average.state_dict(), "weight average")
    groups, mine = state["optimizer"]["param_groups"], optimizer.param_groups
    sizes, own = [len(g["params"]) for g in groups], [len(g["params"]) for g in mine]
    _expect(sizes == own, f"its optimizer has groups of {sizes} parameters, this run's optimizer {own}")
    params = [p for g in mine for p in g["params"]]
    order = [i for g in groups for i in g["params"]]
    for index, values in state["optimizer"]["state"].items():
        param = params[order.index(index)]
        for key, value in values.items():
            if torch.is_tensor(value) and key in _PER_PARAMETER:
                shape = tuple(value.shape)
                _expect(
                    shape == tuple(param.shape),
                    f"its optimizer tensor {key} of parameter {index} has shape {shape}, the parameter "
                    f"{tuple(param.shape)}",
                )


def _same_tensors(saved: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], what: str) -> None:
    missing, extra = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
    _expect(
        not missing and not extra,
        f"its {what} tensors do not match this run's model (missing {missing[:3]}, unexpected {extra[:3]})",
    )
    for key, tensor in own.items():
        theirs = saved[key]
        _expect(
            theirs.shape == tensor.shape and theirs.dtype == tensor.dtype,
            f"its {what} tensor {key} is {theirs.dtype} {tuple(theirs.shape)}, this run's model has "
            f"{tensor.dtype} {tuple(tensor.shape)}",
        )
