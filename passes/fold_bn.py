"""Transformation pass: fold eval-mode BatchNorm into the conv before it, or into a per-channel affine.

Handles ``nn.BatchNorm*`` and timm's ``BatchNormAct2d`` family (their ``drop`` and ``act`` parts
stay in the graph); torch's own ``fuse`` misses the timm classes. After this pass a stage's
parameters are plain conv/linear weights and biases, and per-channel scales and shifts, which
interpolate linearly. Preserves computation (exact in real arithmetic; fp64 to round-off).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from odeify.passes.graph_utils import fetch_attr
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from odeify.errors import ConfigError

PRESERVES_COMPUTATION = True

_CONVS = {torch.conv1d, torch.conv2d, torch.conv3d}


class FoldedNorm(nn.Module):
    """What remains of a folded norm layer: its per-channel affine (if any) and its drop/act parts."""

    def __init__(self, drop: nn.Module | None, act: nn.Module | None) -> None:
        super().__init__()
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()


def fold_batchnorm(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold every BatchNorm of ``gm`` in place (the caller passes a copy) and return it."""
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        bn = gm.get_submodule(node.target)
        if not isinstance(bn, _BatchNorm):
            continue
        scale, shift = _affine_of(bn, node.target)
        producer = node.args[0]
        folded_into_conv = _fold_into_conv(gm, producer, scale, shift)
        remainder = FoldedNorm(getattr(bn, "drop", None), getattr(bn, "act", None))
        _replace_submodule(gm, node.target, remainder)
        with gm.graph.inserting_before(node):
            out = producer
            steps: list[fx.Node] = []  # the data nodes that replace the BN, all of its shape
            if not folded_into_conv:
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
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _affine_of(bn: _BatchNorm, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode BN as ``x * scale + shift``."""
    if bn.running_mean is None or bn.running_var is None:
        raise ConfigError(
            f"BatchNorm '{name}' has no running statistics (track_running_stats=False), so it cannot be "
            "folded into a fixed affine map. Convert a model whose BatchNorms track running statistics."
        )
    with torch.no_grad():
        inv_std = torch.rsqrt(bn.running_var + bn.eps)
        weight = bn.weight if bn.weight is not None else torch.ones_like(inv_std)
        bias = bn.bias if bn.bias is not None else torch.zeros_like(inv_std)
        scale = weight * inv_std
        return scale.detach().clone(), (bias - bn.running_mean * scale).detach().clone()


def _fold_into_conv(gm: fx.GraphModule, producer, scale: torch.Tensor, shift: torch.Tensor) -> bool:
    """Scale the conv's weight and bias when the BN reads a conv with a plain weight used only there."""
    if not (isinstance(producer, fx.Node) and producer.op == "call_function" and producer.target in _CONVS):
        return False
    weight_node = producer.args[1]
    bias_node = producer.args[2] if len(producer.args) > 2 else producer.kwargs.get("bias")
    if len(producer.users) != 1 or not (isinstance(weight_node, fx.Node) and weight_node.op == "get_attr"):
        return False
    if len(weight_node.users) != 1:
        return False
    weight = fetch_attr(gm, weight_node.target)
    with torch.no_grad():
        view = (-1,) + (1,) * (weight.dim() - 1)
        new_weight = weight * scale.reshape(view).to(weight.dtype)
        if isinstance(bias_node, fx.Node):
            new_bias = fetch_attr(gm, bias_node.target) * scale + shift
        else:
            new_bias = shift.to(weight.dtype)
    owner_path, _, attr = weight_node.target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    setattr(owner, attr, nn.Parameter(new_weight, requires_grad=weight.requires_grad))
    if isinstance(bias_node, fx.Node):
        b_owner_path, _, b_attr = bias_node.target.rpartition(".")
        b_owner = gm.get_submodule(b_owner_path) if b_owner_path else gm
        setattr(b_owner, b_attr, nn.Parameter(new_bias))
    else:
        bias_target = f"{owner_path}.bias" if owner_path else "bias"
        owner.register_parameter("bias", nn.Parameter(new_bias))
        with gm.graph.inserting_before(producer):
            bias_node = gm.graph.get_attr(bias_target)
        args = list(producer.args)
        if len(args) > 2:
            args[2] = bias_node
            producer.args = tuple(args)
        else:
            producer.kwargs = {**producer.kwargs, "bias": bias_node}
    return True


def _replace_submodule(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    parent_path, _, name = target.rpartition(".")
    parent = gm.get_submodule(parent_path) if parent_path else gm
    setattr(parent, name, module)
