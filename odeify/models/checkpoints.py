"""Checkpoint files and folders -> state dicts (and what they say about their architecture), safely.

Read here, as timm users hold weights:

- ``.safetensors``: any state dict; files written by :func:`save_checkpoint` also name their arch;
- ``.pth``/``.pt``/``.bin``/``.pth.tar``: a plain state dict, or a timm ``train.py`` checkpoint (a dict
  with ``state_dict``, ``state_dict_ema``, ``arch``, ``args``, ``optimizer``, ``epoch``, ...);
- a Hugging Face-style timm folder: ``config.json`` + ``model.safetensors`` (or ``pytorch_model.bin``),
  as ``timm.models.save_for_hf`` / ``push_to_hf_hub`` write it.

Nothing is ever unpickled into arbitrary objects: torch files go through ``torch.load(weights_only=True)``
with exactly one extra allowed class, ``argparse.Namespace`` (timm's train.py stores its ``args``), and
build kwargs read from a file pass :func:`odeify.models.archs.check_file_kwargs`.

timm's ``load_state_dict``/``load_checkpoint`` read the same files the same safe way, but return only
the weights (odeify also needs the ``arch`` and ``args`` entries), fall back to the non-EMA weights
without a word when EMA ones are asked for and absent, and refuse with RuntimeErrors; so the reading
is here, and timm's ``clean_state_dict`` strips the DDP / torch.compile prefixes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from timm.models import clean_state_dict
from torch import Tensor, nn

from odeify.core.errors import ModelLoadError, OdeifyError
from odeify.core.fileio import atomic_write_bytes, read_header, read_json, read_tensors
from odeify.core.limits import MAX_CONFIG_BYTES
from odeify.core.paths import input_file
from odeify.models.archs import (
    HUB_PREFIXES,
    check_arch_name,
    check_file_kwargs,
    is_arch_name,
    unknown_name_error,
)
from odeify.models.data_config import DATA_CONFIG_KEYS, check_data_config, train_args_data_config

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "META_ARCH",
    "META_KWARGS",
    "SAFE_GLOBALS",
    "Checkpoint",
    "apply_state_dict",
    "describe_path",
    "read_checkpoint",
    "read_checkpoint_metadata",
    "save_checkpoint",
]

# safetensors metadata keys (a str -> str mapping) of files written by save_checkpoint
META_ARCH = "odeify_arch"
META_KWARGS = "odeify_kwargs"

SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pth.tar", ".pth", ".pt", ".bin")
CHECKPOINT_SUFFIXES = SAFETENSORS_SUFFIXES + TORCH_SUFFIXES
HF_CONFIG = "config.json"
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # timm's save_for_hf names, preferred first

SAFE_GLOBALS: list[type] = [argparse.Namespace]
"""The classes besides tensors and plain containers that torch files may hold: what timm's train.py saves."""

STATE_KEYS = ("state_dict", "model")  # where train.py and other trainers keep the weights
EMA_KEYS = ("state_dict_ema", "model_ema")  # timm train.py / ModelEma checkpoints
ONCE = {"once": True}  # a log record's extra: the command line prints such a note once per command


@dataclass
class Checkpoint:
    """The weights in a checkpoint and what the file says about the architecture they fit."""

    path: Path
    kind: str  # "safetensors file", "state dict", "timm training checkpoint", "Hugging Face-style folder"
    state_dict: dict[str, Tensor]
    arch: str | None = None  # the architecture it names, if any
    arch_kwargs: dict[str, Any] = field(default_factory=dict)  # constructor kwargs it records (checked)
    data_cfg: dict[str, Any] = field(default_factory=dict)  # input size, mean/std, crop (HF, train.py args)
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors string metadata
    ema: bool = False  # the weights are the EMA ones


def describe_path(path: Path) -> str:
    """``"file"``, or ``"folder"`` (a Hugging Face-style timm folder); else an error saying what it is."""
    path = input_file(path, "checkpoint", error=ModelLoadError, folders=True, example="weights.pth")
    if path.is_file():
        return "file"
    if (path / HF_CONFIG).is_file():
        return "folder"
    raise ModelLoadError(
        f"{path} is a directory, not a checkpoint file; odeify reads a directory only as a Hugging "
        f"Face-style timm folder ({HF_CONFIG} + {HF_WEIGHTS[0]}, as timm.models.save_for_hf writes), "
        f"and this one has no {HF_CONFIG}. Pass the weights file inside it instead."
    )


def read_checkpoint(path: str | os.PathLike[str], *, ema: bool = False) -> Checkpoint:
    """The weights (the EMA ones with ``ema=True``) and self-description of a checkpoint file or folder."""
    path = Path(path).expanduser()
    if describe_path(path) == "folder":
        if ema:
            raise ModelLoadError(f"{path} is a Hugging Face-style folder: one set of weights, no EMA weights")
        return _read_hf_folder(path)
    suffix = _suffix(path)
    if suffix in SAFETENSORS_SUFFIXES:
        if ema:
            raise ModelLoadError(f"{path} is a safetensors state dict: no EMA weights (see train.py files)")
        return _read_safetensors(path)
    if suffix in TORCH_SUFFIXES:
        return _from_torch_object(_torch_load(path), path, ema)
    raise ModelLoadError(
        f"unsupported checkpoint file {path}: odeify reads {', '.join(CHECKPOINT_SUFFIXES)} files and "
        f"Hugging Face-style folders"
    )


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return next((s for s in CHECKPOINT_SUFFIXES if name.endswith(s)), path.suffix.lower())


def read_checkpoint_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The string metadata of a ``.safetensors`` file (arch, kwargs, training record); {} for other files."""
    path = Path(path).expanduser()
    describe_path(path)
    if _suffix(path) not in SAFETENSORS_SUFFIXES:
        return {}
    return read_header(path, ModelLoadError, "a readable safetensors file").metadata


def _read_safetensors(path: Path) -> Checkpoint:
    meta = read_checkpoint_metadata(path)
    state = read_tensors(path, ModelLoadError, "a readable safetensors file")
    arch, kwargs = None, {}
    if META_ARCH in meta:
        arch = check_arch_name(meta[META_ARCH], f"{path} ({META_ARCH})")
        recorded = _json(meta.get(META_KWARGS, "{}"), path, META_KWARGS)
        kwargs = check_file_kwargs(recorded, f"{path} ({META_KWARGS})")
    _check_tensors(state, path)
    return Checkpoint(path, "safetensors file", clean_state_dict(state), arch, kwargs, metadata=meta)


def _json(text: str, path: Path, what: str) -> Any:
    return read_json(text, str(path), ModelLoadError, MAX_CONFIG_BYTES, what)


def _check_tensors(state: Mapping[str, object], path: Path) -> None:
    """Every entry is a dense tensor of real numbers on a real device (not meta, sparse or quantized)."""
    for key, value in state.items():
        if not isinstance(value, Tensor):
            continue  # _from_torch_object names entries that are not tensors
        why = (
            "a meta tensor (no values)"
            if value.is_meta
            else f"a {value.layout} tensor"
            if value.layout != torch.strided
            else "a quantized tensor"
            if value.is_quantized
            else f"a {value.dtype} tensor"
            if value.is_complex()
            else None
        )
        if why is not None:
            raise ModelLoadError(
                f"{path}: {key} is {why}; odeify loads dense tensors of real numbers. Re-save the weights "
                "from a model in its plain form: torch.save(model.state_dict(), path)."
            )


def _torch_load(path: Path) -> object:
    """``torch.load(weights_only=True)`` allowing ``SAFE_GLOBALS``; refusals name the classes involved."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception:  # not a zip archive (legacy format): the torch message is all there is
            found = []
        allowed = {f"{c.__module__}.{c.__qualname__}" for c in SAFE_GLOBALS}
        names = [g for g in found if g not in allowed]
        what = f" ({', '.join(names[:5])})" if names else ""
        raise ModelLoadError(
            f"{path} holds Python objects{what} besides tensors, which odeify does not unpickle: only "
            f"tensors, containers, numbers, strings and argparse.Namespace (timm train.py's args) are read. "
            f"Re-save just the weights: torch.save(model.state_dict(), path), or "
            f"safetensors.torch.save_file(model.state_dict(), 'weights.safetensors')."
        ) from exc
    except Exception as exc:  # truncated, not a torch file, ...
        raise ModelLoadError(f"{path} is not a readable torch file: {type(exc).__name__}: {exc}") from exc


def _from_torch_object(obj: object, path: Path, ema: bool) -> Checkpoint:
    """A Checkpoint from what a torch file holds: a state dict, or a training checkpoint dict."""
    if not isinstance(obj, Mapping) or not obj:
        raise ModelLoadError(
            f"{path} holds no state dict (got {type(obj).__name__}); save one with "
            f"torch.save(model.state_dict(), path)"
        )
    state_key = next((k for k in (EMA_KEYS if ema else STATE_KEYS) if isinstance(obj.get(k), Mapping)), None)
    if ema and state_key is None:
        raise ModelLoadError(
            f"{path} has no EMA weights (no {' or '.join(EMA_KEYS)} entry; it has: "
            f"{', '.join(map(str, list(obj)[:8]))}). Drop ema=True (CLI: --ema) to use its weights."
        )
    state = obj[state_key] if state_key else obj
    if ema:
        # once: a command may read the file twice (the source it checks, the one it converts)
        logging.getLogger("odeify").info(f"using the EMA weights ('{state_key}') of {path}", extra=ONCE)
    bad = [k for k, v in state.items() if not (isinstance(k, str) and isinstance(v, Tensor))]
    if bad or not state:
        raise ModelLoadError(
            f"{path} is not a state dict: entries {bad[:5]} are not name -> tensor pairs; expected a plain "
            f"state dict or a training checkpoint with a 'state_dict' entry"
        )
    _check_tensors(state, path)
    arch, kwargs, kind, data_cfg = None, {}, "state dict", {}
    if state_key is not None:
        kind = "timm training checkpoint"
        named = obj.get("arch")
        if isinstance(named, str) and is_arch_name(named) and not named.startswith(HUB_PREFIXES):
            arch = named  # train.py writes args.model; without args, the class name (not buildable)
        if isinstance(obj.get("args"), argparse.Namespace):
            kwargs = check_file_kwargs(_train_args_kwargs(obj["args"], path), f"{path} ('args')")
            data_cfg = train_args_data_config(obj["args"], str(path))
    return Checkpoint(path, kind, clean_state_dict(dict(state)), arch, kwargs, data_cfg, ema=ema)


def _train_args_kwargs(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The architecture kwargs timm's train.py passes to create_model, from its saved ``args``."""
    recorded = getattr(args, "model_kwargs", None) or {}
    if not isinstance(recorded, Mapping):
        raise ModelLoadError(
            f"{path}: args.model_kwargs must be a dict of build kwargs (as timm's train.py records it), not "
            f"{type(recorded).__name__} {recorded!r:.60}"
        )
    found = dict(recorded)
    if isinstance(getattr(args, "num_classes", None), int):
        found["num_classes"] = args.num_classes
    in_chans = getattr(args, "in_chans", None)
    size = getattr(args, "input_size", None)
    if in_chans is None and isinstance(size, (list, tuple)) and size:
        in_chans = size[0]
    if isinstance(in_chans, int):
        found["in_chans"] = in_chans
    if isinstance(getattr(args, "gp", None), str):
        found["global_pool"] = args.gp
    return found


def _read_hf_folder(path: Path) -> Checkpoint:
    """A timm ``save_for_hf`` folder: config.json (architecture, model_args, pretrained_cfg) + weights."""
    config_path = input_file(path / HF_CONFIG, "model config", error=ModelLoadError)
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelLoadError(f"{config_path} is over {MAX_CONFIG_BYTES} bytes; not a timm model config")
    config = _json(config_path.read_text(encoding="utf-8", errors="replace"), config_path, "config")
    if not isinstance(config, Mapping):
        raise ModelLoadError(f"{config_path} must hold a JSON object, not {type(config).__name__}")
    data_cfg = config.get("pretrained_cfg", None)
    if data_cfg is None:  # timm's legacy single-dict config: the data config at top level
        data_cfg = {k: v for k, v in config.items() if k != "architecture"}
    arch = check_arch_name(config.get("architecture"), f"{config_path} ('architecture')")
    model_args = config.get("model_args") or {}
    if not isinstance(model_args, Mapping):
        raise ModelLoadError(f"{config_path}: 'model_args' must be a JSON object")
    kwargs = dict(model_args)
    if "num_classes" in config:
        kwargs.setdefault("num_classes", config["num_classes"])
    kwargs = check_file_kwargs(kwargs, f"{config_path} ('model_args')")
    weights = next((path / name for name in HF_WEIGHTS if (path / name).is_file()), None)
    if weights is None:
        raise ModelLoadError(f"{path} has {HF_CONFIG} but no weights file ({' or '.join(HF_WEIGHTS)})")
    inner = (
        _read_safetensors(weights)
        if weights.suffix == ".safetensors"
        else _from_torch_object(_torch_load(weights), weights, False)
    )
    cfg = _data_config(data_cfg, config_path)
    return Checkpoint(path, "Hugging Face-style folder", inner.state_dict, arch, kwargs, cfg)


def _data_config(cfg: object, where: Path) -> dict[str, Any]:
    """The data-config entries of a folder's pretrained_cfg (timm's other entries, such as its url, are
    not read); each value checked (:func:`odeify.models.data_config.check_data_config`)."""
    if not isinstance(cfg, Mapping):
        raise ModelLoadError(f"{where}: 'pretrained_cfg' must be a JSON object, not {type(cfg).__name__}")
    kept = {k: v for k, v in cfg.items() if k in DATA_CONFIG_KEYS and k != "architecture" and v is not None}
    return check_data_config(kept, f"{where} ('pretrained_cfg')")


# ---------------------------------------------------------------------------------------------------
# State dicts -> modules


def _fmt_keys(keys: list[str], n: int = 5) -> str:
    """At most ``n`` keys, and how many more there are."""
    more = f", ... (+{len(keys) - n})" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def apply_state_dict(model: nn.Module, ckpt: Checkpoint, arch: str, fix: str) -> nn.Module:
    """Load ``ckpt``'s weights into ``model`` strictly (BN ``num_batches_tracked`` may be absent).

    A float64 file makes a float64 model (other dtypes are cast to the model's, as torch does). Every
    mismatch is listed in one ModelLoadError that ends with ``fix``.
    """
    state = ckpt.state_dict
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
        said = f" The file says it holds {ckpt.arch!r} with {ckpt.arch_kwargs}." if ckpt.arch else ""
        raise ModelLoadError(
            f"the {ckpt.kind} {ckpt.path} does not fit {arch!r}: {'; '.join(parts)}.{said} Fix: {fix}"
        )
    numbers = [
        f"{k} ({state[k].dtype})" for k in own if k in state and own[k].is_floating_point()
        and not state[k].is_floating_point()
    ]  # fmt: skip
    if numbers:
        raise ModelLoadError(
            f"the {ckpt.kind} {ckpt.path} holds non-floating tensors where {arch!r} has floating-point "
            f"weights: {_fmt_keys(numbers, 3)}; casting them would turn them into 0/1 or whole numbers. "
            f"Fix: {fix}"
        )
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    if floats == {torch.float64}:
        model = model.to(torch.float64)
    model.load_state_dict(state, strict=False)
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
