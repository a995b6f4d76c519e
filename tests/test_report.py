"""Tests for odeify.inspection.report: describe() on converted models and the rich tables."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from torch import nn

import odeify
from odeify.core.errors import ConfigError
from odeify.inspection.report import (
    ConversionReport,
    describe,
    format_discrete_table,
    format_plan_table,
    format_report_table,
    markdown_table,
)
from odeify.models._testing import make_test_model

SIZE = (3, 64, 64)
RESNET18_RUNS = {"layer1": 2, "layer2": 1, "layer3": 1, "layer4": 1}


@pytest.fixture(scope="module")
def resnet18() -> nn.Module:
    return make_test_model("resnet18")


@pytest.fixture(scope="module")
def converted(resnet18: nn.Module) -> nn.Module:
    return odeify.convert(resnet18, input_size=SIZE)


def _render(table) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(table)
    return console.file.getvalue()


def test_describe_native_euler(converted: nn.Module, resnet18: nn.Module) -> None:
    report = describe(converted, name="resnet18")
    assert isinstance(report, ConversionReport)
    assert report.model == "resnet18"
    assert report.input_shape == (1, *SIZE)
    assert {s.name: s.depth for s in report.stages} == RESNET18_RUNS
    for stage in report.stages:
        assert stage.integrator == "euler" and stage.basis == "constant" and stage.backward == "backprop"
        assert stage.knots == stage.depth == stage.steps
        assert stage.nfe == stage.steps  # one field evaluation per Euler step
        assert stage.form == "post"
    assert report.nfe == sum(RESNET18_RUNS.values())


def _folded_block_parameters(block: nn.Module) -> int:
    """Parameters of one BasicBlock after BatchNorm folding, counted from the timm module itself:
    each conv keeps its kernel and gains a bias of its output width (its BN's affine folded in)."""
    return sum(conv.weight.numel() + conv.out_channels for conv in (block.conv1, block.conv2))


def test_describe_parameter_counts(converted: nn.Module, resnet18: nn.Module) -> None:
    report = describe(converted)
    norms = [m for m in resnet18.modules() if isinstance(m, nn.BatchNorm2d)]
    before = sum(p.numel() for p in resnet18.parameters())
    assert report.parameters_before == before
    # every BN follows a bias-free conv: folding drops its weight and bias (2C), the conv gains a bias (C)
    assert report.parameters_after == before - sum(norm.num_features for norm in norms)
    runs = {"layer1": resnet18.layer1, "layer2": resnet18.layer2[1:], "layer3": resnet18.layer3[1:],
            "layer4": resnet18.layer4[1:]}  # fmt: skip
    expected = {
        name: sum(_folded_block_parameters(block) for block in blocks) for name, blocks in runs.items()
    }
    assert expected["layer1"] == 2 * (2 * 64 * 64 * 9 + 2 * 64)  # by hand: two blocks of two 3x3 convs
    assert {s.name: s.parameters for s in report.stages} == expected
    assert report.knot_parameters == sum(expected.values())


def test_describe_rk4_counts_four_evaluations_per_step(converted: nn.Module) -> None:
    rk4 = odeify.retarget(converted, integrator="rk4", steps={"layer1": 4})
    stages = {s.name: s for s in describe(rk4).stages}
    assert stages["layer1"].integrator == "rk4"
    assert (stages["layer1"].steps, stages["layer1"].nfe) == (4, 16)
    assert stages["layer2"].nfe == 4 * stages["layer2"].steps


def test_describe_compressed_knots(converted: nn.Module) -> None:
    report = describe(odeify.retarget(converted, knots={"layer1": 1}))
    layer1 = next(s for s in report.stages if s.name == "layer1")
    assert (layer1.depth, layer1.knots, layer1.steps) == (2, 1, 2)
    assert layer1.parameters * 2 == describe(converted).stages[0].parameters


def test_describe_rejects_unconverted_module(resnet18: nn.Module) -> None:
    with pytest.raises(ConfigError, match="odeify.convert"):
        describe(resnet18)


def test_markdown_table() -> None:
    lines = markdown_table(("name", "kind", "n"), [("a", "b", "1"), ("c", "d", "22")], text_columns=2)
    assert lines == ["| name | kind | n |", "|---|---|---:|", "| a | b | 1 |", "| c | d | 22 |"]


def test_report_dict_is_json(converted: nn.Module) -> None:
    data = json.loads(json.dumps(describe(converted).to_dict()))
    assert [s["name"] for s in data["stages"]] == list(RESNET18_RUNS)
    assert data["nfe"] == 5
    assert data["input_shape"] == [1, *SIZE]
    assert data["parameters_before"] > data["parameters_after"] > data["knot_parameters"]


def test_report_table(converted: nn.Module) -> None:
    table = format_report_table(describe(converted, name="resnet18"))
    assert table.row_count == len(RESNET18_RUNS)
    text = _render(table)
    assert "resnet18: ODE stages" in text
    assert "post-activation" in text and "euler" in text
    assert "total" in text


def test_plan_tables(resnet18: nn.Module) -> None:
    plan = odeify.analyze(resnet18, SIZE)
    plan_table = format_plan_table(plan)
    assert plan_table.row_count == len(plan.runs)
    text = _render(plan_table)
    assert "64x16x16" in text and "identity" in text and "ReLU" in text
    discrete = _render(format_discrete_table(plan))
    assert "blocks that stay discrete" in discrete
    assert "layer2.0" in discrete and "projection" in discrete and "64x16x16 -> 128x8x8" in discrete


@pytest.mark.parametrize("name", ["resnet18", "convnext_atto"])
def test_the_caption_says_batchnorm_was_folded_only_where_there_was_one(name: str) -> None:
    source = make_test_model(name)
    report = describe(odeify.convert(source, input_size=(1, 3, 32, 32)))
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in source.modules())
    assert report.folded_batchnorm == has_batchnorm == (name == "resnet18")
    assert ("BatchNorm folded into convs" in _render(format_report_table(report))) == has_batchnorm
