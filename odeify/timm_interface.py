"""What timm knows about a model that odeify reads or keeps: its pretrained config and input size."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["default_input_size"]


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
