"""Tests for odeify.passes.tracing: the leaf policy, exactness of the traced module, shape annotation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from timm.layers import DropPath
from torch import nn

import odeify
from odeify.core.errors import TraceError, did_you_mean
from odeify.passes.graph_utils import ADD_TARGETS
from odeify.passes.tracing import annotate_shapes, node_shape, trace

SHAPE = (2, 3, 64, 64)  # batch 2: train-mode BatchNorm needs more than one value per channel

TRACE_CASES = [
    pytest.param("resnet18", {"drop_path_rate": 0.1}, id="resnet18+drop_path"),
    pytest.param("resnetv2_50", {"drop_path_rate": 0.1}, id="resnetv2_50+drop_path"),
]


def _module_nodes(gm: fx.GraphModule, kind: type[nn.Module]) -> list[fx.Node]:
    """The call_module nodes of ``gm`` that call a ``kind`` module."""
    return [
        n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), kind)
    ]


def _bn_stats(module: nn.Module) -> dict[str, torch.Tensor]:
    """Running statistics of every BatchNorm, by module path relative to the model."""
    return {
        name: torch.cat([m.running_mean, m.running_var])
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }


@pytest.mark.parametrize(("name", "kwargs"), TRACE_CASES)
def test_traced_module_matches_eager_in_eval_mode(name: str, kwargs: dict, test_model, image) -> None:
    model = test_model(name, **kwargs)
    gm = trace(copy.deepcopy(model)).graph_module
    x = image(SHAPE)
    with torch.no_grad():
        assert (gm(x) - model(x)).abs().max().item() == 0.0


@pytest.mark.parametrize(("name", "kwargs"), TRACE_CASES)
def test_traced_module_matches_eager_in_train_mode(name: str, kwargs: dict, test_model, image) -> None:
    """Traced in eval mode, then ``.train()``: batch statistics and DropPath with the same RNG stream."""
    model = test_model(name, **kwargs)
    gm = trace(copy.deepcopy(model)).graph_module  # own copy: running statistics must update independently
    assert not gm.training
    x = image(SHAPE)
    before = _bn_stats(model)
    model.train()
    gm.train()
    with torch.no_grad():
        torch.manual_seed(7)
        eager = model(x)
        torch.manual_seed(7)
        traced = gm(x)
    assert (traced - eager).abs().max().item() == 0.0
    # BatchNorm ran in train mode in both, updating the running statistics identically.
    eager_stats, traced_stats = _bn_stats(model), _bn_stats(gm)
    assert traced_stats and set(traced_stats) <= set(eager_stats)
    for key, value in traced_stats.items():
        assert torch.equal(value, eager_stats[key]), key
        assert not torch.equal(value, before[key]), key  # batch statistics were used and recorded
    # DropPath really draws: another seed gives another output (the check above is not vacuous).
    with torch.no_grad():
        torch.manual_seed(8)
        assert (gm(x) - traced).abs().max().item() > 0.0


@pytest.mark.parametrize(("name", "kwargs"), TRACE_CASES)
def test_drop_path_is_a_leaf(name: str, kwargs: dict, test_model) -> None:
    """Traced through, DropPath's training branch would be frozen out of the graph."""
    model = test_model(name, **kwargs)
    gm = trace(model).graph_module
    expected = [m for m in model.modules() if isinstance(m, DropPath)]
    assert expected
    assert len(_module_nodes(gm, DropPath)) == len(expected)


def test_leaf_policy_traces_convs_and_keeps_norms_opaque(test_model) -> None:
    gm = trace(test_model("resnet18")).graph_module
    functions = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.conv2d in functions
    assert not _module_nodes(gm, nn.Conv2d)  # traced into torch.conv2d with get_attr weights
    assert any(n.op == "get_attr" and n.target == "conv1.weight" for n in gm.graph.nodes)
    assert len(_module_nodes(gm, nn.BatchNorm2d)) == 20  # norms stay opaque: training flag not frozen
    assert len(_module_nodes(gm, nn.Linear)) == 0


def test_normfree_blocks_are_traced_through(test_model) -> None:
    from timm.models.nfnet import NormFreeBlock

    gm = trace(test_model("nf_resnet50")).graph_module
    assert not _module_nodes(gm, NormFreeBlock)
    adds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ADD_TARGETS]
    assert len(adds) >= 16  # one residual add per block is visible


def test_extra_leaves_stay_opaque() -> None:
    class Inner(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) + 1

    assert not _module_nodes(trace(Outer()).graph_module, Inner)
    assert len(_module_nodes(trace(Outer(), extra_leaves=[Inner]).graph_module, Inner)) == 1


def test_annotate_shapes_records_every_tensor(test_model) -> None:
    model = test_model("resnet18", dtype=torch.float64)
    gm = trace(model).graph_module
    annotate_shapes(gm, (1, 3, 64, 64))
    for node in gm.graph.nodes:
        if node.op != "output":
            assert "tensor_meta" in node.meta, node.name
    (out,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    assert node_shape(out) == (1, 1000)
    assert out.meta["tensor_meta"].dtype == torch.float64  # dtype follows the parameters
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert node_shape(x) == (1, 3, 64, 64)
    add = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target in ADD_TARGETS)
    assert node_shape(add) == (1, 64, 16, 16)


def test_annotate_shapes_runs_data_dependent_leaves_for_real() -> None:
    """A leaf that branches on values cannot run on fake tensors; it runs once on zeros instead."""

    class Gate(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else x[:, :1].expand_as(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = Gate()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gate(x) + x

    gm = trace(Net(), extra_leaves=[Gate]).graph_module
    annotate_shapes(gm, (1, 4, 5, 5))
    gate = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert node_shape(gate) == (1, 4, 5, 5)


def test_untraceable_module_is_named() -> None:
    class Picky(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Identity(), Picky())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    with pytest.raises(TraceError) as info:
        trace(Net())
    message = str(info.value)
    assert "body.1" in message and "Picky" in message and "leaf" in message


def test_did_you_mean_names_the_closest_names() -> None:
    assert did_you_mean("resnet5", ["resnet50", "resnet18", "vgg11"]).startswith(" Did you mean: resnet50")
    assert did_you_mean("zzzz", ["resnet50"]) == ""


class _MaskableBlock(nn.Module):
    """``x + f(x)``, where ``f`` multiplies by a mask when one is given (as timm's attention does)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.conv(torch.relu(x))
        if mask is not None:
            h = h * mask
        return x + h


class _MaskableNet(nn.Module):
    """timm's ViT signature: ``forward(x, attn_mask=None, is_causal=False)``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(_MaskableBlock(8) for _ in range(3))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, *, is_causal: bool = False):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x, attn_mask)
        return x.flip(1) if is_causal else x


def test_optional_arguments_are_traced_at_their_defaults(image) -> None:
    """Traced as placeholders, ``attn_mask`` would enter every branch and hide every block."""
    model = _MaskableNet().eval()
    gm = trace(model).graph_module
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and "assert" in str(n.target)]
    x = image((2, 3, 8, 8))
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
    assert odeify.analyze(model, (1, 3, 8, 8)).run_lengths == [3]
