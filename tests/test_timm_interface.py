"""Converted models stay timm models: each part of timm's interface against what timm does with the source.

Models: the digits ResNet and a random resnet18, both in float64 with non-trivial weights, so the
converted model and its source agree to ~1e-15 and a wrong cut, head or grouping shows.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import timm
import torch
from timm.models import group_parameters
from timm.optim import create_optimizer_v2
from timm.utils import ModelEmaV3
from torch import nn

import odeify
from odeify.core.errors import OdeifyError
from odeify.models._testing import make_test_model
from odeify.models.digits import DIGITS_ARCH
from odeify.models.timm_interface import ConvertedModel

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {DIGITS_ARCH: (1, 1, 32, 32), "resnet18": (1, 3, 32, 32)}
RTOL = 2e-14  # measured: at most 2.8e-15 relative between a converted fp64 model and its source


@pytest.fixture(scope="module", params=list(CASES))
def pair(request) -> tuple[nn.Module, ConvertedModel, torch.Tensor]:
    """(source, converted, input) for one architecture."""
    source = make_test_model(request.param, dtype=torch.float64)
    converted = odeify.convert(source, input_size=CASES[request.param])
    x = torch.randn(
        3, *CASES[request.param][1:], generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    return source, converted, x


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a - b).abs().max() <= RTOL * b.abs().max()).item())


def test_data_config_and_attributes_are_the_source_s(pair) -> None:
    source, converted, _ = pair
    assert isinstance(converted, ConvertedModel)
    assert timm.data.resolve_model_data_config(converted) == timm.data.resolve_model_data_config(source)
    assert converted.pretrained_cfg == source.pretrained_cfg and converted.default_cfg == source.default_cfg
    assert (converted.num_classes, converted.num_features) == (source.num_classes, source.num_features)
    assert converted.feature_info == source.feature_info


def test_classifier_is_the_real_module(pair) -> None:
    source, converted, x = pair
    assert isinstance(converted.fc, nn.Linear) and converted.get_classifier() is converted.fc
    assert torch.equal(converted.fc.weight, source.fc.weight) and torch.equal(
        converted.fc.bias, source.fc.bias
    )
    assert {"fc.weight", "fc.bias"} <= set(converted.state_dict())
    with torch.no_grad():
        assert _close(converted(x), source(x))


def test_features_and_head_split_where_timm_does(pair) -> None:
    source, converted, x = pair
    with torch.no_grad():
        features = converted.forward_features(x)
        assert _close(features, source.forward_features(x))
        assert torch.equal(converted.forward_head(features), converted(x))  # the two halves are the model
        pooled = converted.forward_head(features, pre_logits=True)
        assert _close(pooled, source.forward_head(source.forward_features(x), pre_logits=True))
        other = odeify.retarget(converted, integrator="rk4", steps=2)  # the cut survives a new manifestation
        assert torch.equal(other.forward_head(other.forward_features(x)), other(x))


def test_reset_classifier_matches_timm(pair) -> None:
    source, converted, x = pair
    ours, theirs = copy.deepcopy(converted), copy.deepcopy(source)
    ours.reset_classifier(5)
    theirs.reset_classifier(5)
    assert ours.num_classes == theirs.num_classes == 5 and isinstance(ours.get_classifier(), nn.Linear)
    ours.fc.load_state_dict(theirs.fc.state_dict())  # fresh heads are randomly initialised
    with torch.no_grad():
        assert _close(ours(x), theirs(x))
        ours.reset_classifier(0)
        theirs.reset_classifier(0)
        assert _close(ours(x), theirs(x))  # the pooled features, as timm returns them
    with pytest.raises(OdeifyError, match="pooling"):
        ours.reset_classifier(3, global_pool="max")


def _per_block(name: str, param: torch.Tensor, converted: ConvertedModel) -> tuple[int, int]:
    """(ndim of one block's tensor, how many block tensors) behind a converted parameter."""
    return (param.ndim - 1, param.shape[0]) if ".knots." in name else (param.ndim, 1)


def test_weight_decay_groups_treat_knot_stacks_like_block_tensors(pair) -> None:
    source, converted, _ = pair
    groups = {
        id(p): g["weight_decay"]
        for g in create_optimizer_v2(converted, "adamw", lr=1e-3, weight_decay=0.05).param_groups
        for p in g["params"]
    }
    source_groups = create_optimizer_v2(source, "adamw", lr=1e-3, weight_decay=0.05).param_groups
    source_no_decay = {
        n for n, p in source.named_parameters() if any(p is q for q in source_groups[0]["params"])
    }
    no_decay_blocks = 0
    for name, param in converted.named_parameters():
        ndim, blocks = _per_block(name, param, converted)
        assert (groups[id(param)] == 0.0) == (ndim <= 1), name  # timm's rule, on the per-block tensors
        no_decay_blocks += blocks if ndim <= 1 else 0
    # BatchNorm folding moves each norm weight into its conv weight (decayed) and its bias into the conv
    # bias: the biases are exactly the source's no-decay tensors that remain
    assert no_decay_blocks == sum(n.endswith(".bias") for n in source_no_decay)
    if source.pretrained_cfg["architecture"] == DIGITS_ARCH:
        assert len(source_no_decay) == 41 and no_decay_blocks == 21


def _layer_ids(model: nn.Module) -> dict[str, int]:
    """What timm's layer decay assigns: parameter name -> layer id."""
    return group_parameters(model, model.group_matcher(coarse=False), reverse=True)


def test_layer_decay_places_knot_stacks_where_their_blocks_were(pair) -> None:
    source, converted, _ = pair
    plan = odeify.analyze(source, input_size=converted.meta["odeify"]["input_shape"])
    source_ids, ours = _layer_ids(source), _layer_ids(converted)
    by_module = {name.rsplit(".", 1)[0]: lid for name, lid in source_ids.items()}

    def origin(name: str) -> set[int]:  # the source layer ids a converted parameter stands for
        stage = name.split(".", 1)[0]
        runs = [run for run in plan.runs if stage == run.name.replace(".", "_") + "_ode"]
        scopes = [block.scope for block in runs[0].blocks] if runs else [name.rsplit(".", 1)[0]]
        return {
            lid
            for module, lid in by_module.items()
            for s in scopes
            if module == s or module.startswith(s + ".")
        }

    spans = {name: origin(name) for name in ours}
    assert all(spans.values())
    for a, b in itertools.permutations(ours, 2):
        if max(spans[a]) < min(spans[b]):
            assert ours[a] < ours[b], (a, b)  # the source's order, kept
        if spans[a] == spans[b]:
            assert ours[a] == ours[b], (a, b)
    folded = sum(run.length - 1 for run in plan.runs)  # each stage's blocks share one layer id
    assert max(ours.values()) + 1 == max(source_ids.values()) + 1 - folded
    optimizer = create_optimizer_v2(converted, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.5)
    assert max(g["lr_scale"] for g in optimizer.param_groups) == 1.0
    assert min(g["lr_scale"] for g in optimizer.param_groups) == 0.5 ** max(ours.values())


def test_model_ema_v3_averages_the_converted_model(pair) -> None:
    _, converted, x = pair
    model = copy.deepcopy(converted).train()
    ema = ModelEmaV3(model, decay=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().mean().backward()
    optimizer.step()
    ema.update(model)
    assert isinstance(ema.module, ConvertedModel) and ema.module.pretrained_cfg == model.pretrained_cfg
    averaged = dict(ema.module.named_parameters())
    for name, param in model.named_parameters():
        assert torch.allclose(
            averaged[name], 0.5 * before[name] + 0.5 * param.detach(), rtol=0, atol=1e-15
        ), name
    with torch.no_grad():
        assert ema.module.forward_features(x).shape == model.forward_features(x).shape


def test_interface_survives_copy_set_backward_save_and_load(pair, tmp_path) -> None:
    source, converted, x = pair
    copies = {
        "deepcopy": copy.deepcopy(converted),
        "set_backward": odeify.set_backward(copy.deepcopy(converted), "checkpoint"),
    }
    odeify.save(converted, tmp_path / "m.safetensors")
    copies["load"] = odeify.load(tmp_path / "m.safetensors")
    for how, model in copies.items():
        assert isinstance(model, ConvertedModel), how
        assert timm.data.resolve_model_data_config(model) == timm.data.resolve_model_data_config(source), how
        assert model.no_weight_decay() == converted.no_weight_decay(), how
        with torch.no_grad():
            assert _close(model.forward_head(model.forward_features(x)), source(x)), how
