"""The record a fine-tuning run leaves in its folder, and the resumable training state's format.

After every epoch a run writes, atomically and in this order: the training state
(:data:`STATE_FILE`: model, weight average, optimizer, epoch, step, history and the run's settings in
one safetensors file, no pickles), the model (:data:`LAST_FILE`, readable by ``odeify.load``),
:data:`BEST_FILE` when validation accuracy improved, and :data:`HISTORY_FILE`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from odeify.core.errors import ConfigError
from odeify.core.fileio import atomic_write_bytes
from odeify.train.recipe import Recipe

if TYPE_CHECKING:
    from timm.utils import ModelEmaV3

__all__ = [
    "BEST_FILE",
    "HISTORY_FILE",
    "LAST_FILE",
    "STATE_FILE",
    "STATE_KEY",
    "EpochRecord",
    "check_same_run",
    "ema_rng",
    "read_record",
    "read_run",
    "read_state",
    "require_folder",
    "write_history",
    "write_state",
]

LAST_FILE = "last.safetensors"
BEST_FILE = "best.safetensors"
STATE_FILE = "train_state.safetensors"
HISTORY_FILE = "history.json"
STATE_KEY = "odeify_train_state"
STATE_VERSION = 1


@dataclass
class EpochRecord:
    """One line of a run's history; epoch 0 is the model before fine-tuning (validation only).

    ``val_accuracy`` is the accuracy of the model the run returns and saves: the weight average when
    the recipe keeps one, whose last step's weights then score ``val_accuracy_raw`` (else None).
    """

    epoch: int
    val_accuracy: float
    train_loss: float | None = None
    train_accuracy: float | None = None
    seconds: float | None = None
    lr: float | None = None
    val_accuracy_raw: float | None = None
    knots: dict[str, int] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)


class TrainingRun(Protocol):
    """What :func:`write_state` reads of a run: the model, the source tensors its optimizer trains
    (``odeify.train.parametrization``), its weight average, optimizer, step count."""

    model: nn.Module
    sources: nn.Module
    ema: ModelEmaV3 | None
    optimizer: torch.optim.Optimizer
    step: int


def write_state(path: Path, run: TrainingRun, epoch: int, history: list[EpochRecord], settings: dict) -> None:
    """Model, weight average and optimizer tensors and a JSON record in one safetensors file (no pickles).

    ``run`` is what trains (its ``model``, ``ema``, ``optimizer`` and ``step``); ``settings`` the run's
    recorded settings, which a resume must match.
    """
    tensors = _prefixed("model.", run.model) | _prefixed("sources.", run.sources)
    if run.ema is not None:
        tensors |= _prefixed("ema.", run.ema.module)
        rng = ema_rng(run.ema)
        if rng is not None:
            tensors["ema_rng"] = rng.get_state()
    optimizer = run.optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in optimizer["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optim.{index}.{key}"] = value.detach().cpu().clone()
            else:
                scalars.setdefault(str(index), {})[key] = value
    record = {
        "version": STATE_VERSION,
        "epoch": epoch,
        "step": run.step,
        "history": [asdict(r) for r in history],
        "run": settings,
        "param_groups": optimizer["param_groups"],
        "optimizer_scalars": scalars,
    }
    data = safetensors.torch.save(tensors, metadata={STATE_KEY: json.dumps(record)})
    atomic_write_bytes(path, data)


def write_history(path: Path, history: list[EpochRecord]) -> None:
    """The run's history as JSON, one record per epoch (epoch 0: before fine-tuning)."""
    atomic_write_bytes(path, json.dumps([asdict(r) for r in history], indent=1).encode())


def _prefixed(prefix: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict on the CPU, each name under ``prefix`` (one file holds several)."""
    return {prefix + k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _unprefixed(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict :func:`_prefixed` wrote under ``prefix``."""
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def read_record(path: Path) -> dict:
    """The JSON record of the training state at ``path`` (epoch, history, run; no tensors read)."""
    if not path.is_file():
        raise ConfigError(
            f"cannot resume: {path} does not exist. --resume continues a run whose --out folder holds the "
            f"{STATE_FILE} written after each epoch; start without --resume to begin a new run."
        )
    try:
        with safe_open(str(path), framework="pt") as handle:
            record = json.loads((handle.metadata() or {})[STATE_KEY])
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise ConfigError(
            f"cannot resume: {path} is not a training state written by odeify finetune ({exc})."
        ) from exc
    if not isinstance(record, dict) or record.get("version") != STATE_VERSION:
        version = record.get("version") if isinstance(record, dict) else None
        raise ConfigError(
            f"cannot resume: {path} has training-state version {version}, this odeify reads version "
            f"{STATE_VERSION}."
        )
    record["run"] = _with_recipe_defaults(record["run"])
    return record


def read_state(path: Path) -> dict:
    """The training state at ``path`` as plain dicts: model, average and optimizer state dicts, epoch, run."""
    record = read_record(path)
    try:
        tensors = safetensors.torch.load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise ConfigError(
            f"cannot resume: {path} is not a training state written by odeify finetune ({exc})."
        ) from exc
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, values in record["optimizer_scalars"].items():
        state.setdefault(int(index), {}).update(values)
    record["model"] = _unprefixed("model.", tensors)
    record["sources"] = _unprefixed("sources.", tensors)
    record["ema"] = _unprefixed("ema.", tensors)
    record["ema_rng"] = tensors.get("ema_rng")
    record["optimizer"] = {"state": state, "param_groups": record["param_groups"]}
    return record


def read_run(folder: str | os.PathLike[str]) -> dict:
    """The settings recorded with the run in ``folder`` (its ``run_info`` plus recipe, seed, refine_at)."""
    return read_record(Path(folder) / STATE_FILE)["run"]


def _with_recipe_defaults(run: dict) -> dict:
    """``run`` with the Recipe fields added since it was recorded, at their defaults.

    A run recorded before a field existed (``ema_decay``) ran as that field's default does, so it
    resumes as the same run instead of being refused as a different one.
    """
    recipe = run.get("recipe") if isinstance(run, dict) else None
    if not isinstance(recipe, dict):
        return run
    return {**run, "recipe": {**_jsonable(asdict(Recipe())), **recipe}}


def require_folder(folder: Path | None) -> Path:
    if folder is None:
        raise ConfigError("resume=True needs out=: the folder of the run to continue.")
    return folder


def check_same_run(recorded: dict, current: dict, folder: Path | None) -> None:
    """Refuse to resume with settings that differ from the recorded run's (it would not be that run)."""
    differing = sorted(k for k in {*recorded, *current} if recorded.get(k) != _jsonable(current.get(k)))
    if differing:
        detail = "; ".join(f"{k}: recorded {recorded.get(k)!r}, now {current.get(k)!r}" for k in differing)
        raise ConfigError(
            f"cannot resume {folder}: the settings differ from the recorded run ({detail}). Resume with the "
            "recorded settings, or start a new run in another --out folder."
        )


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


def ema_rng(ema: ModelEmaV3) -> torch.Generator | None:
    """The RNG of timm's stochastic rounding of bfloat16 averages (recent timm): saved for an exact resume."""
    return getattr(ema, "_sr_generator", None)
