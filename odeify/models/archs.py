"""Architecture names -> freshly built modules (random weights): timm's names plus odeify's own.

A name is a timm model name (``"resnet50"``, with or without a pretrained tag such as
``".a1_in1k"``) or an odeify arch (``"odeify.digits_resnet"``). Weights are loaded elsewhere
(:mod:`odeify.models.loading`, :mod:`odeify.models.checkpoints`); this module builds, and says which
constructor kwargs a *file* may ask for (:func:`check_file_kwargs`): a checkpoint or a saved model
is data, and data must not make timm read other files, fetch from the network, or build something
enormous.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import timm
import torch
from timm.models import get_model_args
from torch import nn

from odeify.core.errors import ModelLoadError, did_you_mean
from odeify.core.limits import MAX_IN_CHANS, MAX_NUM_CLASSES, MAX_SIDE
from odeify.models.digits import DIGITS_ARCH, digits_resnet

__all__ = [
    "HUB_PREFIXES",
    "ODEIFY_ARCHS",
    "ArchSpec",
    "arch_spec",
    "build_arch",
    "check_arch_name",
    "check_file_kwargs",
    "default_cfg",
    "guess_arch",
    "is_arch_name",
    "unknown_name_error",
]

ODEIFY_ARCHS: dict[str, Callable[..., nn.Module]] = {DIGITS_ARCH: digits_resnet}
HUB_PREFIXES = ("hf-hub:", "hf_hub:", "local-dir:")  # timm names that fetch a config before building
ArchSpec = tuple[str, dict[str, Any]]
"""``(name, kwargs)``: what rebuilds an architecture, as JSON-able data."""


def is_arch_name(name: str) -> bool:
    """True for names odeify or timm can build (timm pretrained tags such as ``.a1_in1k`` included)."""
    return name in ODEIFY_ARCHS or name.startswith(HUB_PREFIXES) or timm.is_model(name)


def unknown_name_error(name: str) -> ModelLoadError:
    """An error naming the closest timm/odeify names and the checkpoint-file alternative."""
    candidates = [*timm.list_models(), *ODEIFY_ARCHS]
    hint = did_you_mean(name, candidates, n=5)
    return ModelLoadError(
        f"unknown model {name!r}: not a timm model name nor an odeify arch.{hint} "
        f"See timm.list_models('{name[:4]}*') for names; a path to a local checkpoint file "
        f"(.safetensors/.pth/.pth.tar/.pt/.bin) or a Hugging Face-style model folder works too."
    )


_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")


def check_arch_name(name: object, where: str) -> str:
    """``name`` if it is a buildable local architecture name (no hub or folder names), else an error."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ModelLoadError(f"{where}: the architecture must be a name like 'resnet50', not {name!r:.80}")
    if not (name in ODEIFY_ARCHS or timm.is_model(name)):
        raise unknown_name_error(name)
    return name


def build_arch(name: str, kwargs: Mapping[str, Any], *, device: str | None = None) -> nn.Module:
    """Build ``name`` with random weights and constructor ``kwargs``; every failure is a ModelLoadError.

    ``device="meta"`` builds without allocating memory (to read shapes and defaults cheaply).
    """
    if name.startswith(HUB_PREFIXES):
        raise ModelLoadError(
            f"{name!r} names a model on the hub or in a folder: its architecture is only known after "
            f"reading that config. Pass the folder itself (load_model('path/to/folder')), or the timm "
            f"architecture name (e.g. 'resnet50') with local weights via checkpoint=."
        )
    if not is_arch_name(name):
        raise unknown_name_error(name)
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            if name in ODEIFY_ARCHS:
                return ODEIFY_ARCHS[name](**kwargs)
            return timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as exc:
        raise ModelLoadError(f"cannot build {name!r} with kwargs {dict(kwargs)}: {exc}") from exc
    except (RuntimeError, ValueError, AssertionError, KeyError) as exc:  # bad tag, bad sizes, ...
        raise ModelLoadError(f"timm cannot build {name!r} with kwargs {dict(kwargs)}: {exc}") from exc


def default_cfg(name: str) -> dict[str, Any]:
    """The pretrained config (classifier, first_conv, input size, ...) of ``name`` built with defaults."""
    model = build_arch(name, {}, device="meta")
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return dict(cfg)


def arch_spec(model: nn.Module) -> ArchSpec:
    """The ``(name, kwargs)`` that rebuild ``model``'s architecture; a ModelLoadError says why there is none.

    The name comes from timm's ``pretrained_cfg["architecture"]``, the kwargs from
    :func:`timm.models.get_model_args` (what the model was built with, updated for later changes
    such as ``reset_classifier``) plus its drop rates, which shape training. The kwargs must be ones a
    file may carry (:func:`check_file_kwargs`), and building them (on the meta device) must give the
    same class with the same tensors: a timm model changed after it was built cannot be rebuilt by name.
    """
    what = type(model).__name__
    cfg = getattr(model, "pretrained_cfg", None)
    name = cfg.get("architecture") if isinstance(cfg, Mapping) else None
    if not isinstance(name, str) or not (name in ODEIFY_ARCHS or timm.is_model(name)):
        raise ModelLoadError(
            f"{what} is not a timm or odeify architecture (no known pretrained_cfg['architecture'])"
        )
    try:
        kwargs = get_model_args(model)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{what}: timm cannot list the kwargs it was built with ({exc})") from exc
    drops = {k: v for k, v in getattr(model, "_model_args", {}).items() if k.endswith("drop_rate")}
    kwargs = check_file_kwargs({**kwargs, **drops}, f"{name!r}")
    built = build_arch(name, kwargs, device="meta")
    tensors = _shapes(built.state_dict(), skip="\0") == _shapes(model.state_dict(), skip="\0")
    if type(built) is not type(model) or not tensors:
        raise ModelLoadError(f"{what} differs from the {name!r} that {kwargs} builds (changed after it)")
    return name, kwargs


# ---------------------------------------------------------------------------------------------------
# Constructor kwargs a file may set: an allowlist with ranges.

_FORBIDDEN = {
    "checkpoint_path": "it makes timm read another file",
    "pretrained": "it downloads weights",
    "pretrained_cfg": "it can point timm at other files or hub repositories",
    "pretrained_cfg_overlay": "it can point timm at other files or hub repositories",
    "cache_dir": "it names a folder to read",
    "features_only": "it changes what the model returns",
}


def _int(lo: int, hi: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _rate(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1


def _ints(max_len: int, lo: int, hi: int, max_sum: int) -> Callable[[object], bool]:
    def check(v: object) -> bool:
        ok = isinstance(v, (list, tuple)) and 1 <= len(v) <= max_len and all(_int(lo, hi)(x) for x in v)
        return ok and sum(v) <= max_sum  # type: ignore[arg-type]

    return check


def _one_of(*options: object) -> Callable[[object], bool]:
    return lambda v: any(type(v) is type(o) and v == o for o in options)


def _size(v: object) -> bool:
    pair = isinstance(v, (list, tuple)) and len(v) == 2 and all(_int(1, MAX_SIDE)(x) for x in v)
    return pair or _int(1, MAX_SIDE)(v)


def _positive(hi: float) -> Callable[[object], bool]:
    def check(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v <= hi

    return check


def _or_none(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or check(v)


_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _layer_name(v: object) -> bool:  # timm resolves these through its own name tables (no imports)
    return isinstance(v, str) and bool(_IDENTIFIER.fullmatch(v))


_FILE_KWARGS: dict[str, tuple[Callable[[object], bool], str]] = {
    "num_classes": (_int(0, MAX_NUM_CLASSES), f"an integer in [0, {MAX_NUM_CLASSES}]"),
    "in_chans": (_int(1, MAX_IN_CHANS), f"an integer in [1, {MAX_IN_CHANS}]"),
    "global_pool": (
        _one_of("", "avg", "max", "avgmax", "catavgmax", "fast", "fastavg", "fastmax", "token", "map"),
        "a timm pooling name such as 'avg'",
    ),
    "drop_rate": (_rate, "a rate in [0, 1)"),
    "drop_path_rate": (_rate, "a rate in [0, 1)"),
    "drop_block_rate": (_rate, "a rate in [0, 1)"),
    "proj_drop_rate": (_rate, "a rate in [0, 1)"),
    "attn_drop_rate": (_rate, "a rate in [0, 1)"),
    "zero_init_last": (_one_of(True, False), "true or false"),
    "output_stride": (_one_of(8, 16, 32), "8, 16 or 32"),
    "layers": (_ints(8, 1, 64, 256), "at most 8 block counts in [1, 64], 256 blocks in all"),
    "depths": (_ints(8, 1, 64, 256), "at most 8 block counts in [1, 64], 256 blocks in all"),
    "channels": (_ints(8, 1, 4096, 16384), "at most 8 widths in [1, 4096]"),
    "dims": (_ints(8, 1, 4096, 16384), "at most 8 widths in [1, 4096]"),
    "stem_width": (_int(1, 1024), "an integer in [1, 1024]"),
    "stem_type": (_one_of("", "deep", "deep_tiered", "tiered", "patch", "overlap"), "a timm stem type"),
    "img_size": (_size, f"an integer or [H, W] in [1, {MAX_SIDE}]"),
    "cardinality": (_int(1, 1024), "an integer in [1, 1024]"),
    "base_width": (_int(1, 1024), "an integer in [1, 1024]"),
    "avg_down": (_one_of(True, False), "true or false"),
    "down_kernel_size": (_int(1, 7), "an integer in [1, 7]"),
    "block_reduce_first": (_int(1, 4), "an integer in [1, 4]"),
    "act_layer": (_layer_name, "a timm layer name such as 'relu'"),
    "norm_layer": (_layer_name, "a timm layer name such as 'batchnorm2d'"),
    "attn_layer": (_layer_name, "a timm layer name such as 'se'"),
    # the Vision Transformer family (ViT, DeiT, EVA, BEiT, CaiT): one stack of `depth` blocks
    "patch_size": (_size, f"an integer or [H, W] in [1, {MAX_SIDE}]"),
    "depth": (_int(1, 64), "an integer in [1, 64]"),
    "embed_dim": (_int(1, 4096), "an integer in [1, 4096]"),
    "num_heads": (_int(1, 64), "an integer in [1, 64]"),
    "mlp_ratio": (_positive(16), "a number in (0, 16]"),
    "init_values": (_or_none(_positive(1)), "null or a LayerScale init in (0, 1]"),
    "reg_tokens": (_int(0, 16), "an integer in [0, 16]"),
    "class_token": (_one_of(True, False), "true or false"),
    "no_embed_class": (_one_of(True, False), "true or false"),
    "qkv_bias": (_one_of(True, False), "true or false"),
    "qk_norm": (_one_of(True, False), "true or false"),
    "pre_norm": (_one_of(True, False), "true or false"),
    "final_norm": (_one_of(True, False), "true or false"),
    "fc_norm": (_one_of(True, False, None), "true, false or null"),
    "pos_drop_rate": (_rate, "a rate in [0, 1)"),
    "patch_drop_rate": (_rate, "a rate in [0, 1)"),
}


def check_file_kwargs(kwargs: object, where: str) -> dict[str, Any]:
    """``kwargs`` read from a file, checked against the allowlist (a ModelLoadError names the first bad one).

    Only architecture kwargs with bounded values pass: nothing that makes timm read a path, fetch
    from the hub, or build more than a few hundred blocks. Pass anything else yourself, in code.
    """
    if not isinstance(kwargs, Mapping):
        raise ModelLoadError(f"{where}: the build kwargs must be a JSON object, not {type(kwargs).__name__}")
    for key, value in kwargs.items():
        if key in _FORBIDDEN:
            raise ModelLoadError(
                f"{where}: the build kwarg {key!r} is refused in a file ({_FORBIDDEN[key]}); "
                f"odeify only takes bounded architecture settings from files"
            )
        if key not in _FILE_KWARGS:
            raise ModelLoadError(
                f"{where}: the build kwarg {key!r} is not one odeify takes from a file (allowed: "
                f"{', '.join(sorted(_FILE_KWARGS))}). If you trust it, pass it yourself: "
                f"load_model(..., {key}=...)"
            )
        check, expected = _FILE_KWARGS[key]
        if not check(value):
            raise ModelLoadError(f"{where}: the build kwarg {key!r} must be {expected}, not {value!r:.80}")
    return dict(kwargs)


# ---------------------------------------------------------------------------------------------------
# Which common architecture does a bare state dict fit?

# (a key every state dict of the family has, its common members: odeify's own, then the most used)
GUESS_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        r"layer1\.0\.conv1\.weight",
        (DIGITS_ARCH, "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnet50d", "resnet18d",
         "resnet34d", "resnet26", "resnet10t", "resnext50_32x4d", "wide_resnet50_2", "seresnet50"),
    ),
    (r"stages\.0\.blocks\.0\.conv_dw\.weight", ("convnext_tiny", "convnext_small", "convnext_atto")),
    (r"stages\.0\.blocks\.0\.conv1\.weight", ("resnetv2_50",)),
    (r"s1\.b1\.conv1\.conv\.weight", ("regnety_016", "regnety_032", "regnety_008")),
    (r"blocks\.0\.0\.conv_dw\.weight", ("efficientnet_b0", "mobilenetv2_100")),
)  # fmt: skip


def guess_arch(state: Mapping[str, torch.Tensor], budget_s: float = 3.0) -> list[str]:
    """Common architectures whose tensor names and shapes ``state`` matches (head and stem width aside).

    Only the families whose marker key ``state`` has are tried, each member built once per process on
    the meta device (no memory); the search stops after ``budget_s`` seconds.
    """
    started = time.perf_counter()
    theirs: dict[str, dict[str, tuple[int, ...]]] = {}
    found: list[str] = []
    for marker, names in GUESS_FAMILIES:
        if not any(re.fullmatch(marker, key) for key in state):
            continue
        for name in names:
            if time.perf_counter() - started > budget_s:
                return found
            signature = _signature(name)
            if signature is None:
                continue
            head, stem, own = signature
            if head not in theirs:
                theirs[head] = _shapes(state, skip=head)
            if own.keys() == theirs[head].keys() and all(own[k] == theirs[head][k] for k in own if k != stem):
                found.append(name)
    return found


@functools.cache
def _signature(name: str) -> tuple[str, str, dict[str, tuple[int, ...]]] | None:
    """(classifier prefix, stem weight name, tensor shapes without the head) of ``name``, or None."""
    if name not in ODEIFY_ARCHS and not timm.is_model(name):
        return None
    try:
        model = build_arch(name, {"num_classes": 0}, device="meta")
    except ModelLoadError:
        return None
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    head = f"{cfg.get('classifier')}."
    return head, f"{cfg.get('first_conv')}.weight", _shapes(model.state_dict(), skip=head)


def _shapes(state: Mapping[str, torch.Tensor], skip: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, without BN step counters and names starting with ``skip``."""
    return {
        k: tuple(v.shape)
        for k, v in state.items()
        if not (k.startswith(skip) or k.endswith("num_batches_tracked"))
    }
