"""Checkpoint files <-> state dicts, never unpickling arbitrary objects.

``.safetensors`` files are read with safetensors; ``.pth``/``.pt``/``.bin`` with
``torch.load(weights_only=True)``. ``save_checkpoint`` writes safetensors that name their own arch.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open
from torch import Tensor, nn

from odeify.archs import is_arch_name, unknown_name_error
from odeify.errors import ModelLoadError, OdeifyError
from odeify.fileio import atomic_write_bytes

META_ARCH = "odeify_arch"
META_KWARGS = "odeify_kwargs"

SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
CHECKPOINT_SUFFIXES = SAFETENSORS_SUFFIXES + TORCH_SUFFIXES


def check_file(path: Path) -> None:
    """Raise ModelLoadError unless ``path`` is an existing file with a supported suffix."""
    if not path.exists():
        raise ModelLoadError(f"checkpoint file not found: {path} (resolved: {path.resolve()})")
    if not path.is_file():
        raise ModelLoadError(f"checkpoint path is not a file: {path}")
    if path.suffix.lower() not in CHECKPOINT_SUFFIXES:
        raise ModelLoadError(
            f"unsupported checkpoint file {path}: use .safetensors (preferred) or a "
            f"{'/'.join(TORCH_SUFFIXES)} state dict"
        )


def read_checkpoint_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The metadata of a ``.safetensors`` checkpoint (arch, kwargs, digits split); {} for others."""
    path = Path(path).expanduser()
    check_file(path)
    if path.suffix.lower() not in SAFETENSORS_SUFFIXES:
        return {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            return dict(fh.metadata() or {})
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc


def _strip_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop wrapper prefixes (DistributedDataParallel's ``module.``, torch.compile's ``_orig_mod.``)."""
    for prefix in ("module.", "_orig_mod."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def _extract_state_dict(obj: object, path: Path) -> dict[str, Tensor]:
    """The state dict inside a torch.load result: raw, or under a "state_dict"/"model" key."""
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model"):
            inner = obj.get(key)
            if isinstance(inner, Mapping):
                obj = inner
                break
    if not isinstance(obj, Mapping) or not obj:
        raise ModelLoadError(
            f"{path} holds no state dict (got {type(obj).__name__}); save one with "
            f"torch.save(model.state_dict(), path) or odeify.checkpoints.save_checkpoint"
        )
    bad = [k for k, v in obj.items() if not isinstance(v, Tensor)]
    if bad:
        raise ModelLoadError(
            f"{path} is not a flat state dict: entries {bad[:5]} are not tensors; "
            f"expected a name -> tensor mapping, raw or under 'state_dict'/'model'"
        )
    return _strip_prefix({str(k): v for k, v in obj.items()})


def read_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Read ``(state_dict, metadata)`` from a checkpoint file, without unpickling objects."""
    check_file(path)
    if path.suffix.lower() in SAFETENSORS_SUFFIXES:
        meta = read_checkpoint_metadata(path)
        try:
            state = safetensors.torch.load_file(str(path), device="cpu")
        except Exception as exc:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc
        return _strip_prefix(state), meta
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ModelLoadError(
            f"{path} holds Python objects besides tensors, which odeify does not unpickle "
            f"(torch.load weights_only=True). Re-save just the weights: "
            f"torch.save(model.state_dict(), path), or odeify.checkpoints.save_checkpoint. ({exc})"
        ) from exc
    except Exception as exc:
        raise ModelLoadError(f"could not read checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    return _extract_state_dict(obj, path), {}


def _fmt_keys(keys: list[str], n: int = 5) -> str:
    """At most ``n`` keys, and how many more there are."""
    more = f", ... (+{len(keys) - n})" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def _apply_state_dict(
    model: nn.Module, state: Mapping[str, Tensor], path: Path, arch: str, meta: Mapping[str, str]
) -> None:
    """Load ``state`` into ``model`` strictly (only BN ``num_batches_tracked`` may be absent)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    wrong_shape = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or wrong_shape:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys ({_fmt_keys(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys ({_fmt_keys(unexpected)})")
        if wrong_shape:
            parts.append(f"{len(wrong_shape)} shape mismatches ({_fmt_keys(wrong_shape, 3)})")
        saved = ""
        if META_ARCH in meta:
            recorded = meta.get(META_KWARGS, "{}")
            saved = f" The file says it was saved for arch {meta[META_ARCH]!r} with kwargs {recorded}."
        raise ModelLoadError(
            f"checkpoint {path} does not fit arch {arch!r}: {'; '.join(parts)}.{saved} Fix: build the "
            f"arch the weights were trained with, e.g. load_model({str(path)!r}, arch='resnet50', "
            f"num_classes=10) (timm kwargs such as num_classes/in_chans must match too)."
        )
    model.load_state_dict(state, strict=False)


def _float_dtype(state: Mapping[str, Tensor]) -> torch.dtype | None:
    """The one floating dtype of a state dict's tensors, or None if mixed/absent."""
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def load_into(model: nn.Module, path: Path, arch: str) -> nn.Module:
    """Overwrite ``model``'s weights from the checkpoint at ``path`` (keeping a float64 file float64)."""
    state, meta = read_checkpoint(path)
    dtype = _float_dtype(state)
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    _apply_state_dict(model, state, path, arch, meta)
    return model


def save_checkpoint(
    model: nn.Module,
    path: str | os.PathLike[str],
    arch: str,
    arch_kwargs: Mapping[str, Any],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``model``'s state dict as safetensors that name their own arch, atomically.

    ``arch`` is a timm (or odeify) name and ``arch_kwargs`` the JSON-able constructor kwargs, so
    ``load_model(path)`` can rebuild the model with no other input. Extra string ``metadata`` is
    stored alongside (read it back with ``read_checkpoint_metadata``).
    """
    if not is_arch_name(arch):
        raise unknown_name_error(arch)
    try:
        kwargs_json = json.dumps(dict(arch_kwargs), sort_keys=True)
    except TypeError as exc:
        raise OdeifyError(f"save_checkpoint: arch_kwargs must be JSON-serialisable: {exc}") from exc
    meta = {"format": "pt", **(metadata or {}), META_ARCH: arch, META_KWARGS: kwargs_json}
    bad = [k for k, v in meta.items() if not isinstance(v, str)]
    if bad:
        raise OdeifyError(f"save_checkpoint: metadata values must be strings, not for {bad}")
    # Own, contiguous CPU copies: safetensors refuses tensors that share storage.
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    atomic_write_bytes(path, safetensors.torch.save(state, metadata=meta))


