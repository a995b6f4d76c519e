"""``odeify.convert``: exact at native depth across the timm ResNet zoo, and clear errors on bad input.

Exactness (docs/design.md): Euler with steps = L (the default) and any basis reproduces the eager
model, because every basis passes through the knots and the knots are the blocks' own weights. Test
models have non-trivial residual branches (``make_test_model``: no zero-init of the last BN,
randomised BN statistics), so an identity stage would fail. fp32 is converted from the fp32 model and
compared with the fp32 eager model (the user's path), not cast down from the fp64 conversion.

The zoo sweep is marked ``zoo``: a representative subset always runs; the rest with ODEIFY_ZOO=all.
"""

from __future__ import annotations

import copy
import math
import os
from fractions import Fraction

import numpy as np
import pytest
import torch
from precision import as_float64, assert_as_accurate_as
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import odeify
from odeify.compiler.conversion import converted_stages
from odeify.core.errors import ConfigError
from odeify.models._testing import make_test_model
from odeify.models.digits import DIGITS_ARCH
from odeify.numerics.bases import MAX_KNOTS
from odeify.numerics.tableaus import KNOWN_INTEGRATORS, Tableau

SHAPE = (1, 3, 64, 64)  # small: exactness does not depend on the spatial size
BASES = ("constant", "linear", "cubic")
FP64_TOLERANCE = 2e-14  # max|diff| / max|ref| against eager timm; measured 2.5e-15
FP32_FACTOR = 2.0
"""float32: the converted model is judged by its distance from eager float64, which may be 2x eager
float32's own (BatchNorm folded into the conv rounds differently; measured on AMD EPYC over the
whole zoo, ODEIFY_ZOO=all: at most 1.05x, both about 1e-6)."""

# (id, timm name, timm kwargs); the first block of each set always runs
REPRESENTATIVE = [
    ("resnet18", "resnet18", {}),
    ("resnet50", "resnet50", {}),
    ("resnetv2_50", "resnetv2_50", {}),
    ("nf_resnet50", "nf_resnet50", {}),
    ("res2net50_26w_4s", "res2net50_26w_4s", {}),
    ("resnet33ts", "resnet33ts", {}),
    ("skresnet18", "skresnet18", {}),
    ("resnet18-drop_path", "resnet18", {"drop_path_rate": 0.1}),
]
REST = [
    ("resnet34", "resnet34", {}),
    ("resnet50d", "resnet50d", {}),
    ("seresnet50", "seresnet50", {}),
    ("resnext50_32x4d", "resnext50_32x4d", {}),
    ("wide_resnet50_2", "wide_resnet50_2", {}),
    ("resnetrs50", "resnetrs50", {}),
    ("resnetblur50", "resnetblur50", {}),
    ("resnet101", "resnet101", {}),
    ("resnet152", "resnet152", {}),
    ("resnet26t", "resnet26t", {}),
]
FULL_ZOO = os.environ.get("ODEIFY_ZOO", "").strip().lower() == "all"
_skip_rest = pytest.mark.skipif(not FULL_ZOO, reason="full zoo sweep runs with ODEIFY_ZOO=all")
ZOO = [
    pytest.param(name, kwargs, basis, id=f"{ident}-{basis}", marks=[pytest.mark.zoo])
    for ident, name, kwargs in REPRESENTATIVE
    for basis in BASES
] + [
    pytest.param(name, kwargs, basis, id=f"{ident}-{basis}", marks=[pytest.mark.zoo, _skip_rest])
    for ident, name, kwargs in REST
    for basis in BASES
]


pytestmark = pytest.mark.usefixtures("one_thread")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


# --- exact at native depth --------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "kwargs", "basis"), ZOO)
def test_exact_at_native_depth(test_model, image, name: str, kwargs: dict, basis: str) -> None:
    for dtype in (torch.float64, torch.float32):
        model = test_model(name, dtype=dtype, **kwargs)
        x = image(SHAPE, dtype=dtype)
        converted = odeify.convert(model, basis=basis, input_size=SHAPE)
        with torch.no_grad():
            ref, out = model(x), converted(x)
            exact = as_float64(model)(x.double()) if dtype == torch.float32 else None
        assert ref.abs().max() > 0
        if exact is None:
            error = relative_error(out, ref)
            assert error <= FP64_TOLERANCE, f"{name} {basis}: relative error {error:.3e}"
        else:
            assert_as_accurate_as({"logits": out}, {"logits": ref}, {"logits": exact}, FP32_FACTOR)

        assert not [m for m in converted.modules() if isinstance(m, _BatchNorm)], "BatchNorm left"
        stages = converted_stages(converted)
        assert stages, "no ODE stage"
        for stage in stages:
            assert stage.num_knots == stage.depth, f"{stage.stage_name}: knots != blocks"
            assert (stage.basis, stage.integrator.name, stage.steps) == (basis, "euler", stage.depth)
        assert converted.meta["odeify"]["not_lifted"] == {}
        if dtype == torch.float64 and basis == "constant":
            # every identity block of the model sits in a stage, one knot each
            plan = odeify.analyze(model, input_size=SHAPE)
            identity = sum(1 for b in plan.blocks if b.kind == "identity")
            assert sum(s.depth for s in stages) == identity
            assert [s.depth for s in stages] == [run.length for run in plan.runs]


def test_resnet152_layer3_is_one_run_of_35() -> None:
    """The structure the manifestation tests rely on (analysis only: no conversion, fast)."""
    plan = odeify.analyze("resnet152", input_size=SHAPE)
    assert [(run.name, run.length) for run in plan.runs] == [
        ("layer1", 2),
        ("layer2", 7),
        ("layer3", 35),
        ("layer4", 2),
    ]


# --- bad input ----------------------------------------------------------------------------------------


DIGITS_SHAPE = (1, 1, 32, 32)


@pytest.fixture(scope="module")
def digits() -> nn.Module:
    return make_test_model(DIGITS_ARCH)


@pytest.fixture(scope="module")
def digits_converted(digits) -> torch.fx.GraphModule:
    return odeify.convert(digits, input_size=DIGITS_SHAPE)


def test_digits_stage_names(digits_converted) -> None:
    stages = {s.stage_name: s.depth for s in converted_stages(digits_converted)}
    assert stages == {"layer1": 4, "layer2": 3}


def test_unknown_integrator_lists_known_ones(digits, digits_converted) -> None:
    for call in (
        lambda: odeify.convert(digits, integrator="rk5", input_size=DIGITS_SHAPE),
        lambda: odeify.retarget(digits_converted, integrator="rk5"),
    ):
        with pytest.raises(ConfigError) as info:
            call()
        message = str(info.value)
        assert "'rk5'" in message
        assert all(name in message for name in KNOWN_INTEGRATORS)


def test_integrator_of_wrong_type(digits) -> None:
    with pytest.raises(ConfigError, match="integrator must be a name"):
        odeify.convert(digits, integrator=4, input_size=DIGITS_SHAPE)


def test_user_tableau_converts(digits, image) -> None:
    """A user's Heun3 tableau against the same three stages written out by hand."""
    heun3 = Tableau.create("heun3", [[0, 0, 0], ["1/3", 0, 0], [0, "2/3", 0]], ["1/4", 0, "3/4"], order=3)
    converted = odeify.convert(
        copy.deepcopy(digits).double(), integrator=heun3, steps=3, input_size=DIGITS_SHAPE
    )
    stage = converted_stages(converted)[0].standalone()
    assert {s.integrator.name for s in converted_stages(converted)} == {"heun3"}
    x = image((2, 16, 8, 8), dtype=torch.float64).relu()
    h = Fraction(1, 3)
    want = x
    with torch.no_grad():
        for n in range(3):
            t = n * h
            k1 = stage.field(t, want)
            k2 = stage.field(t + h / 3, want + float(h / 3) * k1)
            k3 = stage.field(t + 2 * h / 3, want + float(2 * h / 3) * k2)
            want = want + float(h) * (k1 / 4 + 3 * k3 / 4)
        got = stage(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-14


@pytest.mark.parametrize("steps", [0, -1, True, "fast", "2", [3]])
def test_bad_steps(digits, steps) -> None:
    with pytest.raises(ConfigError, match="positive integer"):
        odeify.convert(digits, steps=steps, input_size=DIGITS_SHAPE)
    with pytest.raises(ConfigError, match="positive integer"):
        odeify.convert(digits, steps={"layer1": steps}, input_size=DIGITS_SHAPE)


@pytest.mark.parametrize("steps", ["x0", "x-2", "xnan", "xinf", "x", "x1e999999999", "x" + "9" * 40])
def test_bad_steps_multiplier(digits_converted, steps: str) -> None:
    with pytest.raises(ConfigError, match="steps multiplier is 'x' and a positive number"):
        odeify.retarget(digits_converted, steps=steps)


@pytest.mark.parametrize("steps", [2.0, 0.5, math.nan])
def test_float_steps_are_refused_with_both_spellings(digits_converted, steps: float) -> None:
    """2.0 could mean two steps or twice the depth: refused, naming both spellings."""
    with pytest.raises(ConfigError, match=r"integer number of steps .* multiplier as a string"):
        odeify.retarget(digits_converted, steps=steps)


def test_steps_spellings(digits_converted) -> None:
    """An integer (numpy's too) is a step count; 'x<m>' multiplies each stage's depth (rounded, >= 1:
    for the whole model a stage below one step is clamped to one); a multiplier that gives one named
    stage less than half a step is refused, not rounded up to one."""
    cases = {3: (3, 3), np.int64(5): (5, 5), "x2": (8, 6), "x2.5": (10, 8), "x0.5": (2, 2), "x0.2": (1, 1)}
    cases["native"], cases["x0.01"] = (4, 3), (1, 1)
    for steps, expected in cases.items():
        converted = odeify.retarget(digits_converted, steps=steps)
        assert tuple(s.steps for s in converted_stages(converted)) == expected, steps
    with pytest.raises(ConfigError, match="fewer than one"):
        odeify.retarget(digits_converted, steps={"layer1": "x0.01"})


def test_stage_dict_with_unknown_name_lists_the_stages(digits, digits_converted) -> None:
    calls = [
        lambda: odeify.convert(digits, steps={"layer9": 2}, input_size=DIGITS_SHAPE),
        lambda: odeify.convert(digits, knots={"layer1": 2, "stage3": 2}, input_size=DIGITS_SHAPE),
        lambda: odeify.retarget(digits_converted, steps={"layer9": 2}),
        lambda: odeify.retarget(digits_converted, knots={"layer9": 2}),
        lambda: odeify.set_backward(digits_converted, {"layer9": "checkpoint"}),
    ]
    for call in calls:
        with pytest.raises(ConfigError, match="do not exist") as info:
            call()
        assert "layer1" in str(info.value) and "layer2" in str(info.value)


@pytest.mark.parametrize(
    ("knots", "needle"),
    [
        (0, ">= 1"),
        (-3, ">= 1"),
        (MAX_KNOTS + 1, "exceeds the maximum"),
        (2.5, "positive int"),
        ("half", "positive int"),
    ],
)
def test_bad_knots(digits, digits_converted, knots, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        odeify.convert(digits, knots=knots, input_size=DIGITS_SHAPE)
    with pytest.raises(ConfigError, match=needle):
        odeify.retarget(digits_converted, knots={"layer2": knots})


def test_unknown_basis_and_backward(digits, digits_converted) -> None:
    with pytest.raises(ConfigError, match="known bases: constant, cubic, linear"):
        odeify.convert(digits, basis="quadratic", input_size=DIGITS_SHAPE)
    with pytest.raises(ConfigError, match="known bases"):
        odeify.retarget(digits_converted, basis="quadratic")
    with pytest.raises(ConfigError, match="unknown backward mode"):
        odeify.retarget(digits_converted, backward="adjoint")


def test_retarget_needs_a_converted_model(digits) -> None:
    traced = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="no ODE stages"):
        odeify.retarget(traced, steps=2)


# --- retargeting the basis: when knots can serve another basis ----------------------------------------
#
# Rule (odeify.passes.manifest): a stage may switch basis with its knots as they
# are only when it has one knot per block. Those knots are the blocks' weights, which every basis
# interpolates, so native Euler stays exact. Knots compressed by least squares (or refined) under
# one basis are values of that basis's weight path; reading them with another basis would silently
# swap the weight path for one that is neither the old path nor the least-squares fit under the new
# basis. That is a ConfigError, unless the same call also sets the knot count, which explicitly
# resamples the current path.


def test_basis_switch_on_native_knots_keeps_native_exactness(digits, digits_converted, image) -> None:
    x = image(DIGITS_SHAPE)
    with torch.no_grad():
        ref, exact = digits(x), as_float64(digits)(x.double())
        for basis in BASES:
            out = odeify.retarget(digits_converted, basis=basis)(x)
            assert_as_accurate_as({basis: out}, {basis: ref}, {basis: exact}, FP32_FACTOR)


def test_basis_switch_on_compressed_knots_is_refused(digits_converted) -> None:
    compressed = odeify.retarget(digits_converted, knots={"layer1": 2})
    with pytest.raises(ConfigError) as info:
        odeify.retarget(compressed, basis="cubic")
    message = str(info.value)
    assert (
        "'layer1' has 2 knots for its 4 blocks, compressed by least squares under the 'constant'" in message
    )
    assert "convert the original model with basis='cubic', knots=2" in message
    assert "knots='native'" in message
    with pytest.raises(ConfigError, match="compressed by least squares"):
        odeify.retarget(
            compressed, basis="linear", knots={"layer1": 2}
        )  # same count: still a reinterpretation
    refined = odeify.retarget(digits_converted, knots={"layer2": 5})
    with pytest.raises(ConfigError, match="'layer2' has 5 knots for its 3 blocks, refined under"):
        odeify.retarget(refined, basis="linear")


def test_basis_switch_with_new_knot_count_resamples(digits_converted) -> None:
    compressed = odeify.retarget(digits_converted, knots={"layer1": 2})
    resampled = odeify.retarget(compressed, basis="cubic", knots="native")
    assert [(s.basis, s.num_knots) for s in converted_stages(resampled)] == [("cubic", 4), ("cubic", 3)]
    # the constant 2-knot path sampled at k/4: knots 0, 0, 1, 1
    layer1 = converted_stages(compressed)[0]
    again = converted_stages(resampled)[0]
    for name, coarse in layer1.knots.items():
        torch.testing.assert_close(again.knots[name], coarse[[0, 0, 1, 1]], rtol=0, atol=0)
    # from native knots a basis and a compression together fit the blocks under the new basis
    cubic2 = odeify.retarget(digits_converted, basis="cubic", knots={"layer1": 2})
    assert converted_stages(cubic2)[0].basis == "cubic"


def test_convert_with_knots_equals_retarget(digits) -> None:
    """Compressing at conversion and compressing a converted model are the same least-squares fit."""
    at_convert = odeify.convert(digits, basis="linear", knots={"layer1": 2}, input_size=DIGITS_SHAPE)
    later = odeify.retarget(
        odeify.convert(digits, basis="linear", input_size=DIGITS_SHAPE), knots={"layer1": 2}
    )
    for a, b in zip(converted_stages(at_convert), converted_stages(later), strict=True):
        assert (a.basis, a.num_knots) == (b.basis, b.num_knots)
        for name, knot in a.knots.items():
            assert torch.equal(knot, b.knots[name]), (a.stage_name, name)
    assert [s.num_knots for s in converted_stages(at_convert)] == [2, 3]


class _Block(nn.Module):
    """A post-activation identity block, with or without an activation inside its branch."""

    def __init__(self, channels: int, inner_act: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = nn.ReLU() if inner_act else nn.Identity()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.out = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x + self.conv2(self.act(self.conv1(x))))


class _TwoRuns(nn.Module):
    """Four same-shape identity blocks in one Sequential that form two runs (the branches differ)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(*(_Block(8, inner_act=i < 2) for i in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x)).mean((2, 3))


def test_adjacent_runs_are_both_lifted(image) -> None:
    """The second run's input is the first run's output, which lifting the first run replaces."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = _TwoRuns().double().eval()
    shape = (2, 3, 8, 8)
    converted = odeify.convert(net, input_size=shape)
    assert [(s.stage_name, s.depth) for s in converted_stages(converted)] == [
        ("blocks", 2),
        ("blocks.run2", 2),
    ]
    x = image(shape, dtype=torch.float64)
    with torch.no_grad():
        assert relative_error(converted(x), net(x)) <= 1e-12


# --- blocks beyond the ResNet family: scaled shortcuts, Sequential slot names, slices, periods -------


class _ScaledBlock(nn.Module):
    """PoolFormerV2's ``res_scale``: ``x * s + f(x)``; its ODE field is ``block(x) - x``, not ``f(x)``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.scale = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.view(1, -1, 1, 1) + self.norm(self.conv(torch.relu(x)))


class _SequentialResidual(nn.Module):
    """ConvMixer's ``Residual(nn.Sequential(conv, act, bn))``: parameter paths start with an index."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fn = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, groups=channels), nn.GELU(), nn.BatchNorm2d(channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fn(x)


class _CropBlock(nn.Module):
    """Pads its branch and crops it back to the input's size: a slice holds fx nodes (Swin)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.pad(self.conv(torch.relu(x)), (0, 1, 0, 1))
        return x + h[:, :, : x.shape[2], : x.shape[3]]


class _Stack(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x)).mean((2, 3))


def _randomized(net: nn.Module) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for module in net.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_().mul_(0.1)
                module.running_var.uniform_(0.5, 1.5)
            if isinstance(module, _ScaledBlock):
                module.scale.data.uniform_(0.5, 1.5)
    return net.double().eval()


STACK_SHAPE = (2, 3, 8, 8)


def test_scaled_shortcut_converts_with_the_field_block_minus_x(image) -> None:
    """Native: exact. Twice the steps: each Euler step is x + (block_k(x) - x) / 2, by hand on eager."""
    net = _randomized(_Stack(*(_ScaledBlock(8) for _ in range(3))))
    x = image(STACK_SHAPE, dtype=torch.float64)
    native = odeify.convert(net, input_size=STACK_SHAPE)
    assert [(s.stage_name, s.depth, s.form) for s in converted_stages(native)] == [("blocks", 3, "post")]
    doubled = odeify.retarget(native, steps="x2")
    with torch.no_grad():
        assert relative_error(native(x), net(x)) <= FP64_TOLERANCE
        h = net.stem(x)
        for block in net.blocks:
            for _ in range(2):
                h = h + 0.5 * (block(h) - h)
        want = h.mean((2, 3))
        assert relative_error(doubled(x), want) <= FP64_TOLERANCE
        assert relative_error(want, net(x)) > 1e-3  # the manifestation does differ from the network


def test_sequential_indices_become_identifier_slot_names(image) -> None:
    """ConvMixer's slots were '0_weight', a SyntaxError in the generated template."""
    net = _randomized(_Stack(*(_SequentialResidual(8) for _ in range(3))))
    converted = odeify.convert(net, input_size=STACK_SHAPE)
    (stage,) = converted_stages(converted)
    assert stage.depth == 3 and all(slot.name.isidentifier() for slot in stage.slots)
    assert "_0_weight" in {slot.name for slot in stage.slots}
    x = image(STACK_SHAPE, dtype=torch.float64)
    with torch.no_grad():
        assert relative_error(converted(x), net(x)) <= FP64_TOLERANCE
    assert "_0_weight" in odeify.model_code(odeify.retarget(converted, backward="checkpoint"))


def test_slices_holding_nodes_are_lifted_into_the_template(image) -> None:
    net = _randomized(_Stack(*(_CropBlock(8) for _ in range(3))))
    converted = odeify.convert(net, input_size=STACK_SHAPE)
    assert [s.depth for s in converted_stages(converted)] == [3]
    x = image(STACK_SHAPE, dtype=torch.float64)
    with torch.no_grad():
        assert relative_error(converted(x), net(x)) <= FP64_TOLERANCE
        assert relative_error(odeify.retarget(converted, steps="x2")(x), net(x)) > 1e-3


def test_a_run_of_period_2_becomes_a_split_stage(image) -> None:
    """Alternating blocks: one split stage of 3 periods, exact at native; Lie-Trotter at twice the
    steps is each sub-block's half Euler step in turn, by hand on eager (fields block(x) - x)."""
    net = _randomized(_Stack(*(b for _ in range(3) for b in (_ScaledBlock(8), _CropBlock(8)))))
    plan = odeify.analyze(net, input_size=STACK_SHAPE)
    assert [(r.name, r.length, r.period) for r in plan.runs] == [("blocks", 3, 2)]
    converted = odeify.convert(net, input_size=STACK_SHAPE)
    (stage,) = converted_stages(converted)
    assert (stage.depth, stage.num_fields) == (3, 2) and not converted.meta["odeify"]["not_lifted"]
    x = image(STACK_SHAPE, dtype=torch.float64)
    doubled = odeify.retarget(converted, steps="x2")
    with torch.no_grad():
        assert relative_error(converted(x), net(x)) <= FP64_TOLERANCE
        h = net.stem(x)
        pairs = list(zip(net.blocks[0::2], net.blocks[1::2], strict=True))
        for first, second in pairs:
            for _ in range(2):
                h = h + 0.5 * (first(h) - h)
                h = h + 0.5 * (second(h) - h)
        want = h.mean((2, 3))
        assert relative_error(doubled(x), want) <= FP64_TOLERANCE
        assert relative_error(want, net(x)) > 1e-3
