"""``load_model``: a model name, checkpoint file or module -> an eval-mode ``nn.Module``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import timm
from timm.models import is_model_pretrained
from torch import nn

from odeify.archs import HUB_PREFIXES, ODEIFY_ARCHS, is_arch_name, unknown_name_error
from odeify.checkpoints import (
    CHECKPOINT_SUFFIXES,
    META_ARCH,
    META_KWARGS,
    check_file,
    load_into,
    read_checkpoint_metadata,
)
from odeify.errors import ModelLoadError

__all__ = ["load_model"]


def _looks_like_path(source: str) -> bool:
    """True when a string that is not an arch name should be read as a file path."""
    return (
        Path(source).suffix.lower() in CHECKPOINT_SUFFIXES
        or "/" in source
        or os.sep in source
        or source.startswith(("~", "."))
        or Path(source).exists()
    )


def _construct(name: str, pretrained: bool, kwargs: Mapping[str, Any]) -> nn.Module:
    """Build ``name``; unknown names raise ModelLoadError, bad kwargs raise timm's TypeError as is."""
    if name in ODEIFY_ARCHS:
        if pretrained:
            raise ModelLoadError(
                f"{name!r} has no downloadable weights; its trained weights ship with odeify: "
                f"load_model(odeify.digits.DEFAULT_MODEL_PATH)"
            )
        return ODEIFY_ARCHS[name](**kwargs)
    if not is_arch_name(name):
        raise unknown_name_error(name)
    hub = name.startswith(HUB_PREFIXES)  # hub names fetch their config even with pretrained=False
    if not pretrained and not hub:
        try:
            return timm.create_model(name, pretrained=False, **kwargs)
        except RuntimeError as exc:  # e.g. an invalid pretrained tag: "resnet50.foo"
            raise ModelLoadError(f"timm cannot build {name!r}: {exc}") from exc
    if pretrained and not hub and not is_model_pretrained(name):
        arch = name.split(".", 1)[0]
        raise ModelLoadError(
            f"timm has no pretrained weights for {name!r} (see timm.list_pretrained('{arch}*')). "
            f"Use pretrained=False for random weights, or pass a local checkpoint file."
        )
    try:
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    except TypeError:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"could not fetch pretrained weights for {name!r} ({type(exc).__name__}: {exc}). "
            f"The Hugging Face hub may be unreachable from this machine. Use pretrained=False for "
            f"random weights, or load local weights: load_model({name!r}, checkpoint='weights.safetensors') "
            f"or load_model('weights.pth', arch={name!r})."
        ) from exc


def _build(name: str, pretrained: bool, kwargs: Mapping[str, Any]) -> nn.Module:
    """``_construct`` with bad constructor kwargs reported as ModelLoadError."""
    try:
        return _construct(name, pretrained, kwargs)
    except TypeError as exc:
        raise ModelLoadError(f"cannot build {name!r} with kwargs {dict(kwargs)}: {exc}") from exc


def _load_file(path: Path, arch: str | None, timm_kwargs: dict[str, Any]) -> nn.Module:
    """Build the checkpoint's arch (from its metadata or ``arch=``) and load its weights."""
    check_file(path)
    meta = read_checkpoint_metadata(path)
    kwargs: dict[str, Any] = {}
    if arch is None:
        arch = meta.get(META_ARCH)
        if arch is None:
            raise ModelLoadError(
                f"{path} does not say which architecture it holds; pass it: "
                f"load_model({str(path)!r}, arch='resnet50', num_classes=...) "
                f"(files written by odeify.checkpoints.save_checkpoint record it themselves)"
            )
        try:
            kwargs = json.loads(meta.get(META_KWARGS, "{}"))
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: corrupt {META_KWARGS} metadata: {exc}") from exc
    elif meta.get(META_ARCH) == arch:
        kwargs = json.loads(meta.get(META_KWARGS, "{}"))
    kwargs.update(timm_kwargs)  # explicit kwargs (drop_path_rate=...) win over recorded ones
    return load_into(_build(arch, False, kwargs), path, arch)


def load_model(
    source: str | os.PathLike[str] | nn.Module,
    *,
    pretrained: bool = False,
    checkpoint: str | os.PathLike[str] | None = None,
    arch: str | None = None,
    **timm_kwargs: Any,
) -> nn.Module:
    """Return ``source`` as an ``nn.Module`` in eval mode (see the module docstring for sources).

    ``pretrained``: download timm's weights for a timm name (needs the hub; fails offline with a
    ModelLoadError that suggests the alternatives). ``checkpoint``: a local file whose weights
    replace the built model's (exclusive with ``pretrained``). ``arch``: the timm/odeify name of the
    architecture in a checkpoint file that does not record it (``.pth``/``.pt``/``.bin``).
    ``timm_kwargs`` go to the model constructor (num_classes, in_chans, drop_path_rate, ...).
    """
    if pretrained and checkpoint is not None:
        raise ModelLoadError(
            "pass pretrained=True or checkpoint=..., not both: the checkpoint would replace the "
            "downloaded weights"
        )
    if isinstance(source, nn.Module):
        if arch is not None or timm_kwargs or pretrained:
            raise ModelLoadError(
                "arch/pretrained/timm kwargs apply to names and files, not to an nn.Module source"
            )
        model = source
        if checkpoint is not None:
            model = load_into(model, Path(checkpoint).expanduser(), type(model).__name__)
        return model.eval()
    if not isinstance(source, (str, os.PathLike)):
        raise ModelLoadError(
            f"load_model takes an nn.Module, a timm model name or a checkpoint path, "
            f"not {type(source).__name__}"
        )
    name = os.fspath(source)
    if isinstance(source, str) and is_arch_name(name):
        if arch is not None and arch != name:
            raise ModelLoadError(f"arch={arch!r} conflicts with the model name {name!r}; pass one")
        model = _build(name, pretrained, timm_kwargs)
        if checkpoint is not None:
            model = load_into(model, Path(checkpoint).expanduser(), name)
        return model.eval()
    if isinstance(source, str) and not _looks_like_path(name):
        raise unknown_name_error(name)
    if pretrained:
        raise ModelLoadError(
            f"pretrained=True applies to timm model names; {name} is a file that holds the weights "
            f"itself. Drop pretrained=True."
        )
    if checkpoint is not None:
        raise ModelLoadError(
            f"{name} is already a checkpoint file; pass checkpoint= only with a model name, or use "
            f"load_model({str(checkpoint)!r}, arch=...)"
        )
    return _load_file(Path(name).expanduser(), arch, dict(timm_kwargs)).eval()
