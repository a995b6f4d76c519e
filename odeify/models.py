"""Turn model names and checkpoint files into eval-mode ``nn.Module``s, and back into files.

Sources ``load_model`` accepts:

- an ``nn.Module`` (returned as is, in eval mode);
- a timm model name such as ``"resnet50"`` or ``"resnet50.a1_in1k"`` (``pretrained=True`` downloads
  weights from the Hugging Face hub, which needs a network);
- ``"odeify.digits_resnet"``, the small ResNet odeify trains itself on scikit-learn's digits
  (``examples/train_digits.py``); its trained weights ship as ``DEFAULT_MODEL_PATH``;
- a local checkpoint file: ``.safetensors`` written by ``save_checkpoint`` (it names its own arch),
  any other ``.safetensors``/``.pth``/``.pt``/``.bin`` state dict together with ``arch=``.

Files are never unpickled into arbitrary objects: safetensors, or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import timm
import torch
import torch.nn.functional as F
from safetensors import safe_open
from timm.models import is_model_pretrained
from timm.models._manipulate import checkpoint_seq
from timm.models.resnet import BasicBlock, ResNet
from torch import Tensor, nn

from odeify.errors import ModelLoadError, OdeifyError
from odeify.fileio import atomic_write_bytes
from odeify.settings import DEFAULT_MODEL_PATH

__all__ = [
    "DEFAULT_MODEL_PATH",
    "DIGITS_ARCH",
    "DIGITS_MEAN",
    "DIGITS_SEED",
    "DIGITS_SIZE",
    "DIGITS_STD",
    "DIGITS_TEST_FRACTION",
    "META_ARCH",
    "META_DIGITS",
    "META_KWARGS",
    "DigitsResNet",
    "default_input_size",
    "digits_resnet",
    "digits_split",
    "load_digits",
    "load_model",
    "make_test_model",
    "read_checkpoint_metadata",
    "save_checkpoint",
]

# ---------------------------------------------------------------------------------------------------
# Checkpoint metadata keys (safetensors metadata is a str -> str mapping).
META_ARCH = "odeify_arch"
META_KWARGS = "odeify_kwargs"
META_DIGITS = "odeify_digits"

SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
CHECKPOINT_SUFFIXES = SAFETENSORS_SUFFIXES + TORCH_SUFFIXES
_HUB_PREFIXES = ("hf-hub:", "hf_hub:")

# ---------------------------------------------------------------------------------------------------
# The project's own trained model: a small timm ResNet on scikit-learn's 8x8 digits.
DIGITS_ARCH = "odeify.digits_resnet"
DIGITS_SIZE = 32  # images are upsampled 8x8 -> 32x32: stem /4 leaves 8x8 and 4x4 feature maps
DIGITS_SEED = 0  # seed of the train/test permutation
DIGITS_TEST_FRACTION = 0.2
DIGITS_MEAN = 0.3053  # mean and std of pixel/16 over the whole data set (fixed constants, not fitted)
DIGITS_STD = 0.3761
DIGITS_NUM_CLASSES = 10


class DigitsResNet(ResNet):
    """timm's ResNet with any number of stages (the digits model has two).

    timm's ``ResNet.forward_features`` calls layer1..layer4 by name, so a two-stage ResNet needs
    this one override; everything else (stem, blocks, head, init, fx tracing) is timm's.
    """

    def forward_features(self, x: Tensor) -> Tensor:
        """Stem, then every ``layerN`` stage in order."""
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        stages = [getattr(self, f"layer{i + 1}") for i in range(len(self.feature_info) - 1)]
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(stages, x, flatten=True)
        for stage in stages:
            x = stage(x)
        return x


def digits_resnet(
    *,
    layers: tuple[int, ...] | list[int] = (4, 4),
    channels: tuple[int, ...] | list[int] = (16, 32),
    stem_width: int = 8,
    stem_type: str = "deep",
    in_chans: int = 1,
    num_classes: int = DIGITS_NUM_CLASSES,
    img_size: int = DIGITS_SIZE,
    **kwargs: Any,
) -> nn.Module:
    """Build the digits ResNet: timm's ResNet with BasicBlocks, sized for 1x32x32 inputs.

    The deep stem's output width (2 * stem_width) equals channels[0], so every block of stage 1 and
    all but the first of stage 2 are same-shape identity blocks (runs of 4 and 3 with the defaults).
    Spatial sizes for 32x32 inputs: stem 32 -> 16 -> 8 (max pool), stage 1 at 8x8, stage 2 at 4x4.
    ``img_size`` only sets ``pretrained_cfg["input_size"]`` (the net itself is size agnostic).
    """
    model = DigitsResNet(
        block=BasicBlock,
        layers=tuple(layers),
        channels=tuple(channels),
        stem_width=stem_width,
        stem_type=stem_type,
        in_chans=in_chans,
        num_classes=num_classes,
        **kwargs,
    )
    cfg = {
        "architecture": DIGITS_ARCH,
        "input_size": (in_chans, img_size, img_size),
        "num_classes": num_classes,
        "mean": (DIGITS_MEAN,) * in_chans,
        "std": (DIGITS_STD,) * in_chans,
        "first_conv": "conv1.0",
        "classifier": "fc",
    }
    model.pretrained_cfg = cfg
    model.default_cfg = cfg
    return model


_ODEIFY_ARCHS: dict[str, Callable[..., nn.Module]] = {DIGITS_ARCH: digits_resnet}


def digits_split(
    seed: int = DIGITS_SEED, test_fraction: float = DIGITS_TEST_FRACTION, n: int = 1797
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices into the digits data set; stable across numpy versions."""
    perm = np.random.RandomState(seed).permutation(n)  # legacy RandomState: a frozen stream
    n_test = int(round(n * test_fraction))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def load_digits(
    split: str = "test", size: int = DIGITS_SIZE, *, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """The digits ``(x, y)`` exactly as the shipped model was trained on them.

    ``x``: (N, 1, size, size), pixel/16 standardised with DIGITS_MEAN/DIGITS_STD, then bilinearly
    upsampled; ``y``: int64 labels. ``split`` is "train", "test" (the held-out 20%) or "all".
    """
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as exc:  # pragma: no cover - scikit-learn is in the test extra
        raise OdeifyError(
            "load_digits needs scikit-learn (the digits data ship with it): pip install scikit-learn"
        ) from exc
    data = sk_load_digits()
    images = torch.from_numpy(data.images).to(torch.float32)
    labels = torch.from_numpy(data.target).to(torch.int64)
    train_idx, test_idx = digits_split(n=len(labels))
    if split == "train":
        idx = torch.from_numpy(train_idx)
    elif split == "test":
        idx = torch.from_numpy(test_idx)
    elif split == "all":
        idx = torch.arange(len(labels))
    else:
        raise OdeifyError(f"load_digits: split must be 'train', 'test' or 'all', not {split!r}")
    x = ((images[idx] / 16.0 - DIGITS_MEAN) / DIGITS_STD).unsqueeze(1)
    if size != x.shape[-1]:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x.to(dtype).contiguous(), labels[idx]


# ---------------------------------------------------------------------------------------------------
# Names -> modules


def _is_arch_name(name: str) -> bool:
    """True for names odeify or timm can build (timm pretrained tags such as ``.a1_in1k`` included)."""
    return name in _ODEIFY_ARCHS or name.startswith(_HUB_PREFIXES) or timm.is_model(name)


def _looks_like_path(source: str) -> bool:
    """True when a string that is not an arch name should be read as a file path."""
    return (
        Path(source).suffix.lower() in CHECKPOINT_SUFFIXES
        or "/" in source
        or os.sep in source
        or source.startswith(("~", "."))
        or Path(source).exists()
    )


def _unknown_name_error(name: str) -> ModelLoadError:
    """An error naming the closest timm/odeify names and the checkpoint-file alternative."""
    candidates = [*timm.list_models(), *_ODEIFY_ARCHS]
    close = difflib.get_close_matches(name, candidates, n=5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ModelLoadError(
        f"unknown model {name!r}: not a timm model name nor an odeify arch.{hint} "
        f"See timm.list_models('{name[:4]}*') for names; a path to a local checkpoint file "
        f"({'/'.join(CHECKPOINT_SUFFIXES)}) works too."
    )


def _construct(name: str, pretrained: bool, kwargs: Mapping[str, Any]) -> nn.Module:
    """Build ``name``; unknown names raise ModelLoadError, bad kwargs raise timm's TypeError as is."""
    if name in _ODEIFY_ARCHS:
        if pretrained:
            raise ModelLoadError(
                f"{name!r} has no downloadable weights; its trained weights ship with odeify: "
                f"load_model(odeify.models.DEFAULT_MODEL_PATH)"
            )
        return _ODEIFY_ARCHS[name](**kwargs)
    if not _is_arch_name(name):
        raise _unknown_name_error(name)
    hub = name.startswith(_HUB_PREFIXES)  # hub names fetch their config even with pretrained=False
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


# ---------------------------------------------------------------------------------------------------
# Checkpoint files


def _check_file(path: Path) -> None:
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
    _check_file(path)
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
            f"torch.save(model.state_dict(), path) or odeify.models.save_checkpoint"
        )
    bad = [k for k, v in obj.items() if not isinstance(v, Tensor)]
    if bad:
        raise ModelLoadError(
            f"{path} is not a flat state dict: entries {bad[:5]} are not tensors; "
            f"expected a name -> tensor mapping, raw or under 'state_dict'/'model'"
        )
    return _strip_prefix({str(k): v for k, v in obj.items()})


def _read_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Read ``(state_dict, metadata)`` from a checkpoint file, without unpickling objects."""
    _check_file(path)
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
            f"torch.save(model.state_dict(), path), or odeify.models.save_checkpoint. ({exc})"
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


def _load_into(model: nn.Module, path: Path, arch: str) -> nn.Module:
    """Overwrite ``model``'s weights from the checkpoint at ``path`` (keeping a float64 file float64)."""
    state, meta = _read_checkpoint(path)
    dtype = _float_dtype(state)
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    _apply_state_dict(model, state, path, arch, meta)
    return model


def _load_file(path: Path, arch: str | None, timm_kwargs: dict[str, Any]) -> nn.Module:
    """Build the checkpoint's arch (from its metadata or ``arch=``) and load its weights."""
    _check_file(path)
    meta = read_checkpoint_metadata(path)
    kwargs: dict[str, Any] = {}
    if arch is None:
        arch = meta.get(META_ARCH)
        if arch is None:
            raise ModelLoadError(
                f"{path} does not say which architecture it holds; pass it: "
                f"load_model({str(path)!r}, arch='resnet50', num_classes=...) "
                f"(files written by odeify.models.save_checkpoint record it themselves)"
            )
        try:
            kwargs = json.loads(meta.get(META_KWARGS, "{}"))
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: corrupt {META_KWARGS} metadata: {exc}") from exc
    elif meta.get(META_ARCH) == arch:
        kwargs = json.loads(meta.get(META_KWARGS, "{}"))
    kwargs.update(timm_kwargs)  # explicit kwargs (drop_path_rate=...) win over recorded ones
    return _load_into(_build(arch, False, kwargs), path, arch)


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
            model = _load_into(model, Path(checkpoint).expanduser(), type(model).__name__)
        return model.eval()
    if not isinstance(source, (str, os.PathLike)):
        raise ModelLoadError(
            f"load_model takes an nn.Module, a timm model name or a checkpoint path, "
            f"not {type(source).__name__}"
        )
    name = os.fspath(source)
    if isinstance(source, str) and _is_arch_name(name):
        if arch is not None and arch != name:
            raise ModelLoadError(f"arch={arch!r} conflicts with the model name {name!r}; pass one")
        model = _build(name, pretrained, timm_kwargs)
        if checkpoint is not None:
            model = _load_into(model, Path(checkpoint).expanduser(), name)
        return model.eval()
    if isinstance(source, str) and not _looks_like_path(name):
        raise _unknown_name_error(name)
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
    if not _is_arch_name(arch):
        raise _unknown_name_error(arch)
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


# ---------------------------------------------------------------------------------------------------
# Models for tests


_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, timm BatchNormAct2d, InstanceNorm*, SyncBatchNorm
    nn.GroupNorm,
    nn.LayerNorm,
)


def make_test_model(
    name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **timm_kwargs: Any
) -> nn.Module:
    """A random-weight model whose every residual branch does something, for exactness tests.

    timm zero-inits the last norm of each residual branch by default, which turns every block into
    an identity and lets wrong code pass. Here: ``zero_init_last=False`` where the constructor takes
    it, BN running stats and affine parameters randomised (mean ~ N(0, 0.1^2), var and weight in
    [0.5, 1.5], bias ~ N(0, 0.1^2)), and any remaining all-zero non-bias parameter (NF-ResNet skipinit
    gains, zeroed norm or conv weights) re-randomised. Deterministic in ``seed``; the global RNG is
    left untouched. Randomised in float32, then converted to ``dtype`` (so fp64 = upcast fp32).
    """
    kwargs = dict(timm_kwargs)
    pass_zero_init = "zero_init_last" not in kwargs
    if pass_zero_init:
        kwargs["zero_init_last"] = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = _construct(name, False, kwargs)
        except TypeError as exc:
            if not (pass_zero_init and "zero_init_last" in str(exc)):
                raise ModelLoadError(f"cannot build {name!r} with kwargs {timm_kwargs}: {exc}") from exc
            kwargs.pop("zero_init_last")
            model = _build(name, False, kwargs)
        _randomize(model)
    return model.eval().to(dtype)


@torch.no_grad()
def _randomize(model: nn.Module) -> None:
    """Randomise norm statistics/affines and every all-zero non-bias parameter, in place."""
    for mod in model.modules():
        mean, var = getattr(mod, "running_mean", None), getattr(mod, "running_var", None)
        if isinstance(mean, Tensor) and isinstance(var, Tensor):
            mean.normal_().mul_(0.1)
            var.uniform_(0.5, 1.5)
        if isinstance(mod, _NORM_TYPES) or isinstance(mean, Tensor):
            weight, bias = getattr(mod, "weight", None), getattr(mod, "bias", None)
            if isinstance(weight, Tensor):
                weight.uniform_(0.5, 1.5)
            if isinstance(bias, Tensor):
                bias.normal_().mul_(0.1)
    for pname, param in model.named_parameters():
        if param.numel() == 0 or pname.endswith("bias") or bool(param.any()):
            continue
        if param.numel() == (param.shape[0] if param.ndim else 1):  # gains/scales, (C,) or (C, 1, 1, 1)
            param.uniform_(0.5, 1.5)
        else:  # a zeroed conv/linear weight: fan-in scaled normal
            param.normal_().mul_(1.0 / math.sqrt(param[0].numel()))


# ---------------------------------------------------------------------------------------------------


def default_input_size(model: nn.Module) -> tuple[int, int, int, int]:
    """(1, C, H, W) from timm's ``pretrained_cfg["input_size"]``, else (1, 3, 224, 224).

    C follows ``model.in_chans`` where timm records it, since ``in_chans=1`` does not update the cfg.
    """
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    size = cfg.get("input_size") if isinstance(cfg, Mapping) else None
    if not (isinstance(size, (tuple, list)) and len(size) == 3):
        size = (3, 224, 224)
    chans = getattr(model, "in_chans", None)
    c = chans if isinstance(chans, int) and chans > 0 else size[0]
    return (1, int(c), int(size[1]), int(size[2]))
