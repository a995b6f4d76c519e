"""The dtype a module computes in: the one expression every layer asks for."""

from __future__ import annotations

import torch
from torch import nn


def model_dtype(module: nn.Module, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of ``module``'s first floating-point parameter (``default`` when it has none)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), default)
