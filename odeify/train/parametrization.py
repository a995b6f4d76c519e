"""Fine-tuning in the source's coordinates: the optimizer trains what the source's optimizer trained.

Folding a BatchNorm into the conv before it multiplies each output channel of the conv's weight by
``gamma / sigma`` (docs/design.md, section 4). After a short training run those factors are tiny
where timm zero-initialises the last BatchNorm of each residual branch (0.006 to 0.04 in the
corpus's resnet18), so an Adam step, about ``lr`` per element, is as large as the folded weights
themselves: one step of the learning rate the source trained with destroys the converted model.

So the optimizer never sees a folded tensor. For every folded BatchNorm (its
:class:`~odeify.ir.fold_records.FoldRecord`) fine-tuning keeps the source's own tensors of that
layer, the conv weight ``V`` (none for a per-channel affine), the BatchNorm's ``gamma`` and
``beta``, and trains those; the folded tensors are a function of them and the frozen statistics:

    scaled  = V * (gamma * inv_std)            (affine: gamma * inv_std)
    shifted = beta + offset * (gamma * inv_std)

The model keeps computing with its folded tensors, so its forward, every backward mode, DDP and the
weight average work on them unchanged: after the backward pass :meth:`SourceCoordinates.pull`
turns their gradients into the source tensors' (the chain rule through the two lines above, by
autograd), and after the optimizer step :meth:`SourceCoordinates.push` writes the folded tensors,
and gamma into the record, back. With its statistics frozen, as folding freezes them, a step
changes the converted model as the same step changes the source (``tests/test_parametrization.py``).
In a stage the same holds per knot; a compressed or refined knot has a record fitted with its
knots (:func:`odeify.passes.manifest.refit_fold_records`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from fnmatch import fnmatch

import torch
from torch import nn

from odeify.compiler.conversion import converted_stages
from odeify.core.errors import ConfigError
from odeify.ir.fold_records import FoldRecord, fold_records

__all__ = ["SourceCoordinates", "param_groups"]

PREFIX = "source"  # the names of the source tensors among what the optimizer trains: source.<key>.<part>


class _SourceLayer(nn.Module):
    """The source tensors of one folded layer, and how the model's folded tensors follow from them."""

    def __init__(self, record: FoldRecord, scaled: nn.Parameter, shifted: nn.Parameter) -> None:
        super().__init__()
        self.record = [record]  # in a list: not a submodule (the model owns it)
        self.folded = [scaled, shifted]  # the model's parameters, not this module's
        dims = record.gamma.dim()
        self.scaled_view = (*record.gamma.shape, *(1,) * (scaled.dim() - dims))
        self.shifted_view = (*record.gamma.shape, *(1,) * (shifted.dim() - dims))
        with torch.no_grad():
            factor = (record.gamma.double() * record.inv_std.double()).reshape(self.scaled_view)
            if record.kind == "conv":  # V = W' / factor; a channel whose factor is 0 holds only zeros
                weight = torch.where(factor != 0, scaled.double() / factor, 0.0)
                self.weight = nn.Parameter(weight.to(scaled.dtype))
            factor = factor.reshape(self.shifted_view)
            beta = shifted.double() - record.offset.double().reshape(self.shifted_view) * factor
        self.gamma = nn.Parameter(record.gamma.detach().clone(), requires_grad=record.learnable)
        self.beta = nn.Parameter(beta.to(shifted.dtype), requires_grad=record.learnable)

    def scaled(self) -> torch.Tensor:
        record = self.record[0]
        factor = (self.gamma * record.inv_std).reshape(self.scaled_view)
        return self.weight * factor if record.kind == "conv" else factor

    def shifted(self) -> torch.Tensor:
        record = self.record[0]
        return self.beta + (record.offset * self.gamma * record.inv_std).reshape(self.shifted_view)


class SourceCoordinates(nn.Module):
    """The source tensors behind every folded layer of ``model``, and the two maps between them.

    Layers whose folded tensors the model does not train (frozen by the caller) are left out; so is
    everything of a model without fold records (a file saved before they existed), whose folded
    tensors then train as they are. ``within``: the path of one stage, whose layers alone are kept
    (calibration fits a stage at a time).
    """

    def __init__(self, model: nn.Module, within: str | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        stages = {id(stage) for stage in converted_stages(model)}
        owners = [("", model)] + [(name, m) for name, m in model.named_modules() if id(m) in stages]
        if within is not None:
            owners = [(path, owner) for path, owner in owners if path == within]
        for path, owner in owners:
            for key, record in fold_records(owner).items():
                scaled = owner.get_parameter(record.scaled)
                shifted = owner.get_parameter(record.shifted)
                fits = tuple(scaled.shape[: record.gamma.dim()]) == tuple(record.gamma.shape)
                if fits and scaled.requires_grad and shifted.requires_grad:
                    name = "__".join(filter(None, (path.replace(".", "__"), key)))
                    self.layers[name] = _SourceLayer(record, scaled, shifted)

    def replaced(self) -> set[int]:
        """The ids of the model's parameters that these source tensors stand for."""
        return {id(p) for layer in self.layers.values() for p in layer.folded}

    def named_sources(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every trainable source tensor, named ``source.<layer>.weight|gamma|beta``."""
        for key, layer in self.layers.items():
            for part, param in layer.named_parameters():
                if param.requires_grad:
                    yield f"{PREFIX}.{key}.{part}", param

    def pull(self) -> None:
        """Set each source tensor's gradient from the folded tensors' (replacing what it held)."""
        for layer in self.layers.values():
            grads = [p.grad for p in layer.folded]
            outputs = [
                f() for f, g in zip((layer.scaled, layer.shifted), grads, strict=True) if g is not None
            ]
            for param in layer.parameters():
                param.grad = None
            if outputs:
                torch.autograd.backward(outputs, [g for g in grads if g is not None])

    @torch.no_grad()
    def push(self) -> None:
        """Write the folded tensors (and each record's gamma) from the source tensors."""
        for layer in self.layers.values():
            scaled, shifted = layer.folded
            scaled.copy_(layer.scaled())
            shifted.copy_(layer.shifted())
            layer.record[0].gamma.copy_(layer.gamma)

    def adopt(self, earlier: SourceCoordinates) -> None:
        """Take over ``earlier``'s source tensors where a layer is the same (name and shapes).

        Refinement rebuilds the model: its layers outside the stages keep their source tensors
        exactly, instead of recomputing them from the folded ones (which rounds).
        """
        mine = dict(self.named_sources())
        with torch.no_grad():
            for name, param in earlier.named_sources():
                if name in mine and mine[name].shape == param.shape:
                    mine[name].copy_(param)

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore the source tensors a training state saved (this module's state dict)."""
        missing = sorted(set(self.state_dict()) - set(tensors))
        if missing:
            raise ConfigError(
                f"cannot resume: the training state holds no source tensor {missing[0]!r} (it was written by "
                "an odeify that trained the folded tensors themselves). Resume it with that odeify, or start "
                "a new run in another --out folder."
            )
        self.load_state_dict(dict(tensors))


def param_groups(
    model: nn.Module, sources: SourceCoordinates, weight_decay: float
) -> tuple[list[dict], dict[str, nn.Parameter]]:
    """The optimizer's parameter groups, as timm's ``param_groups_weight_decay`` makes them.

    What trains: every trainable parameter of ``model`` that no source tensor stands for, under its
    own name, then the source tensors. No decay for 1-D tensors, biases, the model's
    ``no_weight_decay()`` names and the source gammas and betas (stacked over knots they are 2-D, as
    a stage's knot biases are); decay for the rest (conv and linear weights). Returns the groups and
    every trained tensor by name (in group order).
    """
    replaced = sources.replaced()
    keep_out = set(getattr(model, "no_weight_decay", set)())
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in replaced]
    decay, no_decay = [], []
    for name, param in named:
        excluded = param.ndim <= 1 or name.endswith(".bias") or any(fnmatch(name, p) for p in keep_out)
        (no_decay if excluded else decay).append((name, param))
    for name, param in sources.named_sources():
        (decay if name.endswith(".weight") else no_decay).append((name, param))
    groups = [{"params": [p for _, p in no_decay], "weight_decay": 0.0}]
    groups.append({"params": [p for _, p in decay], "weight_decay": weight_decay})
    groups = [g for g in groups if g["params"]]
    return groups, dict(no_decay + decay)
