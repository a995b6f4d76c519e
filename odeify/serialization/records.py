"""Load's check of the fold records: tensors a saved model's forward never reads, but fine-tuning does.

A fold record (:class:`odeify.ir.fold_records.FoldRecord`) holds the coordinates fine-tuning trains
the folded tensors in (:mod:`odeify.train.parametrization`): from the folded ``scaled`` and
``shifted`` and the record's ``gamma``, ``inv_std`` and ``offset`` it derives the source's conv
weight ``V`` and BatchNorm bias ``beta``, and after every step writes the folded tensors back:

    scaled  = V * (gamma * inv_std)            (affine: scaled = gamma * inv_std, no V)
    shifted = beta + offset * (gamma * inv_std)

The probe cannot see a record, so an altered one (an ``inv_std`` of 0 sets every ``V`` to 0) would
load and the first training step would rewrite the model from garbage. So each record must be what
folding a BatchNorm gives: ``inv_std = 1/sqrt(var + eps)`` with ``var >= 0`` lies in
``(0, 1/sqrt(eps)]`` for the source BatchNorm's ``eps``; and the folded tensors rebuilt from the
coordinates it gives are the file's, within the probe's rule for round-off (:data:`FACTOR` x
:data:`ULPS_FLOOR` ulps of the dtype at the tensor's largest value).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from odeify.compiler.conversion import converted_stages
from odeify.core.errors import ModelLoadError
from odeify.ir.fold_records import FoldRecord, fold_records
from odeify.serialization.probe import FACTOR, ULPS_FLOOR

__all__ = ["check_fold_records"]


@torch.no_grad()
def check_fold_records(model: nn.Module, source: nn.Module, path: Path) -> None:
    """Refuse a loaded ``model`` whose fold records are not what folding ``source``'s BatchNorms gives."""
    stages = {id(stage) for stage in converted_stages(model)}
    owners = [("", model)] + [(f"{name}.", m) for name, m in model.named_modules() if id(m) in stages]
    for prefix, owner in owners:
        for key, record in fold_records(owner).items():
            where = f"{path}: the fold record {prefix}folds.{key}"
            eps = source.get_submodule(record.norm).eps
            _check_inv_std(record, eps, where)
            scaled, shifted = owner.get_parameter(record.scaled), owner.get_parameter(record.shifted)
            for name, folded, rebuilt in (
                (record.scaled, scaled, _rebuilt_scaled(record, scaled)),
                (record.shifted, shifted, _rebuilt_shifted(record, shifted)),
            ):
                _check_rebuilt(folded, rebuilt, f"{where} does not rebuild {prefix}{name}")


def _check_inv_std(record: FoldRecord, eps: float, where: str) -> None:
    """``inv_std`` in (0, 1/sqrt(eps)], up to the round-off of computing it in its dtype."""
    inv_std = record.inv_std.double()
    largest = eps**-0.5 * (1 + FACTOR * ULPS_FLOOR * torch.finfo(record.inv_std.dtype).eps)
    if not bool(((inv_std > 0) & (inv_std <= largest)).all()):
        low, high = float(inv_std.min()), float(inv_std.max())
        raise ModelLoadError(
            f"{where} holds inv_std from {low:.3g} to {high:.3g}, which no BatchNorm gives: "
            f"1/sqrt(var + eps) with var >= 0 and eps {eps:g} lies in (0, {eps**-0.5:.4g}]. Fine-tuning "
            "would train in wrong coordinates. The file is damaged or was altered; save the model again "
            "from its source."
        )


def _factor(record: FoldRecord, like: torch.Tensor) -> torch.Tensor:
    """``gamma * inv_std`` in ``like``'s dtype, shaped to multiply ``like`` per channel (and knot)."""
    view = (*record.gamma.shape, *(1,) * (like.dim() - record.gamma.dim()))
    return (record.gamma * record.inv_std).reshape(view)


def _rebuilt_scaled(record: FoldRecord, scaled: torch.Tensor) -> torch.Tensor:
    """``scaled`` as fine-tuning writes it back before any step: from ``V = scaled / factor``."""
    factor = _factor(record, scaled)
    if record.kind != "conv":
        return factor
    wide = factor.double()
    weight = torch.where(wide != 0, scaled.double() / wide, 0.0).to(scaled.dtype)
    return weight * factor


def _rebuilt_shifted(record: FoldRecord, shifted: torch.Tensor) -> torch.Tensor:
    """``shifted`` as fine-tuning writes it back before any step: from ``beta = shifted - offset*factor``."""
    factor = _factor(record, shifted)
    offset = record.offset.reshape(factor.shape)
    beta = (shifted.double() - offset.double() * factor.double()).to(shifted.dtype)
    return beta + offset * factor


def _check_rebuilt(folded: torch.Tensor, rebuilt: torch.Tensor, what: str) -> None:
    """``rebuilt`` within FACTOR x ULPS_FLOOR ulps of ``folded``'s largest value, everywhere."""
    distance = float((rebuilt.double() - folded.double()).abs().max())
    allowed = FACTOR * ULPS_FLOOR * torch.finfo(folded.dtype).eps * float(folded.abs().max())
    if not distance <= allowed:  # NaN fails too
        raise ModelLoadError(
            f"{what}: the coordinates fine-tuning would train in give a tensor {distance:.3g} from the saved "
            f"one, over the {allowed:.3g} that round-off allows, so its first step would rewrite the model "
            "from them. The file is damaged or was altered; save the model again from its source."
        )
