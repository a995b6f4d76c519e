"""The pass contract (``odeify.passes.contract``) and the generic check for transformations.

Every pass under ``passes/`` declared with ``graph_pass(PassSpec(..., PassKind.TRANSFORMATION,
preserves_computation=True))`` must leave the model's output unchanged (fp64, rtol 1e-10). Each
such pass registers here how to apply it to a copy of a model; a declared pass missing from the
registry fails ``test_every_declared_transformation_is_registered``. Analyses and module records
are held to what their kind may change by the contract's runner itself; the tests at the end check
that the runner refuses what it should.
"""

from __future__ import annotations

import copy
import importlib
import pkgutil
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.fx as fx
from torch import nn

import odeify
import odeify.passes as passes
from odeify.compiler.analysis import analyze_graph
from odeify.compiler.record import record_conversion
from odeify.ir.fold_records import fold_records
from odeify.models._testing import make_test_model
from odeify.passes.contract import (
    PassContractError,
    PassKind,
    PassResult,
    PassSpec,
    graph_pass,
    graph_properties,
    module_record,
)
from odeify.passes.fold_bn import FoldedNorm, fold_batchnorm
from odeify.passes.head import head_nodes
from odeify.passes.lower import lower_stages, raise_stages, stage_nodes
from odeify.passes.partial_residuals import whole_residuals
from odeify.passes.properties import BLOCKS, BN_FOLDED, LOWERED, RUNS, SEGMENTS, SHAPES, STAGE_CALLS
from odeify.passes.residual_blocks import find_blocks
from odeify.passes.segments import checkpoint_segments, has_segments, inline_segments
from odeify.passes.tracing import annotate_shapes, trace

SHAPE = (2, 3, 48, 48)  # small, yet every stage keeps a spatial extent above 1x1
MODELS: dict[str, tuple[str, dict]] = {
    "resnet18": ("resnet18", {}),
    "resnetv2_50": ("resnetv2_50", {}),
    "nf_resnet50": ("nf_resnet50", {}),
    # layer1.0 has no DropPath (rate 0), layer1.1 has one: lift gives layer1.0 an nn.Identity variant
    "resnet18+drop_path": ("resnet18", {"drop_path_rate": 0.1}),
}
RTOL = 1e-10

Applied = Iterator[tuple[str, nn.Module]]
"""What a registered callable yields: (form, transformed module) pairs to compare with eager."""
Apply = Callable[[nn.Module, dict], Applied]
"""A registered callable: (eval-mode fp64 model, per-model cache of shared intermediate results)."""


def _apply_trace(model: nn.Module, cache: dict) -> Applied:
    yield "traced", trace(copy.deepcopy(model)).graph_module


def _apply_fold_bn(model: nn.Module, cache: dict) -> Applied:
    gm = trace(copy.deepcopy(model)).graph_module
    annotate_shapes(gm, SHAPE)
    norms = sum(1 for m in gm.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    folded = fold_batchnorm(gm).graph_module
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in folded.modules())
    assert sum(1 for m in folded.modules() if isinstance(m, FoldedNorm)) == norms  # 0 for NF-ResNet
    yield "folded", folded


def _apply_whole_residuals(model: nn.Module, cache: dict) -> Applied:
    """A no-op on these models (no add on part of a stream; tests/test_whole_residuals.py has CoaT's)."""
    gm = trace(copy.deepcopy(model)).graph_module
    annotate_shapes(gm, SHAPE)
    yield "whole residuals", whole_residuals(gm).graph_module


def _converted(model: nn.Module, cache: dict) -> fx.GraphModule:
    """``odeify.convert`` with its defaults (Euler, native steps and knots), computed once: do not mutate."""
    if "converted" not in cache:
        cache["converted"] = odeify.convert(model, input_size=SHAPE)  # converts a copy
    return cache["converted"]


def _apply_lift(model: nn.Module, cache: dict) -> Applied:
    converted = _converted(model, cache)
    assert not converted.meta["odeify"]["not_lifted"]
    assert odeify.converted_stages(converted)
    yield "converted", converted


def _apply_mark_head(model: nn.Module, cache: dict) -> Applied:
    converted = _converted(model, cache)  # the convert pipeline marks the head before lowering
    assert head_nodes(converted)  # (resnetv2's classifier is a 1x1 conv: it stays as traced)
    yield "head marked", converted


def _apply_raise(model: nn.Module, cache: dict) -> Applied:
    raised = raise_stages(copy.deepcopy(_converted(model, cache))).graph_module
    assert stage_nodes(raised)  # one call per stage, run through ODEStage.forward
    yield "raised", raised


def _apply_lower(model: nn.Module, cache: dict) -> Applied:
    lowered = lower_stages(raise_stages(copy.deepcopy(_converted(model, cache))).graph_module).graph_module
    assert not stage_nodes(lowered)  # backprop stages are inlined again
    yield "lowered", lowered


def _apply_checkpoint_segments(model: nn.Module, cache: dict) -> Applied:
    segmented = checkpoint_segments(copy.deepcopy(_converted(model, cache))).graph_module
    assert has_segments(segmented)
    yield "segmented", segmented


def _apply_inline_segments(model: nn.Module, cache: dict) -> Applied:
    segmented = checkpoint_segments(copy.deepcopy(_converted(model, cache))).graph_module
    inlined = inline_segments(segmented).graph_module
    assert not has_segments(inlined)
    yield "inlined", inlined


REGISTRY: dict[str, Apply] = {
    "trace": _apply_trace,
    "whole_residuals": _apply_whole_residuals,
    "fold_batchnorm": _apply_fold_bn,
    "lift_runs": _apply_lift,
    "mark_head": _apply_mark_head,
    "raise_stages": _apply_raise,
    "lower_stages": _apply_lower,
    "checkpoint_segments": _apply_checkpoint_segments,
    "inline_segments": _apply_inline_segments,
}
"""Declared pass name -> how to apply it to a copy of an eval-mode fp64 model."""


@pytest.fixture(scope="module")
def shared() -> dict[str, dict]:
    """Per-model caches: the model, its eager output, and what registered callables share."""
    return {}


def declared_passes() -> dict[str, PassSpec]:
    """Every pass declared with ``graph_pass`` in a module under passes/, by name."""
    found: dict[str, PassSpec] = {}
    for info in pkgutil.iter_modules(passes.__path__, prefix="odeify.passes."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            spec = getattr(value, "pass_spec", None)
            if isinstance(spec, PassSpec) and value.__module__ == info.name:
                found[spec.name] = spec
    return found


def test_every_declared_transformation_is_registered() -> None:
    declared = declared_passes()
    assert {"find_blocks", "group_runs", "fold_batchnorm", "lift_runs"} <= set(declared)
    assert declared["find_blocks"].kind is declared["group_runs"].kind is PassKind.ANALYSIS
    preserving = {
        name
        for name, spec in declared.items()
        if spec.kind is PassKind.TRANSFORMATION and spec.preserves_computation
    }
    missing = sorted(preserving - set(REGISTRY))
    assert not missing, f"passes declaring preserves_computation with no entry in REGISTRY: {missing}"
    stale = sorted(set(REGISTRY) - preserving)
    assert not stale, f"REGISTRY entries that are no declared computation-preserving pass: {stale}"


@pytest.mark.parametrize("model_key", list(MODELS))
@pytest.mark.parametrize("pass_name", sorted(REGISTRY))
def test_pass_preserves_computation(pass_name: str, model_key: str, test_model, image, shared) -> None:
    x = image(SHAPE, dtype=torch.float64)
    cache = shared.setdefault(model_key, {})
    if "model" not in cache:  # passes work on copies, so one model and one eager output per name
        name, kwargs = MODELS[model_key]
        cache["model"] = test_model(name, dtype=torch.float64, **kwargs)
        with torch.no_grad():
            cache["expected"] = cache["model"](x)
    model, expected = cache["model"], cache["expected"]
    with torch.no_grad():
        atol = RTOL * expected.abs().max().item()
        forms = 0
        for form, transformed in REGISTRY[pass_name](model, cache):
            transformed.eval()
            torch.testing.assert_close(
                transformed(x), expected, rtol=RTOL, atol=atol, msg=lambda m, f=form: f"{f}: {m}"
            )
            forms += 1
    assert forms


# --- the contract's runner ----------------------------------------------------------------------------


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))) + 1.0


def _traced() -> fx.GraphModule:
    return trace(_Small().eval()).graph_module


def test_missing_requirement_is_refused() -> None:
    gm = _traced()
    with pytest.raises(PassContractError, match="requires shapes") as info:
        find_blocks(gm)
    assert "annotate_shapes" in str(info.value)  # says which pass ensures it
    annotate_shapes(gm, (1, 3, 8, 8))
    assert graph_properties(gm) == {SHAPES}
    assert find_blocks(gm) == PassResult(gm, modified=False, value=[])


def test_properties_follow_the_pipeline(test_model) -> None:
    """Each pass records what it ensures; folding and lifting drop the analysis tags they outdate."""
    gm = trace(test_model("resnet18")).graph_module
    annotate_shapes(gm, (1, 3, 32, 32))
    analyze_graph(gm, "resnet18", (1, 3, 32, 32))
    assert graph_properties(gm) == {SHAPES, BLOCKS, RUNS}
    fold_batchnorm(gm)
    assert graph_properties(gm) == {SHAPES, BN_FOLDED}
    copied = copy.deepcopy(gm)  # the record travels with the module
    assert graph_properties(copied) == graph_properties(gm)


_WRITING = PassSpec("writes_graph", PassKind.ANALYSIS)
_RELU_TO_SIGMOID = PassSpec("relu_to_sigmoid", PassKind.TRANSFORMATION, preserves_computation=False)


@graph_pass(_WRITING)
def _analysis_that_writes(gm: fx.GraphModule) -> PassResult:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        gm.graph.call_function(torch.neg, (output.args[0],))
    return PassResult(gm, modified=False)


@graph_pass(_WRITING)
def _analysis_that_adds_a_module(gm: fx.GraphModule) -> PassResult:
    gm.add_submodule("extra", nn.Identity())
    return PassResult(gm, modified=False)


class _Subclass(fx.GraphModule):
    pass


@graph_pass(_WRITING)
def _analysis_that_changes_the_class(gm: fx.GraphModule) -> PassResult:
    gm.__class__ = type("Swapped", (type(gm), _Subclass), {})
    return PassResult(gm, modified=False)


@graph_pass(_WRITING)
def _analysis_that_writes_gm_meta(gm: fx.GraphModule) -> PassResult:
    gm.meta["another_record"] = {"written": True}
    return PassResult(gm, modified=False)


@graph_pass(_WRITING)
def _analysis_that_edits_gm_meta_in_place(gm: fx.GraphModule) -> PassResult:
    gm.meta["record"]["written"] = False  # the dict the meta holds, not the meta itself
    return PassResult(gm, modified=False)


@graph_pass(_RELU_TO_SIGMOID)
def _relu_to_sigmoid(gm: fx.GraphModule) -> PassResult:
    """Edits the graph and leaves the lint + recompile tail to the runner."""
    for node in gm.graph.nodes:
        if node.target is torch.relu:
            node.target = torch.sigmoid
    return PassResult(gm, modified=True)


@pytest.mark.parametrize(
    "writer",
    [
        _analysis_that_writes,
        _analysis_that_adds_a_module,
        _analysis_that_changes_the_class,
        _analysis_that_writes_gm_meta,
        _analysis_that_edits_gm_meta_in_place,
    ],
)
def test_analysis_that_writes_is_refused(writer) -> None:
    gm = _traced()
    gm.meta["record"] = {"written": True}
    with pytest.raises(PassContractError, match="writes_graph.*changed the graph"):
        writer(gm)
    assert "writes_graph" not in graph_properties(gm)


_RECORDING = module_record("records")


@graph_pass(_RECORDING)
def _record_and_swap_the_class(gm: fx.GraphModule) -> PassResult:
    gm.meta["record"] = {"written": True}
    gm.__class__ = type("Swapped", (type(gm), _Subclass), {})
    return PassResult(gm, modified=True)


@graph_pass(_RECORDING)
def _record_that_adds_a_module(gm: fx.GraphModule) -> PassResult:
    gm.add_submodule("extra", nn.Identity())
    return PassResult(gm, modified=True)


def test_a_module_record_may_change_the_class_and_gm_meta_only() -> None:
    """record_conversion writes gm.meta and makes the module a ConvertedModel: a module record, which
    the runner lets change just those two."""
    assert record_conversion.pass_spec.kind is PassKind.MODULE_RECORD
    gm = _traced()
    assert isinstance(_record_and_swap_the_class(gm).graph_module, _Subclass)
    assert gm.meta["record"] == {"written": True}
    with pytest.raises(PassContractError, match="module record pass 'records' changed the graph"):
        _record_that_adds_a_module(_traced())


@graph_pass(_WRITING)
def _analysis_that_returns_its_value_alone(gm: fx.GraphModule) -> list:
    return []


def test_a_pass_returns_a_pass_result() -> None:
    with pytest.raises(PassContractError, match="writes_graph' returned list, not a PassResult"):
        _analysis_that_returns_its_value_alone(_traced())


def test_transformation_gets_lint_and_recompile_from_the_runner(image) -> None:
    model = _Small().eval()
    gm = trace(model).graph_module  # shares the model's submodules
    x = image((1, 3, 8, 8))
    _relu_to_sigmoid(gm)
    assert "torch.sigmoid(" in gm.code and "torch.relu(" not in gm.code
    with torch.no_grad():
        expected = torch.sigmoid(model.bn(model.conv(x))) + 1.0
        assert (gm(x) - expected).abs().max().item() == 0.0


def test_an_analysis_cannot_declare_it_changes_output() -> None:
    with pytest.raises(ValueError, match="analysis pass"):
        PassSpec("bad", PassKind.ANALYSIS, preserves_computation=False)
    with pytest.raises(ValueError, match="analysis pass"):
        PassSpec("bad", PassKind.ANALYSIS, invalidates=frozenset({RUNS}))
    with pytest.raises(ValueError, match="module record pass"):
        PassSpec("bad", PassKind.MODULE_RECORD, preserves_computation=False)


def test_a_declaration_names_only_registered_properties() -> None:
    with pytest.raises(ValueError, match="names .shapes., which is not in odeify.passes.properties"):
        PassSpec("bad", PassKind.TRANSFORMATION, requires=frozenset({"shapes"}))


@graph_pass(PassSpec("scales_in_place", PassKind.ANALYSIS))
def _analysis_that_scales_a_weight(gm: fx.GraphModule) -> PassResult:
    with torch.no_grad():
        gm.conv.weight.mul_(1.0)  # same values, but an in-place write: the version counter moves
    return PassResult(gm, modified=False)


def test_an_analysis_that_writes_a_tensor_in_place_is_refused() -> None:
    with pytest.raises(PassContractError, match="scales_in_place.*changed"):
        _analysis_that_scales_a_weight(_traced())


_CLAIMS_SHAPES = PassSpec("claims_shapes", PassKind.ANALYSIS, ensures=frozenset({SHAPES}))


@graph_pass(_CLAIMS_SHAPES)
def _claims_shapes_without_annotating(gm: fx.GraphModule) -> PassResult:
    return PassResult(gm, modified=False)


def test_an_ensured_property_that_does_not_hold_is_refused() -> None:
    gm = _traced()
    with pytest.raises(PassContractError, match="claims_shapes.*ensures shapes"):
        _claims_shapes_without_annotating(gm)
    assert SHAPES not in graph_properties(gm)


def test_forbidden_and_required_properties(test_model) -> None:
    """raise_stages needs a lowered graph without segments; the pipelines inline segments first."""
    gm = odeify.convert(test_model("resnet18"), input_size=(1, 3, 32, 32))
    assert LOWERED in graph_properties(gm) and SEGMENTS not in graph_properties(gm)
    checkpoint_segments(gm)
    with pytest.raises(PassContractError, match="raise_stages.*forbids segments"):
        raise_stages(gm)
    raise_stages(inline_segments(gm).graph_module)
    assert STAGE_CALLS in graph_properties(gm) and LOWERED not in graph_properties(gm)
    with pytest.raises(PassContractError, match="raise_stages.*requires lowered"):
        raise_stages(gm)


# --- lift: per-block pass-through modules ------------------------------------------------------------


def test_lift_keeps_each_blocks_drop_path_in_train_mode(test_model, image) -> None:
    """ConvNeXt builds nn.Identity for a rate-0 block and DropPath elsewhere: one run, one stage whose
    block k draws its own DropPath, so train mode matches eager draw for draw (no BatchNorm to fold)."""
    model = test_model("convnext_atto", dtype=torch.float64, ls_init_value=1.0, drop_path_rate=0.3)
    x = image((2, 3, 32, 32), dtype=torch.float64)
    converted = odeify.convert(model, input_size=(2, 3, 32, 32))
    stages = odeify.converted_stages(converted)
    assert [stage.depth for stage in stages] == [2, 2, 6, 2]
    rates = [getattr(m, "drop_prob", None) for m in stages[0].variants["drop_path"]]
    assert rates[0] is None and rates[1] > 0  # block 0: nn.Identity; block 1: its DropPath
    model.train()
    converted.train()
    with torch.no_grad():
        torch.manual_seed(5)
        expected = model(x)
        torch.manual_seed(5)
        got = converted(x)
        torch.manual_seed(6)
        other_draw = model(x)
    assert (got - expected).abs().max().item() == 0.0
    assert (other_draw - expected).abs().max().item() > 0.1 * expected.abs().max().item()  # draws matter


# --- guards that a pass's structure checks hold: each test fails when its guard is removed -----------


def _random_bn(channels: int, generator: torch.Generator) -> nn.BatchNorm2d:
    """A BatchNorm with random affine parameters and statistics (a fresh one folds to the identity)."""
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        for tensor in (bn.weight, bn.bias, bn.running_mean):
            tensor.copy_(torch.randn(channels, generator=generator))
        bn.running_var.copy_(torch.rand(channels, generator=generator) + 0.5)
    return bn


class _Dilated(nn.Module):
    def __init__(self, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=dilation, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


class _SharedConv(nn.Module):
    """One conv weight read by two convs, each followed by its own BatchNorm."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn_a, self.bn_b = _random_bn(8, generator), _random_bn(8, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn_b(self.conv(torch.relu(self.bn_a(self.conv(x)))))


class _Net(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _assert_computes(model: nn.Module, converted: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(converted(x), expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())


def test_blocks_that_differ_in_an_int_literal_are_not_one_run(image) -> None:
    """Three ``x + conv(x)`` blocks with dilations 1, 2, 4 differ only in int arguments of their conv
    call: three runs. Were ints wildcards in block signatures (as floats are), they would be one
    stage computing with block 0's dilation: measured 5.6e-2 relative off in float64."""
    torch.manual_seed(0)
    model = _Net([_Dilated(d) for d in (1, 2, 4)]).double().eval()
    x = image((2, 3, 16, 16), dtype=torch.float64)
    converted = odeify.convert(model, input_size=(2, 3, 16, 16))
    assert [stage.depth for stage in odeify.converted_stages(converted)] == [1, 1, 1]
    _assert_computes(model, converted, x)


def test_a_conv_weight_read_twice_is_not_folded(image) -> None:
    """Folding a BatchNorm rewrites its conv's weight: a weight that a second conv (with another
    BatchNorm) reads must stay. Folded anyway, both convs read one folded weight: 0.79 relative off."""
    model = _Net([_SharedConv(torch.Generator().manual_seed(0))]).double().eval()
    shape = (2, 3, 16, 16)
    gm = trace(copy.deepcopy(model)).graph_module
    annotate_shapes(gm, shape)
    _assert_computes(model, fold_batchnorm(gm).graph_module, image(shape, dtype=torch.float64))


def test_a_run_of_frozen_convs_keeps_no_record_of_a_tensor_it_cannot_train() -> None:
    """A source whose weights do not train folds into frozen knots (buffers): a stage's fold record
    must name trainable knots, which fine-tuning reads as parameters; a record naming frozen knots
    (stacked whatever the slot's kind) points at no parameter. Lift checks the kind of both folded
    tensors, which folding makes alike (a folded bias trains as its weight does): this test fails
    when both checks go, not when one does."""
    converted = odeify.convert(make_test_model("odeify.digits_resnet").requires_grad_(False))
    stages = odeify.converted_stages(converted)
    assert {slot.kind for stage in stages for slot in stage.slots} == {"buffer"}
    for owner in (converted, *stages):
        for record in fold_records(owner).values():
            owner.get_parameter(record.scaled), owner.get_parameter(record.shifted)


class _Nested(nn.Module):
    """``x + f(x)`` whose branch holds a residual ``h + conv(h)`` of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv_a = nn.Conv2d(8, 8, 3, padding=1)
        self.conv_b = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv0(x))
        return x + self.conv_b(torch.relu(h + self.conv_a(h)))


def test_a_residual_inside_a_block_is_part_of_it(image) -> None:
    """Only the outermost blocks are blocks: an inner ``h + conv(h)`` is part of its block's branch.
    Kept as a block of its own, lifting the outer run failed (KeyError in lift_runs)."""
    torch.manual_seed(0)
    model = _Net([_Nested(), _Nested()]).double().eval()
    converted = odeify.convert(model, input_size=(2, 3, 16, 16))
    assert [stage.depth for stage in odeify.converted_stages(converted)] == [2]
    _assert_computes(model, converted, image((2, 3, 16, 16), dtype=torch.float64))
