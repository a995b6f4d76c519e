"""``load_model``: every way a timm user holds a model -> an eval-mode ``nn.Module``.

Sources: a timm name (random weights, ``pretrained=True`` for timm's, ``checkpoint=`` for local ones),
an odeify arch (``"odeify.digits_resnet"``), a checkpoint file or Hugging Face-style folder
(:mod:`odeify.models.checkpoints`; the architecture from ``arch=`` or from the file itself), or an
``nn.Module``. Every failure is a :class:`~odeify.core.errors.ModelLoadError` that says how to fix it, in
Python and in the CLI's syntax.
"""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import timm
from timm.models import get_pretrained_cfg, is_model_pretrained
from torch import Tensor, nn

from odeify.core.budget import check_model_bytes
from odeify.core.errors import ModelLoadError
from odeify.models.archs import (
    HUB_PREFIXES,
    ODEIFY_ARCHS,
    build_arch,
    check_file_kwargs,
    default_cfg,
    guess_arch,
    is_arch_name,
    unknown_name_error,
)
from odeify.models.checkpoints import (
    CHECKPOINT_SUFFIXES,
    Checkpoint,
    apply_state_dict,
    describe_path,
    read_checkpoint,
)

__all__ = ["load_model"]

HUB_HOST = "huggingface.co"
PROBE_TIMEOUT_S = 2.0  # how long pretrained=True waits to learn that the hub is unreachable


def load_model(
    source: str | os.PathLike[str] | nn.Module,
    *,
    arch: str | None = None,
    num_classes: int | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    ema: bool = False,
    pretrained: bool = False,
    **timm_kwargs: Any,
) -> nn.Module:
    """Return ``source`` as an ``nn.Module`` in eval mode.

    ``source``: a timm model name (``"resnet50"``, ``"resnet50.a1_in1k"``), ``"odeify.digits_resnet"``,
    a checkpoint file (``.safetensors``/``.pth``/``.pth.tar``/``.pt``/``.bin``: a state dict or a timm
    ``train.py`` checkpoint), a Hugging Face-style timm folder (``config.json`` + ``model.safetensors``),
    or an ``nn.Module``.

    ``arch``: the architecture of a checkpoint that does not name it. ``num_classes``: the head size
    (read from the checkpoint's classifier weight when not given). ``checkpoint``: local weights for a
    model name or module. ``ema``: take a training checkpoint's EMA weights. ``pretrained``: timm's
    weights for a model name (needs the hub, or its local cache). ``timm_kwargs`` go to the model
    constructor (``in_chans``, ``drop_path_rate``, ...) and win over what a file records.
    """
    if num_classes is not None:
        timm_kwargs["num_classes"] = num_classes
    if pretrained and checkpoint is not None:
        raise ModelLoadError(
            "pass pretrained=True or checkpoint=..., not both: the checkpoint would replace timm's weights"
        )
    if isinstance(source, nn.Module):
        return _module_source(source, arch, checkpoint, ema, pretrained, timm_kwargs).eval()
    if not isinstance(source, (str, os.PathLike)):
        raise ModelLoadError(
            f"load_model takes a timm model name, a checkpoint file or folder, or an nn.Module, "
            f"not {type(source).__name__}"
        )
    name = os.fspath(source).removeprefix("local-dir:")  # timm's spelling of a local model folder
    if isinstance(source, str) and is_arch_name(name) and not _looks_like_path(name):
        if arch is not None and arch != name:
            raise ModelLoadError(f"arch={arch!r} conflicts with the model name {name!r}; pass one of them")
        return _name_source(name, checkpoint, ema, pretrained, timm_kwargs).eval()
    if isinstance(source, str) and not _looks_like_path(name):
        raise unknown_name_error(name)
    if pretrained:
        raise ModelLoadError(
            f"pretrained=True applies to timm model names; {name} holds its own weights. Drop "
            f"pretrained=True (CLI: --pretrained)."
        )
    if checkpoint is not None:
        raise ModelLoadError(
            f"{name} is already a checkpoint; pass checkpoint= only with a model name or module, e.g. "
            f"load_model('resnet50', checkpoint={str(checkpoint)!r})"
        )
    return _file_source(Path(name).expanduser(), arch, ema, timm_kwargs).eval()


def _looks_like_path(source: str) -> bool:
    """True when a string should be read as a file path rather than a model name (or hub name)."""
    if source.startswith(("hf-hub:", "hf_hub:")):
        return False
    return (
        source.lower().endswith(CHECKPOINT_SUFFIXES)
        or "/" in source
        or os.sep in source
        or source.startswith(("~", "."))
        or (not is_arch_name(source) and os.path.lexists(source))
    )


def _module_source(
    model: nn.Module, arch: str | None, checkpoint: object, ema: bool, pretrained: bool, kwargs: dict
) -> nn.Module:
    if arch is not None or kwargs or pretrained:
        raise ModelLoadError(
            "arch/num_classes/pretrained/timm kwargs build a model from a name or file; an nn.Module is "
            "already built (set its head with model.reset_classifier(n) before passing it)"
        )
    if checkpoint is None:
        if ema:
            raise ModelLoadError("ema=True picks the EMA weights of a checkpoint; pass checkpoint= too")
        return model
    ckpt = read_checkpoint(_path(checkpoint), ema=ema)
    label = type(model).__name__
    return apply_state_dict(model, ckpt, label, "pass the module the checkpoint was trained with")


def _name_source(name: str, checkpoint: object, ema: bool, pretrained: bool, kwargs: dict) -> nn.Module:
    if name in ODEIFY_ARCHS and pretrained:
        raise ModelLoadError(
            f"{name!r} has no downloadable weights; its trained weights ship with odeify: "
            f"load_model(odeify.models.digits.DEFAULT_MODEL_PATH) (CLI: odeify convert, with no MODEL)"
        )
    if checkpoint is None:
        if ema:
            raise ModelLoadError(
                "ema=True picks the EMA weights of a checkpoint; pass checkpoint= too (CLI: --checkpoint)"
            )
        return _pretrained(name, kwargs) if pretrained else _build(name, kwargs)
    ckpt = read_checkpoint(_path(checkpoint), ema=ema)
    if ckpt.arch is not None and ckpt.arch.split(".")[0] != name.split(".")[0]:
        warnings.warn(
            f"{ckpt.path} says it holds {ckpt.arch!r}; building {name!r} as asked", UserWarning, stacklevel=3
        )
    kwargs = _head_kwargs(name, ckpt, {**(ckpt.arch_kwargs if ckpt.arch == name else {}), **kwargs})
    return _with_data_config(_into(_build(name, kwargs), ckpt, name, kwargs), ckpt)


def _file_source(path: Path, arch: str | None, ema: bool, kwargs: dict) -> nn.Module:
    describe_path(path)
    ckpt = read_checkpoint(path, ema=ema)
    name = arch or ckpt.arch
    if name is None:
        fits = guess_arch(ckpt.state_dict)
        guess = fits[0] if fits else "NAME"
        hint = (
            f" Its tensors fit: {', '.join(fits)}."
            if fits
            else " NAME is the timm model it was trained as (see timm.list_models())."
        )
        raise ModelLoadError(
            f"{path} is a {ckpt.kind} that does not say which architecture it holds; name it: "
            f"load_model({str(path)!r}, arch={guess!r}) (CLI: odeify convert {path} --arch {guess}).{hint}"
        )
    recorded = ckpt.arch_kwargs if ckpt.arch == name else {}
    kwargs = _head_kwargs(name, ckpt, {**recorded, **kwargs})
    return _with_data_config(_into(_build(name, kwargs), ckpt, name, kwargs), ckpt)


def _with_data_config(model: nn.Module, ckpt: Checkpoint) -> nn.Module:
    """``model`` with the data config its file records (a folder's pretrained_cfg, train.py's args:
    the input size it was trained at, mean/std, crop) over the architecture's defaults."""
    if ckpt.data_cfg and isinstance(getattr(model, "pretrained_cfg", None), Mapping):
        model.pretrained_cfg = {**model.pretrained_cfg, **ckpt.data_cfg}
        model.default_cfg = model.pretrained_cfg
    return model


def _build(name: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """``build_arch(name, kwargs)`` once its size, measured on the meta device, is within the budget."""
    check_model_bytes(f"{name!r} with {dict(kwargs)}", _meta_bytes(name, kwargs))
    return build_arch(name, kwargs)


def _meta_bytes(name: str, kwargs: Mapping[str, Any]) -> int:
    """Bytes of the parameters and buffers ``name`` built with ``kwargs`` would hold (built on meta)."""
    state = build_arch(name, kwargs, device="meta").state_dict()
    return sum(t.numel() * t.element_size() for t in state.values())


def _into(model: nn.Module, ckpt: Checkpoint, name: str, kwargs: Mapping[str, Any]) -> nn.Module:
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    fix = (
        f"build the architecture the weights were trained with: load_model({str(ckpt.path)!r}, "
        f"arch=NAME, num_classes=N) (CLI: --arch NAME --num-classes N); built {name!r}"
        f"{' with ' + shown if shown else ''}."
    )
    return apply_state_dict(model, ckpt, name, fix)


def _head_kwargs(name: str, ckpt: Checkpoint, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus num_classes/in_chans read from the checkpoint's head and stem shapes when not given."""
    cfg = default_cfg(name)
    inferred: list[str] = []
    if "num_classes" not in kwargs and isinstance(cfg.get("classifier"), str):
        head = ckpt.state_dict.get(f"{cfg['classifier']}.weight")
        n = head.shape[0] if isinstance(head, Tensor) and head.ndim >= 2 else 0
        if n != cfg.get("num_classes"):
            kwargs["num_classes"] = n
            where = (
                f"{cfg['classifier']}.weight {tuple(head.shape)}" if n else f"no {cfg['classifier']}.weight"
            )
            inferred.append(f"num_classes={n} (from {where})")
    if "in_chans" not in kwargs and isinstance(cfg.get("first_conv"), str):
        stem = ckpt.state_dict.get(f"{cfg['first_conv']}.weight")
        default_chans = (cfg.get("input_size") or (3,))[0]
        if isinstance(stem, Tensor) and stem.ndim == 4 and stem.shape[1] != default_chans:
            kwargs["in_chans"] = int(stem.shape[1])
            inferred.append(f"in_chans={stem.shape[1]} (from {cfg['first_conv']}.weight {tuple(stem.shape)})")
    read = {k: kwargs[k] for k in ("num_classes", "in_chans") if any(i.startswith(k) for i in inferred)}
    check_file_kwargs(read, f"{ckpt.path} (read from its tensor shapes)")  # a file's sizes: a file's bounds
    if inferred:
        warnings.warn(
            f"{ckpt.path}: building {name!r} with {', '.join(inferred)}; pass num_classes=/in_chans= "
            f"(CLI: --num-classes) to set them yourself",
            UserWarning,
            stacklevel=4,
        )
    return kwargs


def _path(checkpoint: object) -> Path:
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise ModelLoadError(f"checkpoint= takes a path, not {type(checkpoint).__name__}")
    return Path(checkpoint).expanduser()


# ---------------------------------------------------------------------------------------------------
# pretrained=True: timm's weights, from the hub or its local cache; offline is detected in seconds.


def _pretrained(name: str, kwargs: dict[str, Any]) -> nn.Module:
    if name.startswith(HUB_PREFIXES):
        repo, host = name.split(":", 1)[1], _hub_host()
    else:
        if not is_model_pretrained(name):
            base = name.split(".", 1)[0]
            raise ModelLoadError(
                f"timm has no pretrained weights for {name!r} (see timm.list_pretrained('{base}*')). Drop "
                f"pretrained=True for random weights, or load local ones: {_local_weights_fix(name)}"
            )
        cfg = get_pretrained_cfg(name)
        repo = getattr(cfg, "hf_hub_id", None)
        url = getattr(cfg, "url", None)
        host = _hub_host() if repo else urlparse(url or "").hostname or HUB_HOST
    cached = _cached_hub_weights(repo) if repo and not name.startswith(HUB_PREFIXES) else None
    if cached is not None:  # timm reads its own weights from the cache (weights_only), no network needed
        return _timm_pretrained(name, kwargs, {"file": str(cached)})
    reason = _offline_reason(host)
    if reason is not None:
        raise ModelLoadError(
            f"pretrained=True needs timm's weights for {name!r} from {host}, but {reason}. Use local "
            f"weights instead: {_local_weights_fix(name)}; drop pretrained=True for random weights; or run "
            f"where {host} is reachable (HF_HUB_OFFLINE unset)."
        )
    return _timm_pretrained(name, kwargs, None)


def _timm_pretrained(name: str, kwargs: dict[str, Any], overlay: dict[str, str] | None) -> nn.Module:
    if not name.startswith(HUB_PREFIXES):  # a hub name's architecture is known only from the hub
        check_model_bytes(f"{name!r} with {dict(kwargs)}", _meta_bytes(name, kwargs))
    try:
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    except TypeError as exc:
        raise ModelLoadError(f"cannot build {name!r} with kwargs {kwargs}: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(
            f"could not load pretrained weights for {name!r} ({type(exc).__name__}: {exc}). Use local "
            f"weights instead: {_local_weights_fix(name)}"
        ) from exc


def _local_weights_fix(name: str) -> str:
    return (
        f"load_model({name!r}, checkpoint='weights.safetensors') or load_model('weights.pth', arch={name!r}) "
        f"(CLI: odeify convert {name} --checkpoint weights.safetensors, or odeify convert weights.pth "
        f"--arch {name})"
    )


def _hub_host() -> str:
    endpoint = os.environ.get("HF_ENDPOINT", f"https://{HUB_HOST}")
    return urlparse(endpoint).hostname or HUB_HOST


def _cached_hub_weights(repo: str) -> Path | None:
    """timm's weights for hub repo ``repo`` if they are in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub is a timm dependency
        return None
    repo_id, _, revision = repo.partition("@")
    for filename in ("model.safetensors", "pytorch_model.bin"):
        found = try_to_load_from_cache(repo_id, filename, revision=revision or None)
        if isinstance(found, str):
            return Path(found)
    return None


def _offline_reason(host: str) -> str | None:
    """Why ``host`` is unreachable (HF_HUB_OFFLINE, no connection in PROBE_TIMEOUT_S), or None."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    result: list[str | None] = []

    def probe() -> None:  # name resolution has no timeout of its own: run it where we can stop waiting
        request = urllib.request.Request(f"https://{host}", method="HEAD")
        try:
            with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S):
                result.append(None)
        except urllib.error.HTTPError:  # the server answered: reachable
            result.append(None)
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            result.append(f"it is not reachable from this machine ({reason})")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 0.5)
    return result[0] if result else f"it did not answer within {PROBE_TIMEOUT_S:.0f} s"
