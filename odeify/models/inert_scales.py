"""The parameters that silence a model's residual branches: zeroed norm scales and tiny LayerScales.

A timm model built without weights has them: timm zero-initialises the last norm of each residual
branch, and ConvNeXt's and CaiT's LayerScale gammas start at 1e-6 and 1e-5. A branch they scale
outputs (almost) nothing, so comparing a converted model with such a source says little about the
branches: ``odeify convert`` names them beside its verification.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TINY_SCALE", "inert_scales", "is_per_channel"]

TINY_SCALE = 1e-4
"""A per-channel scale no larger than this is counted as silencing its branch (timm's LayerScale
starts at 1e-6 or 1e-5; trained ones are orders of magnitude larger)."""


def is_per_channel(param: torch.Tensor) -> bool:
    """Whether ``param`` holds one value per channel: shape (C,) or (C, 1, ..., 1)."""
    return param.numel() == (param.shape[0] if param.ndim else 1)


def inert_scales(model: nn.Module) -> list[str]:
    """Names of ``model``'s non-bias parameters that are all zero, or per-channel and at most
    :data:`TINY_SCALE` in magnitude (shape (C,) or (C, 1, ..., 1))."""
    found = []
    for name, param in model.named_parameters():
        if param.numel() == 0 or name.endswith("bias"):
            continue
        largest = param.detach().abs().max().item()
        if largest == 0 or (is_per_channel(param) and largest <= TINY_SCALE):
            found.append(name)
    return found
