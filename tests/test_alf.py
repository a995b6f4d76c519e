"""ALF (MALI's asynchronous leapfrog, damping 1) as an integrator and on the reversible lattice.

What is ALF's own here: its unrolled graph against an independent eager loop of the recurrence;
the bit-exact rebuild of (z_0, v_0) by the lattice inverse; the refusal where a step's midpoint
falls on a jump of the weight path; a growing parasitic mode caught by the lattice bound (warning
and exact fallback, never silent); saving it. Its gradients against backprop (stage and whole
model, DropPath, autocast, torch.compile, channels_last, DDP) run with reversible Heun's in
test_adjoint.py, test_whole_model.py, test_compile.py, test_channels_last.py and test_ddp.py.
"""

from __future__ import annotations

import copy
import warnings
from fractions import Fraction

import pytest
import torch
import torch.fx as fx
from torch import nn

import odeify
from odeify.core.errors import ConfigError
from odeify.ir.stage_ir import Slot
from odeify.models.digits import DEFAULT_MODEL_PATH
from odeify.models.loading import load_model
from odeify.numerics.schemes import AsyncLeapfrog
from odeify.runtime import reversible
from odeify.runtime.lattice import Lattice, half_step

pytestmark = pytest.mark.usefixtures("one_thread")

ALF_VARIANTS = [AsyncLeapfrog("zero"), AsyncLeapfrog("field")]
"""The default (v_0 = 0) and MALI's start (v_0 = F(t_0, z_0)), which the benchmarks measure against it."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def digits64() -> fx.GraphModule:
    return odeify.convert(load_model(DEFAULT_MODEL_PATH).double())


def stage_of(gm: fx.GraphModule, index: int = 0, **settings) -> odeify.ODEStage:
    stage = odeify.converted_stages(gm)[index].standalone()
    return stage.configure(**settings)


def stage_input(stage: odeify.ODEStage, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dtype = stage.knot_tensors()[0].dtype
    return torch.randn(2, 16, 8, 8, generator=g, dtype=torch.float64).relu().to(dtype)


def eager_alf(stage: odeify.ODEStage, x: torch.Tensor) -> torch.Tensor:
    """The recurrence as MALI writes it, on odeify's field at exact times: an oracle apart from emit."""
    h = Fraction(1, stage.steps)
    z = x
    v = stage.field(Fraction(0), x) if stage.integrator.initial_velocity == "field" else torch.zeros_like(x)
    for n in range(stage.steps):
        s = z + float(h / 2) * v
        u = stage.field((n + Fraction(1, 2)) * h, s)
        v = 2 * u - v
        z = s + float(h / 2) * v
    return z


@pytest.mark.parametrize("alf", ALF_VARIANTS, ids=["v0-zero", "v0-field"])
@pytest.mark.parametrize(("basis", "steps"), [("constant", 4), ("constant", 8), ("linear", 3), ("cubic", 5)])
def test_unrolled_graph_is_the_alf_recurrence(digits64, alf, basis, steps) -> None:
    """float64: the emitted graph computes the recurrence (measured: 0.0, the same operations)."""
    stage = stage_of(digits64, basis=basis, integrator=alf, steps=steps)
    x = stage_input(stage)
    with torch.no_grad():
        got, want = stage(x), eager_alf(stage, x)
    assert rel(got, want) <= 1e-13
    code = stage.unrolled_graph().code
    assert "layer1_v_1 = " in code and f"layer1_z_{steps} = " in code  # readable: v_1 .. z_N by name


@pytest.mark.parametrize("alf", ALF_VARIANTS, ids=["v0-zero", "v0-field"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-droppath"])
def test_lattice_inverse_rebuilds_z0_and_v0_bit_for_bit(monkeypatch, test_model, alf, dtype, train) -> None:
    """Undoing every op from the compact final state gives back the input's counts and p_0 = h/2 v_0 = 0
    exactly (v_0 = F(t_0, z_0): undone too), with DropPath's masks replayed in train mode."""
    model = test_model("resnet18", dtype=dtype, drop_path_rate=0.5)
    gm = odeify.convert(model, integrator=alf, steps="x3", input_size=(1, 3, 32, 32)).train(train)
    stage = odeify.converted_stages(gm)[0].standalone()
    stage.configure(backward="reversible")
    x = torch.randn(2, 64, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(dtype)
    rebuilt = {}
    gap = reversible._Walk.rebuild_gap

    def capture(walk) -> torch.Tensor:
        rebuilt.update({name: t.clone() for name, t in walk.registers.items()})
        return gap(walk)

    monkeypatch.setattr(reversible._Walk, "rebuild_gap", capture)
    torch.manual_seed(0)
    stage(x.requires_grad_()).sum().backward()
    start = Lattice(x, half_step(stage)).counts(x.detach())
    assert torch.equal(rebuilt["z"], start)
    assert not rebuilt["p"].any()
    assert stage.adjoint_stats.last_errors == [0.0] and stage.adjoint_stats.fallbacks == 0


def test_midpoint_on_a_jump_of_the_weight_path_is_refused(digits64) -> None:
    """At half the steps each midpoint sits on a block boundary: ALF would read one block of every two.

    Measured (benchmarks/reversible_paths.py): reversible Heun at these steps stays closer to the
    source network than ALF does, with the point value or with the weights averaged over the step.
    """
    model = load_model(DEFAULT_MODEL_PATH)
    with pytest.raises(ConfigError, match=r"midpoint t = 1/4 falls on a jump.*integrator='reversible_heun'"):
        odeify.convert(model, integrator="alf", steps="x0.5")
    with pytest.raises(ConfigError, match="falls on a jump"):
        odeify.retarget(digits64, integrator="alf", steps=2)
    stage = stage_of(digits64, integrator="alf")
    with pytest.raises(ConfigError, match="falls on a jump"):
        stage.configure(steps=2)
    assert (stage.integrator.name, stage.steps) == ("alf", 4)  # refused as a whole
    # on a continuous path, or where no midpoint meets a jump (3 steps over layer2's 3 blocks), it runs
    odeify.convert(model, integrator="alf", steps="x0.5", basis="linear")
    odeify.retarget(digits64, integrator="alf", steps={"layer2": 2, "layer1": 4})


class _Decay(nn.Module):
    """A pre-activation block with the branch ``w * x``: the field F = L w x, linear, decaying for w < 0."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        branch = x * w
        return branch, x + branch


def decaying_stage(rate: float, depth: int, steps: int, dtype: torch.dtype) -> odeify.ODEStage:
    """dx/dt = -rate x: the exact flow shrinks x by e^-rate; ALF's parasitic mode grows by about e^rate."""
    knots = torch.full((depth, 1, 4, 1, 1), -rate / depth, dtype=dtype)
    template = fx.symbolic_trace(_Decay())
    return odeify.ODEStage(
        "decay", template, [Slot("w", "param")], {"w": knots}, "pre", depth, integrator="alf", steps=steps
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_growing_parasitic_mode_is_caught(dtype) -> None:
    """ALF is stable only near the imaginary axis: on a decaying field its parasitic mode grows.

    With rate 24 over 16 steps each step multiplies it by 1.5 + sqrt(1 + 1.5^2) = 3.3 (2e8 in all),
    past what the lattice's counts hold exactly (2^24 times the input for fp32, 2^8 for fp64): the
    forward keeps its input instead, warns once (at the caller's line) and backward recomputes,
    exactly. The same stage at rate 0.1 stays on the lattice and rebuilds its start bit for bit.
    """
    x = torch.rand(3, 4, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(dtype)
    cot = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dtype)
    for rate, caught in [(24.0, True), (0.1, False)]:
        stage = decaying_stage(rate, depth=8, steps=16, dtype=dtype)
        reference = stage.standalone()
        grads = {}
        for mode, module in [("backprop", reference), ("reversible", stage)]:
            module.configure(backward=mode)
            inputs = x.clone().requires_grad_()
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                out = module(inputs)
                (out * cot).sum().backward()
            grads[mode] = [inputs.grad, module.knots["w"].grad]
        assert (stage.adjoint_stats.fallbacks == 1) == caught
        assert len(warned) == int(caught)
        if caught:
            assert warned[0].category is odeify.FallbackWarning and warned[0].filename == __file__
            assert "cannot keep its final state exactly: its state grew" in str(warned[0].message)
            assert float(out.detach().abs().max()) > 1e6 * float(x.abs().max())  # the method's own growth
        else:
            assert stage.adjoint_stats.last_errors == [0.0]
        tolerance = 1e-10 if dtype == torch.float64 else 1e-5  # fp32: the same ops, measured 2e-7
        for got, want in zip(grads["reversible"], grads["backprop"], strict=True):
            assert rel(got, want) <= tolerance


def test_saved_and_loaded_like_any_integrator(tmp_path, digits64) -> None:
    model = odeify.retarget(digits64, integrator="alf", steps="x2", backward="reversible")
    path = tmp_path / "alf.safetensors"
    odeify.save(model, path)
    again = odeify.load(path)
    assert [(s.integrator, s.steps, s.backward) for s in odeify.converted_stages(again)] == [
        (AsyncLeapfrog(), 8, "reversible"),
        (AsyncLeapfrog(), 6, "reversible"),
    ]
    x = torch.randn(2, 1, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
    field_start = odeify.retarget(digits64, integrator=AsyncLeapfrog("field"))
    with pytest.raises(ConfigError, match="a saved recipe cannot name"):
        odeify.save(field_start, tmp_path / "field_start.safetensors")


def test_alf_with_checkpoint_matches_backprop(digits64) -> None:
    """ALF's (z, v) step graphs chain like any state: checkpoint's re-runs give backprop's gradient."""
    for alf in ALF_VARIANTS:
        model = odeify.retarget(digits64, integrator=alf, steps="x2")
        x = torch.randn(2, 1, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        grads = {}
        for mode in ("backprop", "checkpoint"):
            copy_ = odeify.set_backward(copy.deepcopy(model), mode)
            copy_(x).pow(2).sum().backward()
            grads[mode] = [p.grad for p in copy_.parameters()]
        assert max(rel(a, b) for a, b in zip(grads["checkpoint"], grads["backprop"], strict=True)) <= 1e-12
