"""Fold records: what folding a BatchNorm took out of a model, kept beside the folded tensors.

``passes/fold_bn.py`` leaves one :class:`FoldRecord` per folded BatchNorm in ``gm.folds``, and
``passes/lift.py`` stacks a run's records into its stage's ``stage.folds``; the forward never reads
them. Fine-tuning trains the folded tensors in the coordinates they give
(:mod:`odeify.train.parametrization`), ``odeify.save``/``load`` write and check them
(:mod:`odeify.serialization.records`), and the manifestation pass refits them with the knots.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FOLDS", "FoldRecord", "add_fold_record", "drop_fold_records", "fold_records", "record_key"]

FOLDS = "folds"
"""The attribute holding a module's fold records: ``gm.folds`` (discrete layers), ``stage.folds``."""


class FoldRecord(nn.Module):
    """What folding one BatchNorm took out of the model: the source's parametrization of what it folded.

    Per output channel ``c`` (with a leading knot axis when the record belongs to a stage), the
    folded tensors are, exactly as ``torch.nn.utils.fusion.fuse_conv_bn_weights`` computes them,

        scaled[c]  = weight[c] * gamma[c] * inv_std[c]      (kind 'conv': weight is the conv's own)
        scaled[c]  = gamma[c] * inv_std[c]                  (kind 'affine': a per-channel scale)
        shifted[c] = beta[c] + offset[c] * gamma[c] * inv_std[c]

    with ``inv_std = 1 / sqrt(running_var + eps)`` and ``offset = conv bias - running_mean`` (the
    conv's bias is 0 when it had none; kind 'affine': ``-running_mean``). The buffers hold
    ``gamma`` (the BatchNorm's weight, which fine-tuning trains along and writes back), ``inv_std``
    and ``offset`` (the frozen statistics). ``scaled`` and ``shifted`` are the attribute paths of
    the folded tensors relative to the module that holds the record's container (the converted
    model, or a stage: ``knots.conv2_weight``). ``learnable``: whether the BatchNorm had an affine
    weight and bias (the source trained them). ``norm``: the folded BatchNorm's module path in the
    source (in a stage: the first block's).
    """

    def __init__(
        self,
        gamma: torch.Tensor,
        inv_std: torch.Tensor,
        offset: torch.Tensor,
        *,
        kind: str,
        scaled: str,
        shifted: str,
        norm: str,
        learnable: bool = True,
    ) -> None:
        super().__init__()
        self.register_buffer("gamma", gamma)
        self.register_buffer("inv_std", inv_std)
        self.register_buffer("offset", offset)
        self.kind, self.scaled, self.shifted, self.norm = kind, scaled, shifted, norm
        self.learnable = learnable

    def extra_repr(self) -> str:
        return f"norm={self.norm!r}, kind={self.kind}, scaled={self.scaled!r}, shifted={self.shifted!r}"


def fold_records(owner: nn.Module) -> dict[str, FoldRecord]:
    """The fold records ``owner`` (a converted model or a stage) holds, by key; empty if none."""
    container = getattr(owner, FOLDS, None)
    return dict(container.items()) if isinstance(container, nn.ModuleDict) else {}


def add_fold_record(owner: nn.Module, key: str, record: FoldRecord) -> None:
    """Keep ``record`` in ``owner.folds`` under ``key`` (a Python name), creating the container."""
    if not isinstance(getattr(owner, FOLDS, None), nn.ModuleDict):
        owner.add_module(FOLDS, nn.ModuleDict())
    getattr(owner, FOLDS)[key] = record


def drop_fold_records(owner: nn.Module) -> None:
    """Remove every fold record of ``owner`` and of its stages (a file saved before records existed)."""
    for module in list(owner.modules()):
        if isinstance(getattr(module, FOLDS, None), nn.ModuleDict):
            delattr(module, FOLDS)


def record_key(path: str) -> str:
    """A fold record's key from a module path: 'layer1.0.bn2' -> 'layer1_0_bn2' (a Python name)."""
    return path.replace(".", "_")
