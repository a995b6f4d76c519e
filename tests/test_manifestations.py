"""Manifestations: one continuous model emitted for other integrators, depths and knot counts.

Centre piece: resnet152's layer3, a run of 35 identical bottleneck blocks. Emitted as rk4 with 4 steps
it costs 16 field evaluations; retargeted back to Euler at native depth it is the original network
bit for bit; compressed to 8 knots it is the least-squares fit of the 35 block weights (numpy's
lstsq on the basis' design matrix), and a weight path that already is an 8-knot spline survives the
round trip 35 -> 8 -> 35 exactly. resnet152 is converted once (fp32, 1x3x64x64) for the module, at a
half of its widths (:data:`WIDTHS`): the same blocks, depths and projections, a quarter of the weights.
"""

from __future__ import annotations

import copy
import time
from fractions import Fraction

import numpy as np
import pytest
import torch
from precision import as_float64, assert_as_accurate_as
from torch.nn.utils.fusion import fuse_conv_bn_eval

import odeify
from odeify.codegen.emit import count_evaluations
from odeify.compiler.conversion import converted_stages
from odeify.ir.meta import node_tag
from odeify.models._testing import make_test_model
from odeify.numerics.bases import get_basis

SHAPE = (1, 3, 64, 64)
WIDTHS = (32, 64, 128, 256)
"""timm ResNet's ``channels``, half its own (64, 128, 256, 512): the full widths' fp64 copies, retargets
and least-squares fits made this module 100 s of the suite, and nothing here depends on a width (a
quarter would drop layer1's projection: its output would match the 64-channel stem)."""
BASES = ("constant", "linear", "cubic")
COARSE = 8  # knots of the compressed layer3
COARSE_BLOCKS = [0, 5, 10, 15, 20, 25, 30, 34]  # blocks whose weights serve as the coarse knots


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def resnet152():
    """(eager fp32 model, converted fp32 model, input)."""
    threads = torch.get_num_threads()  # module fixtures run before the autouse one
    torch.set_num_threads(1)
    try:
        model = make_test_model("resnet152", channels=WIDTHS)
        converted = odeify.convert(model, input_size=SHAPE)
    finally:
        torch.set_num_threads(threads)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    return model, converted, x


@pytest.fixture(scope="module")
def resnet152_fp64(resnet152):
    """The converted model in fp64, for least-squares checks at round-off level."""
    return copy.deepcopy(resnet152[1]).double()


def stage_of(module, name: str) -> odeify.ODEStage:
    return next(s for s in converted_stages(module) if s.stage_name == name)


def knot_items(stage: odeify.ODEStage) -> dict[str, torch.Tensor]:
    """Every time-dependent tensor of a stage (trainable knots and per-block buffers), by slot."""
    return {slot.name: stage.slot_tensor(slot) for slot in stage.slots if slot.kind != "shared"}


def design(basis: str, knots: int, blocks: int) -> np.ndarray:
    """D[j, k] = B_k(j / blocks) for a ``knots``-knot basis: block weights = D @ knots."""
    b = get_basis(basis)
    return np.array([[float(c) for c in b.coefficients(knots, Fraction(j, blocks))] for j in range(blocks)])


FP32_FACTOR = 2.0
"""float32 outputs are judged by their distance from the eager model in float64: at most 2x eager
float32's own (measured on AMD EPYC: 0.92x and 0.84x, both near the 8-ulp floor)."""


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# --- integrator and depth ------------------------------------------------------------------------------


def test_layer3_is_a_35_block_stage(resnet152) -> None:
    _, converted, _ = resnet152
    assert [(s.stage_name, s.depth, s.num_knots) for s in converted_stages(converted)] == [
        ("layer1", 2, 2),
        ("layer2", 7, 7),
        ("layer3", 35, 35),
        ("layer4", 2, 2),
    ]


def test_rk4_with_4_steps_costs_16_evaluations(resnet152) -> None:
    _, converted, x = resnet152
    rk4 = odeify.retarget(converted, integrator="rk4", steps={"layer3": 4})
    stage = stage_of(rk4, "layer3")
    assert (stage.integrator.name, stage.steps, stage.depth) == ("rk4", 4, 35)
    assert count_evaluations(stage) == 16
    # the other stages keep their native depth (a dict changes only the stages it names)
    assert {s.stage_name: s.steps for s in converted_stages(rk4)} == {
        "layer1": 2,
        "layer2": 7,
        "layer3": 4,
        "layer4": 2,
    }
    # the lowered graph holds 16 copies of the block's convolutions, and the native one 35
    template_convs = sum(
        1 for n in stage.template.graph.nodes if n.op == "call_function" and n.target is torch.conv2d
    )
    assert template_convs == 3  # bottleneck: 1x1, 3x3, 1x1

    def convs_in(module) -> int:
        return sum(
            1
            for n in module.graph.nodes
            if n.op == "call_function" and n.target is torch.conv2d and node_tag(n).stage == "layer3"
        )

    assert convs_in(rk4) == 16 * template_convs
    assert convs_in(converted) == 35 * template_convs
    assert count_evaluations(stage_of(converted, "layer3")) == 35
    with torch.no_grad():
        assert rk4(x).shape == converted(x).shape


def test_retarget_back_to_euler_native_is_bit_exact(resnet152) -> None:
    model, converted, x = resnet152
    rk4 = odeify.retarget(converted, integrator="rk4", steps={"layer3": 4})
    back = odeify.retarget(rk4, integrator="euler", steps="native")
    assert {s.stage_name: (s.integrator.name, s.steps) for s in converted_stages(back)} == {
        s.stage_name: ("euler", s.depth) for s in converted_stages(converted)
    }
    with torch.no_grad():
        native, out, moved, ref = converted(x), back(x), rk4(x), model(x)
    assert (out - native).abs().max().item() == 0.0
    with torch.no_grad():
        exact = as_float64(model)(x.double())
    assert_as_accurate_as({"y": native}, {"y": ref}, {"y": exact}, FP32_FACTOR)
    assert relative(moved, native) > 1e-3  # rk4 with 4 steps is a different network


def test_retarget_dict_changes_only_the_named_stages(resnet152) -> None:
    _, converted, _ = resnet152
    compressed = odeify.retarget(converted, knots={"layer3": COARSE}, steps={"layer2": 3})
    assert {s.stage_name: (s.num_knots, s.steps) for s in converted_stages(compressed)} == {
        "layer1": (2, 2),
        "layer2": (7, 3),
        "layer3": (COARSE, 35),
        "layer4": (2, 2),
    }
    again = odeify.retarget(compressed, steps={"layer1": 4}, knots={"layer4": 1}, integrator="midpoint")
    assert {s.stage_name: (s.num_knots, s.steps, s.integrator.name) for s in converted_stages(again)} == {
        "layer1": (2, 4, "midpoint"),
        "layer2": (7, 3, "midpoint"),
        "layer3": (COARSE, 35, "midpoint"),
        "layer4": (1, 2, "midpoint"),
    }


# --- compression and refinement -----------------------------------------------------------------------


@pytest.mark.parametrize("basis", BASES)
def test_compression_is_least_squares_and_refinement_inverts_it(resnet152_fp64, basis: str) -> None:
    """35 -> 8 knots is numpy's lstsq on the basis' design matrix; a spline survives 35 -> 8 -> 35.

    One test per basis so the fp64 resnet152 is copied as few times as retarget needs.
    """
    native = odeify.retarget(resnet152_fp64, basis=basis)  # one knot per block: any basis may read them
    d = design(basis, COARSE, 35)

    # generic block weights: the compressed knots are the least-squares fit
    compressed = odeify.retarget(native, knots={"layer3": COARSE})
    small = stage_of(compressed, "layer3")
    assert (small.num_knots, small.basis, small.steps) == (COARSE, basis, 35)
    choose = np.random.default_rng(0).choice  # a few thousand columns per tensor keep numpy fast
    fitted = knot_items(small)
    for name, stack in knot_items(stage_of(native, "layer3")).items():
        data = stack.detach().reshape(35, -1).numpy()
        cols = np.sort(choose(data.shape[1], size=min(4096, data.shape[1]), replace=False))
        expected, *_ = np.linalg.lstsq(d, data[:, cols], rcond=None)
        got = fitted[name].detach().reshape(COARSE, -1).numpy()[:, cols]
        assert np.abs(got - expected).max() <= 1e-10 * np.abs(expected).max(), name
        # a fit, not an interpolation: the residual is orthogonal to every basis function
        residual = data[:, cols] - d @ got
        assert np.abs(d.T @ residual).max() <= 1e-10 * np.abs(data[:, cols]).max(), name
        assert np.abs(residual).max() > 1e-3 * np.abs(data[:, cols]).max(), name  # generic: not on a spline
    del compressed, small, fitted

    # block weights that are an 8-knot spline: compressing recovers its knots, refining the blocks
    coarse, fine = {}, {}
    with torch.no_grad():
        for name, stack in knot_items(stage_of(native, "layer3")).items():
            coarse[name] = stack[COARSE_BLOCKS].clone()
            fine[name] = torch.tensordot(torch.from_numpy(d), coarse[name], dims=1)
            stack.copy_(fine[name])
    compressed = odeify.retarget(native, knots={"layer3": COARSE})
    for name, tensor in knot_items(stage_of(compressed, "layer3")).items():
        assert relative(tensor, coarse[name]) <= 1e-12, name
    refined = odeify.retarget(compressed, knots={"layer3": "native"})
    refined_stage = stage_of(refined, "layer3")
    assert (refined_stage.num_knots, refined_stage.basis) == (35, basis)
    for name, tensor in knot_items(refined_stage).items():
        assert relative(tensor, fine[name]) <= 1e-12, name


def test_compressed_model_is_the_eager_network_with_knot_weights(resnet152) -> None:
    """35 blocks -> 8 constant knots, native steps: step k runs knot floor(8k/35), as eager timm does.

    The oracle is the original timm resnet152 with each layer3 block's BatchNorm folded by torch
    (``fuse_conv_bn_eval``) and its convolutions given the knot of the cell that holds time k/35.
    """
    model, converted, x = resnet152
    compressed = odeify.retarget(converted, knots={"layer3": COARSE})
    assert count_evaluations(stage_of(compressed, "layer3")) == 35
    knots = knot_items(stage_of(compressed, "layer3"))
    eager = copy.deepcopy(model)
    with torch.no_grad():
        for k, block in enumerate(eager.layer3[1:]):  # block 0 changes the shape: not in the run
            cell = COARSE * k // 35
            for conv, norm in (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3")):
                fused = fuse_conv_bn_eval(getattr(block, conv), getattr(block, norm))
                fused.weight.copy_(knots[f"{conv}_weight"][cell])
                fused.bias.copy_(knots[f"{conv}_bias"][cell])
                setattr(block, conv, fused)
                setattr(block, norm, torch.nn.Identity())
        out, want, native = compressed(x), eager(x), converted(x)
    with torch.no_grad():
        exact = as_float64(eager)(x.double())
    assert_as_accurate_as({"y": out}, {"y": want}, {"y": exact}, FP32_FACTOR)
    assert relative(out, native) > 1e-3  # a different network from the native one
    params = sum(p.numel() for p in compressed.parameters())
    removed = (35 - COARSE) * sum(t[0].numel() for t in knots.values())
    assert params == sum(p.numel() for p in converted.parameters()) - removed


# --- torch.compile ---------------------------------------------------------------------------------------


def test_dynamo_sees_one_graph_without_breaks(test_model) -> None:
    """The unrolled graph is plain torch code: dynamo captures it whole, native and as rk4 x2."""
    shape = (1, 3, 32, 32)
    converted = odeify.convert(test_model("resnet50"), input_size=shape)
    rk4 = odeify.retarget(converted, integrator="rk4", steps="x2")
    assert [s.steps for s in converted_stages(rk4)] == [4, 6, 10, 4]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for module in (converted, rk4):
        torch._dynamo.reset()
        start = time.perf_counter()
        explanation = torch._dynamo.explain(module)(x)
        elapsed = time.perf_counter() - start
        assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), (
            explanation.break_reasons,
            elapsed,
        )
    torch._dynamo.reset()
