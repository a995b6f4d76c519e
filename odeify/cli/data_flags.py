"""What timm's data-config flags do: ``--input-size``/``--img-size``, ``--mean``, ``--std``,
``--interpolation`` and ``--crop-pct``.

A model's data config (the input size it was trained at, its normalisation, its evaluation crop)
comes from its file: a train.py checkpoint's ``args``, a Hugging Face folder's ``config.json``, a
converted file's ``pretrained_cfg`` (:mod:`odeify.models.checkpoints`). A flag replaces one entry:
on ``convert`` the size a MODEL is traced and verified at, recorded in the saved file with the
other entries; on ``eval``, ``sweep`` and ``finetune`` the images' preparation too (and what a run's
saved models record). When a flag's input size replaces another one the file records, one warning
names both.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from torch import nn

from odeify.core.budget import check_input_bytes
from odeify.core.errors import ConfigError
from odeify.models.data_config import check_data_config
from odeify.models.timm_interface import default_input_size

__all__ = ["apply_data_config", "check_size_flags", "flag_entries", "trace_size"]


def check_size_flags(args: argparse.Namespace) -> None:
    """--input-size is C H W or N C H W of positive numbers within the input budget; not with --img-size."""
    size, side = getattr(args, "input_size", None), getattr(args, "img_size", None)
    if size is not None and side is not None:
        raise ConfigError(
            f"--input-size {' '.join(map(str, size))} and --img-size {side} both set the input size; "
            "give one (--img-size S means --input-size C S S with the model's channel count C)."
        )
    if size is None:
        return
    if len(size) not in (3, 4):
        raise ConfigError(
            f"--input-size takes C H W or N C H W (e.g. --input-size 3 224 224); got {len(size)} "
            f"number(s): {' '.join(map(str, size))}."
        )
    if any(n < 1 for n in size):
        raise ConfigError(f"--input-size takes positive numbers; got {' '.join(map(str, size))}.")
    check_input_bytes("--input-size", tuple(size) if len(size) == 4 else (1, *size), 4)


def trace_size(args: argparse.Namespace, model: nn.Module | None) -> list[int] | None:
    """The example input's size the flags ask for (None: the model's data config decides).

    ``--img-size S`` takes the channel count from ``model`` (needed then): the input it was converted
    at, else its timm config (``in_chans`` first)."""
    check_size_flags(args)
    side = getattr(args, "img_size", None)
    if side is None:
        return getattr(args, "input_size", None)
    channels = _channels(model) if model is not None else 3
    check_input_bytes("--img-size", (1, channels, side, side), 4)
    return [1, channels, side, side]


def flag_entries(args: argparse.Namespace, model: nn.Module) -> dict[str, Any]:
    """The pretrained_cfg entries the flags set, checked (input_size as [C, H, W])."""
    size = trace_size(args, model)
    entries: dict[str, Any] = {"input_size": list(size[-3:])} if size is not None else {}
    for key in ("mean", "std", "interpolation", "crop_pct"):
        if getattr(args, key, None) is not None:
            entries[key] = getattr(args, key)
    channels = entries["input_size"][0] if "input_size" in entries else _channels(model)
    cfg = getattr(model, "pretrained_cfg", None)
    averaged = []
    for key in ("mean", "std"):  # one value means: the same for every channel (timm's reading)
        if key in entries and len(entries[key]) == 1:
            entries[key] = entries[key] * channels
        recorded = cfg.get(key) if isinstance(cfg, dict) and key not in entries else None
        if isinstance(recorded, (list, tuple)) and recorded and len(recorded) not in (1, channels):
            entries[key] = [sum(recorded) / len(recorded)] * channels
            averaged.append(f"{key} {entries[key][0]:.4g} (of {len(recorded)})")
    if averaged:
        warnings.warn(
            f"the model's data config has a mean and std for other channels than the {channels} the model "
            f"takes: their averages are used for each channel ({', '.join(averaged)}; as timm adapts an "
            "RGB stem to other channels). Pass --mean and --std to set them.",
            UserWarning,
            stacklevel=2,
        )
    return check_data_config(
        entries, "the data-config flags", error=ConfigError, tuples=False, channels=channels
    )


def apply_data_config(model: nn.Module, args: argparse.Namespace, *, recorded: str | None) -> nn.Module:
    """``model`` with the flags' entries over its data config (its ``pretrained_cfg``).

    ``recorded`` names the file the model's own data config came from: when the flags' input size
    replaces another one, a warning names both. None (a timm name, whose config is the
    architecture's default; a converted file, evaluated at another size than it was traced at, gets
    the data pipeline's own warning): no warning."""
    entries = flag_entries(args, model)
    cfg = getattr(model, "pretrained_cfg", None)
    if not entries or not isinstance(cfg, dict):
        return model
    before = cfg.get("input_size")
    after = entries.get("input_size")
    if recorded and after is not None and before is not None and list(before) != after:
        flag = "--img-size" if getattr(args, "img_size", None) is not None else "--input-size"
        warnings.warn(
            f"the data config of {recorded} (what the file records, else timm's default for its "
            f"architecture) gives the input size {_shape(before)}; {flag} gives {_shape(after)}, which "
            f"is used instead (and recorded in what is saved). If the model was trained at "
            f"{_shape(before)}, leave {flag} out.",
            UserWarning,
            stacklevel=2,
        )
    model.pretrained_cfg = {**cfg, **entries}
    return model


def _channels(model: nn.Module) -> int:
    """The channels ``model`` takes: those it was converted (traced and verified) at, else timm's config's."""
    traced = getattr(model, "meta", {}).get("odeify", {}).get("input_shape")
    return int(traced[1]) if traced else default_input_size(model)[1]


def _shape(size: object) -> str:
    return "x".join(map(str, size))  # type: ignore[call-overload]
