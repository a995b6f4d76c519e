"""The data config a file may carry (input size, mean/std, crop, interpolation), checked where it enters.

timm's data pipeline (``timm.data.resolve_model_data_config`` + ``create_transform``) reads these
entries of a model's ``pretrained_cfg``. A checkpoint folder's ``config.json`` and a saved converted
model carry them as data; a zero std, a mean of the wrong length, an input size of 0 or 1e308, an
unknown interpolation or a NaN crop would reach evaluation as a traceback, or as an accuracy near
chance with no word said. :func:`check_data_config` refuses each, naming the entry, wherever a file
is read and before ``odeify.save`` writes one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from odeify.core.errors import ModelLoadError, OdeifyError
from odeify.core.limits import MAX_DATA_CONFIG_BYTES, MAX_IN_CHANS, MAX_NUM_CLASSES, MAX_SIDE

__all__ = [
    "DATA_CONFIG_FLAGS",
    "DATA_CONFIG_KEYS",
    "INTERPOLATIONS",
    "TRAIN_ARGS_KEYS",
    "TRAIN_AUGMENTATION_KEYS",
    "check_data_config",
    "data_config_entries",
    "train_args_data_config",
]

INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos", "random")  # timm's names
CROP_MODES = ("center", "squash", "border")
MAX_CROP = 2.0  # timm's largest crop_pct is 1.15 (volo_d5_512)
MIN_CROP = 0.5  # timm's smallest is 0.875; the resize before the crop is the input size / crop_pct
MEAN_RANGE = (-10.0, 10.0)  # of pixels in [0, 1]; beyond, normalised images are inf or NaN in float32
STD_RANGE = (1e-3, 10.0)  # timm's stds lie in [0.1, 1]; 1e-320 overflows torchvision's 1/std
AA_BOUNDS = {"n": 16, "w": 16, "d": 16, "m": 30, "mmax": 30}
"""The largest numbers an AutoAugment policy string (``--aa``) may hold, by timm's section keys:
RandAugment's ops per image (``n``, timm has 16 ops), AugMix's chains (``w``) and their depth
(``d``), the magnitude and its cap (``m``, ``mmax``, timm's scale is 0..10): each costs work per
image, so a file's ``rand-n100000-m9`` never finished a batch."""
_AA_SECTION = re.compile(r"([a-z]+)(\d+(?:\.\d*)?)")


def _int(lo: int, hi: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _size(v: object) -> bool:  # [C, H, W]
    return (
        isinstance(v, (list, tuple))
        and len(v) == 3
        and _int(1, MAX_IN_CHANS)(v[0])
        and all(_int(1, MAX_SIDE)(x) for x in v[1:])
    )


def _channels(lo: float, hi: float) -> Callable[[object], bool]:
    def check(v: object) -> bool:
        ok = isinstance(v, (list, tuple)) and 1 <= len(v) <= MAX_IN_CHANS and all(_number(x) for x in v)
        return ok and all(lo <= x <= hi for x in v)  # type: ignore[union-attr]

    return check


def _text(limit: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, str) and len(v) <= limit and v.isprintable()


def _crop(v: object) -> bool:
    return _number(v) and MIN_CROP <= v <= MAX_CROP  # type: ignore[operator]


def aa_policy(v: object) -> bool:
    """Whether ``v`` is an AutoAugment policy string whose numbers are within :data:`AA_BOUNDS`."""
    if not _text(100)(v):
        return False
    for section in v.split("-")[1:]:  # type: ignore[union-attr]
        found = _AA_SECTION.fullmatch(section)
        if found and found[1] in AA_BOUNDS and abs(float(found[2])) > AA_BOUNDS[found[1]]:
            return False
    return True


def _pair(lo: float, hi: float) -> Callable[[object], bool]:
    return lambda v: (
        isinstance(v, (list, tuple))
        and len(v) == 2
        and all(_number(x) for x in v)
        and lo < v[0] <= v[1] <= hi
    )


def _fraction(v: object) -> bool:
    return _number(v) and 0 <= v <= 1  # type: ignore[operator]


_AUGMENTATION_CHECKS: dict[str, Callable[[object], bool]] = {
    "no_aug": lambda v: isinstance(v, bool),
    "scale": _pair(0, 1),
    "ratio": _pair(0, 100),
    "hflip": _fraction,
    "vflip": _fraction,
    "color_jitter": lambda v: _number(v) and 0 <= v <= 10,  # type: ignore[operator]
    "aa": aa_policy,
    "reprob": _fraction,
}
TRAIN_AUGMENTATION_KEYS = tuple(_AUGMENTATION_CHECKS)
"""timm train.py's training-augmentation settings (its ``args`` names, which are
``odeify.train.datasets.Augmentation``'s fields): a file that records them says how the source
network was trained, and fine-tuning augments the same way unless told otherwise."""
DATA_CONFIG_FLAGS = ("input_size", "img_size", "mean", "std", "interpolation", "crop_pct")
"""The argparse names of timm's data-config flags (what a fine-tuning run records and resume restores)."""


def _train_augmentation(v: object) -> bool:
    return (
        isinstance(v, Mapping)
        and set(v) <= set(_AUGMENTATION_CHECKS)
        and all(_AUGMENTATION_CHECKS[k](x) for k, x in v.items())
    )


_ARCH = re.compile(r"[A-Za-z0-9_.\-]{1,100}")

_CHECKS: dict[str, tuple[type, Callable[[object], bool], str]] = {
    "architecture": (str, lambda v: isinstance(v, str) and bool(_ARCH.fullmatch(v)), "a timm model name"),
    "tag": (str, _text(64), "a short name"),
    "input_size": (list, _size, f"[C, H, W] with C in [1, {MAX_IN_CHANS}] and H, W in [1, {MAX_SIDE}]"),
    "test_input_size": (list, _size, f"[C, H, W] with C in [1, {MAX_IN_CHANS}] and H, W in [1, {MAX_SIDE}]"),
    "min_input_size": (list, _size, f"[C, H, W] with C in [1, {MAX_IN_CHANS}] and H, W in [1, {MAX_SIDE}]"),
    "fixed_input_size": (bool, lambda v: isinstance(v, bool), "true or false"),
    "interpolation": (str, lambda v: v in INTERPOLATIONS, f"one of {', '.join(INTERPOLATIONS)}"),
    "crop_pct": (float, _crop, f"a number in [{MIN_CROP}, {MAX_CROP}]"),
    "test_crop_pct": (float, _crop, f"a number in [{MIN_CROP}, {MAX_CROP}]"),
    "crop_mode": (str, lambda v: v in CROP_MODES, f"one of {', '.join(CROP_MODES)}"),
    "mean": (
        list,
        _channels(*MEAN_RANGE),
        f"1 to {MAX_IN_CHANS} finite numbers in [{MEAN_RANGE[0]:g}, {MEAN_RANGE[1]:g}], one per channel",
    ),
    "std": (
        list,
        _channels(*STD_RANGE),
        f"1 to {MAX_IN_CHANS} positive finite numbers in [{STD_RANGE[0]:g}, {STD_RANGE[1]:g}], one per "
        "channel",
    ),
    "num_classes": (int, _int(0, MAX_NUM_CLASSES), f"an integer in [0, {MAX_NUM_CLASSES}]"),
    "first_conv": (str, _text(100), "a module name"),
    "classifier": (str, _text(100), "a module name"),
    "pool_size": (
        list,
        lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_int(1, MAX_SIDE)(x) for x in v),
        f"[H, W] in [1, {MAX_SIDE}]",
    ),  # fmt: skip
    "license": (str, _text(200), "a short text"),
    "train_augmentation": (
        dict,
        _train_augmentation,
        "train.py's augmentation settings: no_aug (true/false), scale [lo, hi] in (0, 1], ratio [lo, hi] "
        "in (0, 100], hflip/vflip/reprob in [0, 1], color_jitter in [0, 10], aa (a policy name, its ops n, "
        "width w and depth d at most 16, its magnitude m and mmax at most 30)",
    ),
}
DATA_CONFIG_KEYS: dict[str, type] = {key: kind for key, (kind, _, _) in _CHECKS.items()}
"""The pretrained_cfg entries a file may carry (what timm.data and timm's heads read), with JSON types."""


def data_config_entries(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a model's ``pretrained_cfg`` that a file keeps: known keys whose values have the
    JSON type of :data:`DATA_CONFIG_KEYS` (tuples as lists, ints as floats where a float is meant).

    Entries of other types (None, a tuple of classifier names) are not data config and are left out;
    the values kept are checked by :func:`check_data_config` before they are written.
    """
    out: dict[str, Any] = {}
    for key, kind in DATA_CONFIG_KEYS.items():
        value = cfg.get(key)
        if isinstance(value, tuple):
            value = list(value)
        if isinstance(value, Mapping):  # train_augmentation: its pairs as lists, for JSON
            value = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            out[key] = value
    return out


def check_data_config(
    cfg: object,
    where: str,
    *,
    error: type[OdeifyError] = ModelLoadError,
    tuples: bool = True,
    channels: int | None = None,
) -> dict[str, Any]:
    """``cfg`` (read from a file) if every entry is a known key with a sound value; else ``error``.

    Returns a copy, lists as tuples (as timm holds them) unless ``tuples`` is False. The whole
    config is at most 4 KiB of JSON; mean and std have one entry per input channel (or one for all):
    the config's ``input_size`` channels or the model's own ``channels``.
    """
    if not isinstance(cfg, Mapping):
        raise error(f"{where}: the data config must be an object, not {type(cfg).__name__}")
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if key not in _CHECKS:
            raise error(f"{where}: unknown data config entry {key!r:.60} (known: {', '.join(_CHECKS)})")
        _, check, expected = _CHECKS[key]
        if not check(value):
            raise error(f"{where}: the data config entry {key!r} must be {expected}, not {value!r:.80}")
        out[key] = tuple(value) if tuples and isinstance(value, list) else value
    known = sorted(
        {*([out["input_size"][0]] if "input_size" in out else []), *([channels] if channels else [])}
    )
    for key in ("mean", "std"):
        if key in out and known and len(out[key]) not in (1, *known):
            raise error(
                f"{where}: the data config's {key} has {len(out[key])} entries for inputs of "
                f"{' or '.join(map(str, known))} channel(s); it needs one per channel (or one for all)"
            )
    if (
        len(json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}))
        > MAX_DATA_CONFIG_BYTES
    ):
        raise error(f"{where}: the data config is over {MAX_DATA_CONFIG_BYTES} bytes of JSON")
    return out


TRAIN_ARGS_KEYS = ("input_size", "img_size", "in_chans", "mean", "std", "interpolation", "crop_pct")
"""The entries of timm train.py's ``args`` that say how its images were prepared (timm's
``resolve_data_config`` reads them back with these meanings)."""


def train_args_data_config(args: object, where: str) -> dict[str, Any]:
    """The data config a timm ``train.py`` run recorded in its ``args``, as pretrained_cfg entries.

    As ``timm.data.resolve_data_config`` reads them: ``input_size`` (C, H, W) wins over ``img_size``
    (an int: C from ``in_chans``, else 3); ``mean``/``std`` of one entry apply to every channel;
    unset entries (None, an empty interpolation) are left out, so the architecture's own defaults
    stay, as train.py's did. The augmentation settings it trained with (:data:`TRAIN_AUGMENTATION_KEYS`)
    become the entry ``train_augmentation``. Each value is checked (:func:`check_data_config`).
    """
    recorded = {key: getattr(args, key, None) for key in TRAIN_ARGS_KEYS}
    chans = recorded["in_chans"] if isinstance(recorded["in_chans"], int) else 3
    cfg: dict[str, Any] = {}
    if recorded["input_size"] is not None:
        cfg["input_size"] = _as_list(recorded["input_size"])
    elif recorded["img_size"] is not None:
        size = recorded["img_size"]
        if not _int(1, MAX_SIDE)(size):
            raise ModelLoadError(f"{where}: args.img_size must be one side in pixels, not {size!r:.60}")
        cfg["input_size"] = [chans, size, size]
    channels = cfg.get("input_size", [chans])[0] if isinstance(cfg.get("input_size"), list) else chans
    for key in ("mean", "std"):
        value = recorded[key]
        if value is not None:
            values = _as_list(value)
            cfg[key] = values * channels if isinstance(values, list) and len(values) == 1 else values
    if recorded["interpolation"]:
        cfg["interpolation"] = recorded["interpolation"]
    if recorded["crop_pct"]:
        cfg["crop_pct"] = recorded["crop_pct"]
    augmentation = {
        key: _as_list(getattr(args, key))
        for key in TRAIN_AUGMENTATION_KEYS
        if getattr(args, key, None) is not None
    }
    if augmentation:
        cfg["train_augmentation"] = augmentation
    return check_data_config(cfg, f"{where} ('args')")


def _as_list(value: object) -> object:
    return list(value) if isinstance(value, (list, tuple)) else value
