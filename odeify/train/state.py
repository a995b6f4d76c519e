"""The record a fine-tuning run leaves in its folder, and the resumable training state's format.

After every epoch a run writes, atomically and in this order: the training state
(:data:`STATE_FILE`: model, weight average, optimizer, epoch, step, history, the run's settings and
what it started from, in one safetensors file, no pickles), then the epoch's outputs
(:func:`write_epoch_outputs`): the model (:data:`LAST_FILE`, readable by ``odeify.load``),
:data:`BEST_FILE` when validation accuracy improved, and :data:`HISTORY_FILE`. A run killed between
the state and its outputs is finished by ``--resume``, which writes the outputs of the state's epoch
again before it continues (:func:`finish_epoch_outputs`).

The state is read with the discipline of a saved model's recipe (:mod:`odeify.train.state_schema`).
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
from torch import nn

from odeify.core.errors import ConfigError
from odeify.core.fileio import atomic_write_bytes, read_header, read_json, read_tensors, remove_stale_temps
from odeify.core.limits import MAX_STATE_BYTES
from odeify.core.lock import check_free
from odeify.core.paths import input_file
from odeify.serialization.io import save
from odeify.train.recipe import Recipe
from odeify.train.state_schema import STATE_VERSION, StateError, validate_record, validate_tensor_names

if TYPE_CHECKING:
    from timm.utils import ModelEmaV3

__all__ = [
    "BEST_FILE",
    "HISTORY_FILE",
    "LAST_FILE",
    "STATE_FILE",
    "STATE_KEY",
    "SUMMARY_FILE",
    "EpochRecord",
    "check_same_run",
    "ema_rng",
    "finish_epoch_outputs",
    "read_record",
    "read_run",
    "read_state",
    "require_folder",
    "write_epoch_outputs",
    "write_history",
    "write_state",
    "write_summary",
]

LAST_FILE = "last.safetensors"
BEST_FILE = "best.safetensors"
STATE_FILE = "train_state.safetensors"
HISTORY_FILE = "history.json"
SUMMARY_FILE = "summary.csv"
STATE_KEY = "odeify_train_state"
RUN_FILES = (STATE_FILE, LAST_FILE, BEST_FILE, HISTORY_FILE, SUMMARY_FILE)
SUMMARY_COLUMNS = (
    "epoch", "train_loss", "train_top1", "eval_loss", "eval_top1", "eval_top1_raw", "lr", "seconds",
    "peak_memory_mib",
)  # fmt: skip
"""summary.csv's columns: timm train.py's names (eval_loss, eval_top1 in percent, lr) and the rest of
an epoch record (train_top1 in percent, eval_top1_raw: the last step's weights when a weight average
is kept, seconds: the epoch's training time, peak_memory_mib: its peak memory, CUDA's max allocated
or the process's peak resident memory on the CPU: :mod:`odeify.train.peak_memory`); a run with
``Recipe.depths`` adds ``eval_top1_<depth>`` for each listed depth (eval_top1 is then the worst); a
run compiled in any epoch adds ``torchcompile``, each epoch's backend (``inductor:max-autotune`` with
a mode), empty where it ran eagerly."""


@dataclass
class EpochRecord:
    """One line of a run's history; epoch 0 is the model before fine-tuning (validation only).

    ``val_accuracy`` (and ``val_loss``, the mean cross-entropy) is the accuracy of the model the run
    returns and saves: the weight average when the recipe keeps one, whose last step's weights then
    score ``val_accuracy_raw`` (else None). ``lr`` is the learning rate of the epoch's last step;
    ``peak_memory_mib`` the peak memory of its training (:mod:`odeify.train.peak_memory`).
    ``depth_accuracy``: with ``Recipe.depths``, the returned model's accuracy at each listed depth
    (``val_accuracy`` is then the worst of them: :mod:`odeify.train.depths`). ``torchcompile``: the
    ``torch.compile`` backend (and mode) the epoch trained and validated with, None when eager
    (:mod:`odeify.train.torch_compile`; a resumed run may change it).
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
    val_loss: float | None = None
    peak_memory_mib: float | None = None
    depth_accuracy: dict[str, float] = field(default_factory=dict)
    torchcompile: str | None = None


class TrainingRun(Protocol):
    """What :func:`write_state` reads of a run: the model, the source tensors its optimizer trains
    (``odeify.train.parametrization``), its weight average, optimizer, step count."""

    model: nn.Module
    sources: nn.Module
    ema: ModelEmaV3 | None
    optimizer: torch.optim.Optimizer
    step: int


def write_state(
    path: Path,
    run: TrainingRun,
    epoch: int,
    history: list[EpochRecord],
    settings: dict,
    started_from: Mapping[str, Any] | None = None,
) -> None:
    """Model, weight average and optimizer tensors and a JSON record in one safetensors file (no pickles).

    ``run`` is what trains (its ``model``, ``ema``, ``optimizer`` and ``step``); ``settings`` the run's
    recorded settings, which a resume must match; ``started_from`` the fingerprint of the model,
    teacher and data the run began with (:mod:`odeify.train.fingerprint`).
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
                tensors[f"optim.{index}.{key}"] = value.detach().cpu().contiguous().clone()
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
        "started_from": started_from,
    }
    data = safetensors.torch.save(tensors, metadata={STATE_KEY: json.dumps(record)})
    atomic_write_bytes(path, data)


def write_history(path: Path, history: list[EpochRecord]) -> None:
    """The run's history as JSON, one record per epoch (epoch 0: before fine-tuning)."""
    atomic_write_bytes(path, json.dumps([asdict(r) for r in history], indent=1).encode())


def write_summary(path: Path, history: list[EpochRecord]) -> None:
    """The run's history as a CSV like timm's ``summary.csv``: one row per epoch (:data:`SUMMARY_COLUMNS`)."""

    def cell(value: float | None, scale: float = 1.0) -> str:  # 8 significant digits: no float noise
        return "" if value is None else f"{value * scale:.8g}"  # 34.7, not 34.699999999999996

    depths = list(dict.fromkeys(label for r in history for label in r.depth_accuracy))
    compiled = any(r.torchcompile is not None for r in history)
    extra = ["torchcompile"] if compiled else []
    rows = [",".join([*SUMMARY_COLUMNS, *(f"eval_top1_{label}" for label in depths), *extra])]
    for r in history:
        values = [cell(r.train_loss), cell(r.train_accuracy, 100), cell(r.val_loss)]
        values += [cell(r.val_accuracy, 100), cell(r.val_accuracy_raw, 100), cell(r.lr), cell(r.seconds)]
        values += [cell(r.peak_memory_mib)]
        values += [cell(r.depth_accuracy.get(label), 100) for label in depths]
        values += [r.torchcompile or ""] if compiled else []
        rows.append(",".join([str(r.epoch), *values]))
    atomic_write_bytes(path, ("\n".join(rows) + "\n").encode())


def write_epoch_outputs(folder: Path, model: nn.Module, history: list[EpochRecord]) -> None:
    """What follows the state after an epoch: ``last``, ``best`` if that epoch improved, the history
    (JSON and CSV)."""
    save(model, folder / LAST_FILE)
    if history[-1].val_accuracy > max(h.val_accuracy for h in history[:-1]):
        save(model, folder / BEST_FILE)
    write_history(folder / HISTORY_FILE, history)
    write_summary(folder / SUMMARY_FILE, history)


def finish_epoch_outputs(folder: Path, model: nn.Module, history: list[EpochRecord]) -> list[Path]:
    """Finish the write sequence of the state's epoch, which a kill may have cut short; returns the
    temporary files of killed writers that were removed.

    The outputs are written again from the state (the same bytes when they were complete), so a
    run killed after its state and before ``last``/``best``/``history`` resumes with all of them.
    """
    removed = [p for name in RUN_FILES for p in remove_stale_temps(folder / name)]
    write_epoch_outputs(folder, model, history)
    return removed


def _prefixed(prefix: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict on the CPU (contiguous: a channels-last run's too), each name under
    ``prefix`` (one file holds several)."""
    return {prefix + k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}


def _unprefixed(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict :func:`_prefixed` wrote under ``prefix``."""
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def _cannot_resume(path: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"cannot resume: {path}: {problem}; the file is damaged or was not written by odeify finetune."
    )


def read_record(path: Path) -> dict:
    """The JSON record of the training state at ``path`` (epoch, history, run; no tensors read), validated."""
    try:
        path = input_file(path, "the training state", error=ConfigError, example=STATE_FILE)
    except ConfigError as exc:
        raise ConfigError(
            f"cannot resume: {exc}. --resume continues a run whose --out folder holds the {STATE_FILE} "
            "written after each epoch; start without --resume to begin a new run."
        ) from None
    try:
        header = read_header(path, ConfigError, "a training state written by odeify finetune")
        record = read_json(
            header.metadata.get(STATE_KEY), str(path), ConfigError, MAX_STATE_BYTES, "its record"
        )
    except ConfigError as exc:
        raise ConfigError(f"cannot resume: {exc}.") from None
    try:
        record = validate_record(record)
    except StateError as exc:
        raise _cannot_resume(path, str(exc)) from None
    record["run"] = _with_recipe_defaults(record["run"])
    return record


def read_state(path: Path) -> dict:
    """The training state at ``path`` as plain dicts: model, average and optimizer state dicts, epoch, run."""
    record = read_record(path)
    tensors = read_tensors(path, ConfigError, "a training state")
    parameters = sum(len(group["params"]) for group in record["param_groups"])
    try:
        validate_tensor_names(list(tensors), parameters)
        validate_tensor_names([f"optim.{i}.scalar" for i in record["optimizer_scalars"]], parameters)
    except StateError as exc:
        raise _cannot_resume(path, str(exc)) from None
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
    """The settings recorded with the run in ``folder`` (its ``run_info`` plus recipe, seed, refine_at);
    refused while a live run holds the folder (its first epoch has written nothing yet)."""
    check_free(Path(folder))
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


def check_same_run(
    recorded: dict,
    current: dict,
    folder: Path | None,
    *,
    growing: tuple[str, ...] = (),
    free: tuple[str, ...] = (),
) -> None:
    """Refuse to resume with settings that differ from the recorded run's (it would not be that run),
    naming each setting that differs (``recipe.lr``, ``cli.data``); the settings ``growing`` names
    may be larger than recorded (``recipe.epochs``: a finished run trained further), those ``free``
    names may differ (``cli.log_interval``: how often progress is shown)."""
    differing = [
        (key, old, new)
        for key, old, new in _differences(recorded, _jsonable(current))
        if key not in free
        and not (key in growing and isinstance(old, int) and isinstance(new, int) and new > old)
    ]
    if differing:
        detail = "; ".join(f"{key}: recorded {old!r:.80}, now {new!r:.80}" for key, old, new in differing)
        raise ConfigError(
            f"cannot resume {folder}: the settings differ from the recorded run ({detail}). Resume with the "
            "recorded settings, or start a new run in another --out folder."
        )


def _differences(recorded: Any, current: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, recorded value, current value) for each leaf setting that differs."""
    if not (isinstance(recorded, dict) and isinstance(current, dict)):
        return [] if recorded == current else [(prefix.rstrip("."), recorded, current)]
    found = []
    for key in sorted({*recorded, *current}):
        found += _differences(recorded.get(key), current.get(key), f"{prefix}{key}.")
    return found


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


def ema_rng(ema: ModelEmaV3) -> torch.Generator | None:
    """The RNG of timm's stochastic rounding of bfloat16 averages (recent timm): saved for an exact resume."""
    return getattr(ema, "_sr_generator", None)
