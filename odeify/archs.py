"""Architecture names -> freshly built modules (random weights): timm's names plus odeify's own.

A name is a timm model name (``"resnet50"``, with or without a pretrained tag such as
``".a1_in1k"``) or an odeify arch (``"odeify.digits_resnet"``). Weights are loaded elsewhere
(:mod:`odeify.loading`, :mod:`odeify.checkpoints`); this module only builds.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

import timm
from torch import nn

from odeify.digits import DIGITS_ARCH, digits_resnet
from odeify.errors import ModelLoadError

__all__ = ["HUB_PREFIXES", "ODEIFY_ARCHS", "build_arch", "is_arch_name", "unknown_name_error"]

ODEIFY_ARCHS: dict[str, Callable[..., nn.Module]] = {DIGITS_ARCH: digits_resnet}
HUB_PREFIXES = ("hf-hub:", "hf_hub:")  # timm names whose config (and weights) live on the hub


def is_arch_name(name: str) -> bool:
    """True for names odeify or timm can build (timm pretrained tags such as ``.a1_in1k`` included)."""
    return name in ODEIFY_ARCHS or name.startswith(HUB_PREFIXES) or timm.is_model(name)


def unknown_name_error(name: str) -> ModelLoadError:
    """An error naming the closest timm/odeify names and the checkpoint-file alternative."""
    candidates = [*timm.list_models(), *ODEIFY_ARCHS]
    close = difflib.get_close_matches(name, candidates, n=5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ModelLoadError(
        f"unknown model {name!r}: not a timm model name nor an odeify arch.{hint} "
        f"See timm.list_models('{name[:4]}*') for names; a path to a local checkpoint file "
        f"(.safetensors/.pth/.pth.tar/.pt/.bin) or a Hugging Face-style model folder works too."
    )


def build_arch(name: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """Build ``name`` with random weights and constructor ``kwargs``; every failure is a ModelLoadError."""
    if name.startswith(HUB_PREFIXES):
        raise ModelLoadError(
            f"{name!r} is a hub name: its architecture is only known after a download. Use the timm "
            f"architecture name instead (e.g. 'resnet50'), with local weights via checkpoint=."
        )
    if not is_arch_name(name):
        raise unknown_name_error(name)
    try:
        if name in ODEIFY_ARCHS:
            return ODEIFY_ARCHS[name](**kwargs)
        return timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as exc:
        raise ModelLoadError(f"cannot build {name!r} with kwargs {dict(kwargs)}: {exc}") from exc
    except RuntimeError as exc:  # e.g. an invalid pretrained tag: "resnet50.foo"
        raise ModelLoadError(f"timm cannot build {name!r}: {exc}") from exc
