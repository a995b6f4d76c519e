"""Random-weight test models whose every residual branch does something (for tests and benchmarks).

Private: not part of odeify's public API. timm zero-inits the last norm of each residual branch, so a
fresh timm model's blocks are identities and wrong code passes; ``make_test_model`` undoes that.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from odeify.core.errors import ModelLoadError
from odeify.models.archs import build_arch
from odeify.models.inert_scales import is_per_channel

__all__ = ["make_test_model"]

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
    [0.5, 1.5], bias ~ N(0, 0.1^2)), every per-channel scale filled with one constant re-drawn in
    [0.5, 1.5] (LayerScale gammas, 1e-6 in ConvNeXt and 1e-5 in CaiT, would make each branch
    vanish; PoolFormerV2's ``res_scale`` ones would hide a wrong shortcut), and any remaining
    all-zero non-bias parameter (NF-ResNet skipinit gains, zeroed norm or conv weights)
    re-randomised. Deterministic in ``seed``; the global RNG is left untouched. Randomised in
    float32, then converted to ``dtype`` (so fp64 = upcast fp32).
    """
    kwargs = dict(timm_kwargs)
    pass_zero_init = "zero_init_last" not in kwargs
    if pass_zero_init:
        kwargs["zero_init_last"] = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = build_arch(name, kwargs)
        except ModelLoadError as exc:
            if not (pass_zero_init and "zero_init_last" in str(exc.__cause__)):
                raise
            kwargs.pop("zero_init_last")
            model = build_arch(name, kwargs)
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
        if param.numel() == 0 or pname.endswith("bias"):
            continue
        if is_per_channel(param) and param.numel() > 1 and bool((param == param.flatten()[0]).all()):
            param.uniform_(0.5, 1.5)  # a gain or scale filled with one value: LayerScale, res_scale
        elif bool(param.any()):
            continue
        elif is_per_channel(param):  # zeroed gains/scales
            param.uniform_(0.5, 1.5)
        else:  # a zeroed conv/linear weight: fan-in scaled normal
            param.normal_().mul_(1.0 / math.sqrt(param[0].numel()))
