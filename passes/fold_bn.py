"""Transformation pass: fold eval-mode BatchNorm into the conv before it, or into a per-channel affine.

Handles ``nn.BatchNorm*`` and timm's ``BatchNormAct2d`` family (their ``drop`` and ``act`` parts
stay in the graph); torch's own ``fuse`` misses the timm classes. After this pass a stage's
parameters are plain conv/linear weights and biases, and per-channel scales and shifts, which
interpolate linearly. Preserves computation (exact in real arithmetic; fp64 to round-off).

Each fold leaves a :class:`FoldRecord` in ``gm.folds``: the BatchNorm's affine weight and frozen
statistics, per channel, so that fine-tuning can train the folded tensors in the coordinates the
source's optimizer saw (``odeify.train.parametrization``); the forward never reads it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils.fusion import fuse_conv_bn_weights

from odeify.core.errors import ConfigError
from odeify.ir.fold_records import FoldRecord, add_fold_record, fold_records, record_key
from odeify.passes.contract import PassResult, graph_pass, transformation
from odeify.passes.graph_utils import fetch_attr, set_attr, unique_name
from odeify.passes.properties import BLOCKS, BN_FOLDED, RUNS, SHAPES

FOLD_BATCHNORM = transformation(
    "fold_batchnorm",
    requires={SHAPES},
    ensures={BN_FOLDED},
    invalidates={BLOCKS, RUNS},  # the erased BN nodes may be named by block tags
)

_CONVS = {torch.conv1d, torch.conv2d, torch.conv3d}


class FoldedNorm(nn.Module):
    """What remains of a folded norm layer: its per-channel affine (if any) and its drop/act parts."""

    def __init__(self, drop: nn.Module | None, act: nn.Module | None) -> None:
        super().__init__()
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()


@graph_pass(FOLD_BATCHNORM)
def fold_batchnorm(gm: fx.GraphModule) -> PassResult:
    """Fold every BatchNorm of ``gm`` in place (the caller passes a copy); modified if there was one."""
    folded_any = False
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        bn = gm.get_submodule(node.target)
        if not isinstance(bn, _BatchNorm):
            continue
        _check_running_stats(bn, node.target)
        producer = node.args[0]
        folded = _fold_into_conv(gm, producer, bn)
        folded_into_conv = folded is not None
        remainder = FoldedNorm(getattr(bn, "drop", None), getattr(bn, "act", None))
        set_attr(gm, node.target, remainder)
        with gm.graph.inserting_before(node):
            out = producer
            steps: list[fx.Node] = []  # the data nodes that replace the BN, all of its shape
            if folded_into_conv:
                record = _record(bn, node.target, "conv", *folded)
            else:
                scale, shift = _affine_of(bn)
                record = _record(
                    bn, node.target, "affine", f"{node.target}.scale", f"{node.target}.shift", None
                )
                view = (-1,) + (1,) * (len(node.meta["tensor_meta"].shape) - 2)
                remainder.register_parameter("scale", nn.Parameter(scale.reshape(view)))
                remainder.register_parameter("shift", nn.Parameter(shift.reshape(view)))
                s = gm.graph.get_attr(f"{node.target}.scale")
                b = gm.graph.get_attr(f"{node.target}.shift")
                out = gm.graph.call_function(torch.addcmul, (b, out, s))
                steps.append(out)
            for part in ("drop", "act"):
                if not isinstance(getattr(remainder, part), nn.Identity):
                    out = gm.graph.call_module(f"{node.target}.{part}", (out,))
                    steps.append(out)
        for step in steps:
            step.meta["tensor_meta"] = node.meta.get("tensor_meta")
        add_fold_record(gm, unique_name(record_key(node.target), fold_records(gm)), record)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        folded_any = True
    return PassResult(gm, modified=folded_any)


def _check_running_stats(bn: _BatchNorm, name: str) -> None:
    if bn.running_mean is None or bn.running_var is None:
        raise ConfigError(
            f"BatchNorm '{name}' has no running statistics (track_running_stats=False), so it cannot be "
            "folded into a fixed affine map. Convert a model whose BatchNorms track running statistics."
        )


def _record(
    bn: _BatchNorm, norm: str, kind: str, scaled: str, shifted: str, conv_bias: torch.Tensor | None
) -> FoldRecord:
    """The record of folding ``bn`` into ``scaled`` and ``shifted`` (the conv's bias or None: zero)."""
    with torch.no_grad():
        mean, var = bn.running_mean.detach(), bn.running_var.detach()
        gamma = bn.weight.detach().clone() if bn.weight is not None else torch.ones_like(var)
        inv_std = torch.rsqrt(var + bn.eps)
        offset = (conv_bias.detach() if conv_bias is not None else torch.zeros_like(mean)) - mean
    dtype = var.dtype
    return FoldRecord(
        gamma.to(dtype),
        inv_std,
        offset.to(dtype),
        kind=kind,
        scaled=scaled,
        shifted=shifted,
        norm=norm,
        learnable=bn.weight is not None,
    )


def _affine_of(bn: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode BN as ``x * scale + shift``: what it fuses into a 1x1 conv whose weight is all ones."""
    ones = torch.ones_like(bn.running_var).unsqueeze(1)  # (C, 1): a conv weight, out channels first
    with torch.no_grad():
        scale, shift = fuse_conv_bn_weights(
            ones, None, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias
        )
    return scale.detach().flatten(), shift.detach()


def _fold_into_conv(
    gm: fx.GraphModule, producer, bn: _BatchNorm
) -> tuple[str, str, torch.Tensor | None] | None:
    """Fold the BN into the conv it reads when that conv has a plain weight used only there.

    Returns the folded weight's and bias's attribute paths and the conv's own bias before the fold
    (None when it had none), or None when the BN does not read such a conv.

    The arithmetic is torch's ``fuse_conv_bn_weights``; torch's graph-level ``fuse`` is not used
    because it matches ``nn.Conv2d``/``nn.BatchNorm2d`` modules only, and here convs are traced into
    functional calls and timm's ``BatchNormAct2d`` carries act/drop parts that must stay.
    """
    if not (isinstance(producer, fx.Node) and producer.op == "call_function" and producer.target in _CONVS):
        return None
    weight_node = producer.args[1]
    bias_node = producer.args[2] if len(producer.args) > 2 else producer.kwargs.get("bias")
    if len(producer.users) != 1 or not (isinstance(weight_node, fx.Node) and weight_node.op == "get_attr"):
        return None
    if len(weight_node.users) != 1:
        return None
    weight = fetch_attr(gm, weight_node.target)
    bias = fetch_attr(gm, bias_node.target) if isinstance(bias_node, fx.Node) else None
    with torch.no_grad():
        new_weight, new_bias = fuse_conv_bn_weights(
            weight, bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias
        )
    new_bias.requires_grad_(weight.requires_grad)  # a new bias trains with its conv
    set_attr(gm, weight_node.target, new_weight)
    if isinstance(bias_node, fx.Node):
        set_attr(gm, bias_node.target, new_bias)
        return weight_node.target, bias_node.target, bias
    owner_path = weight_node.target.rpartition(".")[0]
    bias_target = f"{owner_path}.bias" if owner_path else "bias"
    set_attr(gm, bias_target, new_bias)
    with gm.graph.inserting_before(producer):
        bias_node = gm.graph.get_attr(bias_target)
    args = list(producer.args)
    if len(args) > 2:
        args[2] = bias_node
        producer.args = tuple(args)
    else:
        producer.kwargs = {**producer.kwargs, "bias": bias_node}
    return weight_node.target, bias_target, None
