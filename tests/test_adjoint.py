"""Memory-saving backward modes (odeify.runtime.adjoint) against autograd through the unrolled stage."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
import warnings
from fractions import Fraction
from typing import ClassVar

import pytest
import torch
from precision import as_float64, assert_as_accurate_as
from timm.layers import DropPath
from torch import nn

import odeify
from odeify.codegen import emit
from odeify.core.errors import ConfigError
from odeify.models._testing import make_test_model
from odeify.models.digits import DEFAULT_MODEL_PATH, load_digits
from odeify.models.loading import load_model
from odeify.numerics.schemes import (
    Add,
    AsyncLeapfrog,
    Evaluate,
    Op,
    Reflect,
    Register,
    ReversibleHeun,
    ReversibleScheme,
    validate_scheme,
)
from odeify.runtime import adjoint, rerun, reversible
from odeify.runtime import stage as runtime_stage
from odeify.runtime.lattice import Lattice, lattice_bits

FP64_TOL = {"checkpoint": 1e-12, "reversible": 1e-10}
"""Relative gradient error allowed vs backprop in float64, where both are exact to round-off."""
FP32_FACTOR = 2.0
"""In float32 a memory-free gradient is judged against float64 backprop of the same stage: its error
may be 2x float32 backprop's own (measured on AMD EPYC, torch 2.14: at most 1.03x over every float32
case here; reversible is often far closer to float64 than float32 backprop, 2e-7 against 2e-3 on
the deep linear-path stages)."""


SCHEMES = ["reversible_heun", "alf"]
"""The reversible integrators ``backward='reversible'`` runs, on one lattice runtime: every test of it
runs both."""

pytestmark = pytest.mark.usefixtures("one_thread")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def grads_of(module: nn.Module, x: torch.Tensor, cotangent: torch.Tensor) -> dict[str, torch.Tensor]:
    """d<module(x), cotangent>/d(x, every parameter)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    (module(x) * cotangent).sum().backward()
    return {"x": x.grad, **{n: p.grad for n, p in module.named_parameters() if p.grad is not None}}


def with_backward(gm: torch.fx.GraphModule, mode: str) -> torch.fx.GraphModule:
    """A copy of ``gm`` with backward ``mode`` (``odeify.set_backward`` works in place)."""
    return odeify.set_backward(copy.deepcopy(gm), mode)


def stage_grads(stage: odeify.ODEStage, mode: str, x: torch.Tensor, cotangent: torch.Tensor) -> dict:
    stage.configure(backward=mode)
    return grads_of(stage, x, cotangent)


def assert_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert rel(got[name], want[name]) <= tol, (name, rel(got[name], want[name]))


def backprop_reference(
    module: nn.Module, x: torch.Tensor, cotangent: torch.Tensor
) -> tuple[dict, dict | None]:
    """Backprop's gradients of ``module`` (in its backprop configuration), and in float32 also those of
    its float64 copy: the exact reference a float32 result is judged by."""
    want = grads_of(module, x, cotangent)
    if x.dtype == torch.float64:
        return want, None
    return want, grads_of(as_float64(module), x.double(), cotangent.double())


def assert_matches_backprop(got: dict, reference: tuple[dict, dict | None], mode: str) -> None:
    """float64: ``got`` equals backprop's gradients to round-off. float32: ``got`` is as close to
    float64 backprop as float32 backprop is (FP32_FACTOR)."""
    want, exact = reference
    if exact is None:
        assert_close(got, want, FP64_TOL[mode])
    else:
        assert_as_accurate_as(got, want, exact, FP32_FACTOR)


def stage_reference(stage: odeify.ODEStage, x: torch.Tensor, cotangent: torch.Tensor) -> tuple:
    stage.configure(backward="backprop")
    return backprop_reference(stage, x, cotangent)


def digits_stage(index: int, dtype: torch.dtype, *retargets: dict, **retarget) -> odeify.ODEStage:
    """A stage of the shipped digits model (16 ch at 8x8, 32 ch at 4x4), retargeted in turn."""
    gm = odeify.convert(load_model(DEFAULT_MODEL_PATH).to(dtype))
    for settings in (*retargets, retarget):
        gm = odeify.retarget(gm, **settings) if settings else gm
    return odeify.converted_stages(gm)[index].standalone()


def stage_input(stage: odeify.ODEStage, batch: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    channels = stage.knot_tensors()[0].shape[1]
    size = 8 if channels == 16 else 4
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, size, size, generator=g, dtype=dtype).relu()


@pytest.fixture(scope="module")
def resnet18() -> dict[torch.dtype, torch.fx.GraphModule]:
    return {
        dtype: odeify.convert(make_test_model("resnet18", dtype=dtype), input_size=(1, 3, 32, 32))
        for dtype in (torch.float64, torch.float32)
    }


# -- exactness: whole converted models ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_checkpoint_and_reversible_match_backprop_on_resnet18(resnet18, dtype) -> None:
    x = torch.randn(2, 3, 32, 32, dtype=dtype, generator=torch.Generator().manual_seed(0))
    cot = torch.randn(2, 1000, dtype=dtype, generator=torch.Generator().manual_seed(1))
    ref = backprop_reference(resnet18[dtype], x, cot)
    assert_matches_backprop(grads_of(with_backward(resnet18[dtype], "checkpoint"), x, cot), ref, "checkpoint")

    for scheme in SCHEMES:
        manifestation = odeify.retarget(resnet18[dtype], integrator=scheme)
        ref = backprop_reference(manifestation, x, cot)
        reversible = with_backward(manifestation, "reversible")
        assert all(s.backward == "reversible" for s in odeify.converted_stages(reversible))
        assert_matches_backprop(grads_of(reversible, x, cot), ref, "reversible")
        assert all(s.adjoint_stats.backward_passes == 1 for s in odeify.converted_stages(reversible))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_resnet50_layer3_stage_matches_backprop(dtype) -> None:
    """The 5-block bottleneck stage of resnet50, run alone at its native input shape (small spatially)."""
    gm = odeify.convert(make_test_model("resnet50", dtype=dtype), input_size=(1, 3, 64, 64))
    stage = next(s for s in odeify.converted_stages(gm) if s.stage_name == "layer3").standalone()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1024, 4, 4, generator=g, dtype=dtype).relu()
    cot = torch.randn(2, 1024, 4, 4, generator=g, dtype=dtype)
    ref = stage_reference(stage, x, cot)
    assert_matches_backprop(stage_grads(stage, "checkpoint", x, cot), ref, "checkpoint")
    # a plain floating-point inverse amplifies fp32 round-off ~3x per step on this expansive
    # random-weight stage (it erred by 2e-2 here); the lattice state rebuilds every state exactly
    for scheme in SCHEMES:
        stage.configure(integrator=scheme, steps=10)
        ref = stage_reference(stage, x, cot)
        assert_matches_backprop(stage_grads(stage, "reversible", x, cot), ref, "reversible")
        assert stage.adjoint_stats.last_errors == [0.0]


# -- exactness: deep synthetic stages ------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "knots", "steps", "every"),
    [
        (torch.float64, 64, 64, 1),
        (torch.float64, 64, 64, 5),
        (torch.float32, 64, 64, 1),
        (torch.float64, 32, 256, 16),
        (torch.float32, 32, 256, 1),
    ],
)
def test_deep_stages_match_backprop(dtype, knots, steps, every) -> None:
    stage = digits_stage(0, dtype, knots=knots, steps=steps, basis="linear")
    x = stage_input(stage, 2, dtype)
    cot = torch.randn(x.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    ref = stage_reference(stage, x, cot)
    stage.configure(checkpoint_every=every)
    assert_matches_backprop(stage_grads(stage, "checkpoint", x, cot), ref, "checkpoint")

    for scheme in SCHEMES:
        stage.configure(integrator=scheme)
        ref = stage_reference(stage, x, cot)
        assert_matches_backprop(stage_grads(stage, "reversible", x, cot), ref, "reversible")
        assert stage.adjoint_stats.last_errors == [0.0]  # the rebuilt start registers agree bit for bit


# -- reverse: approximate, within what it reports ------------------------------------------------
@pytest.mark.parametrize("integrator", ["euler", "heun"])
def test_reverse_error_is_bounded_by_its_reconstruction_error(integrator) -> None:
    """On a smooth stage, grad error <= 10 * sum of the per-step reconstruction errors.

    The rebuilt state x'_n differs from x_n by at most the accumulated one-step errors (each
    amplified by the backward step's Lipschitz constant, near 1 at small h), and the gradient is
    first-order in the state error; 10 covers both constants with margin (the ratio measured
    <= 4.2 on both digits stages, Euler and Heun, 16 to 128 steps).
    """
    smooth = {"basis": "cubic"}  # the blocks' weights on a C2 path, then sampled at 64 knots
    stage = digits_stage(1, torch.float64, smooth, knots=64, steps=64, integrator=integrator)
    x = stage_input(stage, 4, torch.float64)
    cot = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = stage_grads(stage, "backprop", x, cot)
    got = stage_grads(stage, "reverse", x, cot)
    stats = stage.adjoint_stats
    assert stats.fallbacks == 0 and len(stats.last_errors) == 64
    bound = 10 * sum(stats.last_errors)
    errors = {name: rel(got[name], ref[name]) for name in ref}
    assert 0 < max(errors.values()) <= bound, (errors, bound)
    assert max(stats.last_errors) == stats.worst_error < adjoint.RECONSTRUCTION_TOLERANCE


def test_reverse_falls_back_to_exact_checkpointing_and_warns_once(resnet18) -> None:
    """Native-depth Euler on a ReLU ResNet cannot be stepped backward: the fallback takes over."""
    gm = with_backward(resnet18[torch.float64], "reverse")
    ref_gm = with_backward(resnet18[torch.float64], "checkpoint")
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cot = torch.randn(2, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with pytest.warns(odeify.FallbackWarning, match="could not rebuild its states") as caught:
        got = grads_of(gm, x, cot)
    assert {w.filename for w in caught} == {__file__}  # the line that ran backward
    stages = odeify.converted_stages(gm)
    deep = [s for s in stages if s.steps > 1]
    assert deep and len(caught) == len(deep)  # one warning per stage that has a step to rebuild
    assert all(s.stage_name in str(w.message) for s, w in zip(deep, caught, strict=True))
    assert_close(got, grads_of(ref_gm, x, cot), 1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        grads_of(gm, x, cot)
    assert all(s.adjoint_stats.fallbacks == 2 and s.adjoint_stats.backward_passes == 2 for s in deep)
    assert all(s.adjoint_stats.worst_error > adjoint.RECONSTRUCTION_TOLERANCE for s in deep)


def test_reverse_tolerance_can_be_set_per_stage() -> None:
    stage = digits_stage(0, torch.float64, knots=8, steps=8, basis="linear", backward="reverse")
    stage.reverse_tolerance = math.inf
    x = stage_input(stage, 2, torch.float64)
    grads_of(stage, x, torch.ones_like(x))
    assert stage.adjoint_stats.fallbacks == 0 and stage.adjoint_stats.worst_error > 1e-3


# -- randomness ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drop_path_model(test_model) -> torch.fx.GraphModule:
    """resnet18 with stochastic depth, in train mode; layer1's second block has a DropPath.

    Every nonzero drop rate is raised to 0.5 so that any two seeds draw different masks.
    """
    model = test_model("resnet18", dtype=torch.float64, drop_path_rate=0.2)
    gm = odeify.convert(model, input_size=(1, 3, 32, 32), steps="x3").train()
    assert len(odeify.converted_stages(gm)[0].variants) == 1
    for module in gm.modules():
        if isinstance(module, DropPath) and module.drop_prob > 0:
            module.drop_prob = 0.5
    return gm


def seeded(fn, seed: int = 123):
    """fn() after seeding, and the next draws of the global stream after it."""
    torch.manual_seed(seed)
    return fn(), torch.rand(3)


def test_drop_path_is_replayed_by_checkpoint(drop_path_model) -> None:
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cot = torch.randn(4, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    memory_free = with_backward(drop_path_model, "checkpoint")
    for stage in odeify.converted_stages(memory_free):
        stage.configure(checkpoint_every=2)  # steps between checkpoints are re-run in backward too
    ref, after_ref = seeded(lambda: grads_of(drop_path_model, x, cot))
    got, after = seeded(lambda: grads_of(memory_free, x, cot))
    assert_close(got, ref, 1e-12)
    assert torch.equal(after, after_ref)  # the global stream continues as after backprop
    other, _ = seeded(lambda: grads_of(memory_free, x, cot), seed=7)
    assert rel(other["x"], ref["x"]) > 1e-3  # other masks, other gradient: not vacuous


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("basis", ["constant", "linear"])
def test_drop_path_is_replayed_by_reversible(drop_path_model, basis, scheme) -> None:
    """Stage level: the reference is the stage's own eager backprop.

    With DropPath every field evaluation is its own draw, so reversible Heun's points z_m run two;
    on the linear path between the 2 knots both read both knots, and their knot gradients must
    add, not merge. ALF draws once per step, at the midpoint.
    """
    stage = odeify.converted_stages(drop_path_model)[0].standalone()
    stage.configure(integrator=scheme, basis=basis)
    assert stage.num_knots == 2
    x = torch.randn(4, 64, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cot = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, after_ref = seeded(lambda: stage_grads(stage, "backprop", x, cot))
    got, after = seeded(lambda: stage_grads(stage, "reversible", x, cot))
    assert_close(got, ref, 1e-10)
    assert stage.adjoint_stats.last_errors == [0.0]  # the replayed masks rebuild the states exactly
    assert torch.equal(after, after_ref)
    other, _ = seeded(lambda: stage_grads(stage, "reversible", x, cot), seed=7)
    assert rel(other["x"], ref["x"]) > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_replays_drop_path_and_keeps_the_cuda_stream(drop_path_model) -> None:
    """On a GPU the masks come from the CUDA generator: it is replayed and restored like the CPU one."""
    stage = odeify.converted_stages(drop_path_model)[0].standalone().cuda()
    x = torch.randn(4, 64, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).cuda()
    cot = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).cuda()

    def run(mode: str) -> tuple[dict, torch.Tensor]:
        torch.cuda.manual_seed(123)
        return stage_grads(stage, mode, x, cot), torch.rand(3, device="cuda")

    for integrator, mode in [("euler", "checkpoint"), *((scheme, "reversible") for scheme in SCHEMES)]:
        stage.configure(integrator=integrator, checkpoint_every=2)
        ref, after_ref = run("backprop")
        got, after = run(mode)
        assert_close(got, ref, 1e-10)
        assert torch.equal(after, after_ref)
        torch.cuda.manual_seed(7)
        assert rel(stage_grads(stage, mode, x, cot)["x"], ref["x"]) > 1e-3


# -- inputs, outputs and parameters --------------------------------------------------------------
def test_output_requires_grad_from_knots_alone_and_frozen_knots_get_none() -> None:
    stage = digits_stage(0, torch.float64, backward="checkpoint")
    x = stage_input(stage, 2, torch.float64)
    y = stage(x)
    assert y.requires_grad
    y.sum().backward()
    assert all(k.grad is not None for k in stage.knot_tensors())

    stage.zero_grad(set_to_none=True)
    stage.requires_grad_(False)
    xg = x.clone().requires_grad_()
    stage(xg).sum().backward()
    assert xg.grad is not None and all(k.grad is None for k in stage.knot_tensors())
    assert not stage(x).requires_grad


def test_trainable_template_parameters_get_gradients() -> None:
    """A user's stage may hold parameters outside its knots (here a PReLU): they train too."""
    stage = digits_stage(0, torch.float64, knots=8, steps=8, basis="linear")
    stage.template.act1 = nn.PReLU(16, init=0.1).double()
    stage.configure()  # drop cached step graphs
    x = stage_input(stage, 2, torch.float64)
    cot = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = stage_grads(stage, "backprop", x, cot)
    assert "template.act1.weight" in ref
    assert_close(stage_grads(stage, "checkpoint", x, cot), ref, 1e-12)


BF16_FACTOR = 1.5
"""Under bf16 autocast a memory-free gradient may be 1.5x as far from float64 backprop as bf16 backprop
is (measured on AMD EPYC: checkpoint 1.00x, reversible 1.03x; bf16 backprop is 6e-2 from float64)."""


@pytest.mark.parametrize(
    ("mode", "integrator"), [("checkpoint", "euler"), *(("reversible", s) for s in SCHEMES)]
)
def test_mixed_precision_is_replayed(mode, integrator) -> None:
    """Re-runs in backward see the forward's autocast state, as autograd through the graph does.

    The reversible schemes rebuild their lattice states exactly under autocast too, but those states
    differ from the unrolled graph's fp32 ones by fp32 round-off, which flips bf16 roundings of the
    fields' inputs: both are judged by their distance from float64 backprop, to bf16 accuracy.
    """
    stage = digits_stage(0, torch.float32, knots=8, steps=8, basis="linear", integrator=integrator)
    x = stage_input(stage, 2, torch.float32)
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))

    def grads(mode: str) -> dict:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return stage_grads(stage, mode, x, cot)

    ref = grads("backprop")
    exact = stage_reference(stage, x, cot)[1]
    assert rel(ref["x"], exact["x"]) > 1e-3  # bf16 does differ
    assert_as_accurate_as(grads(mode), ref, exact, BF16_FACTOR)
    if mode == "reversible":
        assert stage.adjoint_stats.last_errors == [0.0]


def test_step_graphs_take_only_the_knots_they_read(monkeypatch) -> None:
    """A re-run step differentiates w.r.t. its own knot rows, not a dense all-knot stack."""
    stage = digits_stage(0, torch.float32, knots=8, steps=8, basis="linear")
    assert [stage.step_graph(n).knot_window for n in range(8)] == [slice(n, n + 1) for n in range(8)]
    stage.configure(integrator="heun")  # also evaluates theta(t_{n+1}-): knot n + 1
    assert stage.step_graph(2).knot_window == slice(2, 4)
    stage.configure(integrator="euler", basis="cubic", steps=6)  # off the knots a C2 spline reads all
    assert stage.step_graph(1).knot_window == slice(0, 8)

    rows_per_gradient = []
    add = rerun.ParamGrads.add

    def recording(self, run, grads) -> None:
        rows_per_gradient.extend(g.shape[0] for g in grads[: len(run.knots)] if g is not None)
        add(self, run, grads)

    monkeypatch.setattr(rerun.ParamGrads, "add", recording)
    # at the knots (Euler steps, reversible Heun's points) one row; ALF's midpoints read the two knots
    # around them, but the last, past the last knot (7/8), where the path holds its end value
    for integrator, mode, rows in [
        ("euler", "checkpoint", {1}),
        ("reversible_heun", "reversible", {1}),
        ("alf", "reversible", {1, 2}),
    ]:
        rows_per_gradient.clear()
        stage.configure(basis="linear", integrator=integrator, steps=8, backward=mode)
        stage(stage_input(stage, 2, torch.float32)).sum().backward()
        assert rows_per_gradient and set(rows_per_gradient) == rows, integrator


@pytest.mark.parametrize(
    ("scheme", "basis", "per_step", "once"),
    [
        ("reversible_heun", "constant", 2, 0),
        ("reversible_heun", "linear", 1, 1),
        ("alf", "constant", 1, 0),
        (AsyncLeapfrog("field"), "constant", 1, 1),
    ],
    ids=["heun-constant", "heun-linear", "alf", "alf-field-start"],
)
def test_reversible_forward_evaluates_the_fields_the_unrolled_graph_does(
    monkeypatch, scheme, basis, per_step, once
) -> None:
    """Where the weight path is continuous (linear), reversible Heun's B_{m-1} and A_m are one evaluation.

    The oracle is the unrolled graph's NFE (emit shares an evaluation by its own rule): reversible
    Heun evaluates twice per step on the constant path, steps + 1 times on the linear one; ALF once
    per step, and once more at t = 0 when v_0 = F(t_0, z_0).
    """
    stage = digits_stage(0, torch.float32, knots="native", steps="native", basis=basis)
    stage.configure(integrator=scheme, backward="reversible")
    graphs = []
    delta_graph = reversible.delta_graph
    monkeypatch.setattr(reversible, "delta_graph", lambda *a: graphs.append(a) or delta_graph(*a))
    # slices are sized by one more evaluation per field (test_batch_slices.py), not the program's
    monkeypatch.setattr(reversible, "_sample_bytes", lambda *a: 1)
    stage(stage_input(stage, 2, torch.float32))  # forward only: backward evaluates each field again
    assert len(graphs) == emit.count_evaluations(stage) == per_step * stage.steps + once


@dataclasses.dataclass(frozen=True)
class StartLeapfrog(ReversibleScheme):
    """A scheme none of odeify's code knows: ALF's program with its evaluation at the step's start
    (z += p; p = 2 [h/2 F(t_n, z)] - p; z += p), first order. Only data: the emitted graphs and the
    lattice runtime read it from the program."""

    name: ClassVar[str] = "start_leapfrog"
    order: ClassVar[int] = 1
    evals_per_step: ClassVar[int] = 1
    registers: ClassVar[tuple[Register, ...]] = (
        Register("z", "input"),
        Register("p", "zero", lattice="increment", velocity="v"),
    )
    step: ClassVar[tuple[Op, ...]] = (
        Add("z", "p"),
        Evaluate("z", Fraction(0), False, "a"),
        Reflect("p", "a"),
        Add("z", "p"),
    )


def test_a_new_scheme_is_one_program() -> None:
    """Its unrolled graph is the recurrence (an eager loop over odeify's field), and checkpoint and
    reversible give backprop's gradients, the lattice rebuilding the start exactly."""
    scheme = StartLeapfrog()
    validate_scheme(scheme)
    stage = digits_stage(0, torch.float64, steps="x2", basis="linear")
    stage.configure(integrator=scheme)
    x, h = stage_input(stage, 2, torch.float64), Fraction(1, stage.steps)
    z, v = x, torch.zeros_like(x)
    for n in range(stage.steps):
        z = z + float(h / 2) * v
        v = 2 * stage.field(n * h, z) - v
        z = z + float(h / 2) * v
    with torch.no_grad():
        assert rel(stage(x), z) <= 1e-13  # measured: 0.0, the same operations
    cotangent = torch.randn(stage(x).shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = stage_grads(stage, "backprop", x, cotangent)
    for mode in ("checkpoint", "reversible"):
        assert_close(stage_grads(stage, mode, x, cotangent), want, FP64_TOL[mode])
    assert stage.adjoint_stats.last_errors == [0.0] and stage.adjoint_stats.fallbacks == 0


def test_saved_memory_is_flat_in_depth() -> None:
    """Bytes saved for backward (parameters excluded): constant for reverse/reversible."""

    def saved_bytes(stage: odeify.ODEStage, mode: str) -> int:
        params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen.setdefault(ptr, t.numel() * t.element_size())
            return t

        stage.configure(backward=mode)
        stage.reverse_tolerance = math.inf  # measure the memory of the pass that stays memory-free
        x = stage_input(stage, 2, torch.float32)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = stage(x)
        y.sum().backward()
        return sum(seen.values())

    state = stage_input(digits_stage(0, torch.float32), 2, torch.float32)
    state_bytes = state.numel() * state.element_size()
    # reverse: x and x_N. reversible: its output (y_N, ALF's z_N), its rounding residual (int8 counts:
    # this stage grows its input less than 2^5), the other register (d = z_N - y_N, ALF's p_N = h/2 v_N;
    # int32 counts) and a lattice spacing per sample
    for integrator, mode, size in [
        ("euler", "reverse", 2 * state_bytes),
        *((scheme, "reversible", state_bytes * 9 // 4 + 8 * len(state)) for scheme in SCHEMES),
    ]:
        sizes = [
            saved_bytes(digits_stage(0, torch.float32, knots=n, steps=n, integrator=integrator), mode)
            for n in (8, 32)
        ]
        assert sizes == [size] * 2, (mode, sizes)
    stage = digits_stage(0, torch.float32, knots=8, steps=32)
    assert saved_bytes(stage, "checkpoint") == 32 * state_bytes
    stage.configure(checkpoint_every=8)
    assert saved_bytes(stage, "checkpoint") == 4 * state_bytes
    assert saved_bytes(stage, "backprop") >= 32 * 3 * state_bytes  # conv/relu inputs per step


# -- bad input ------------------------------------------------------------------------------------
def test_reversible_needs_reversible_heun(resnet18) -> None:
    with pytest.raises(ConfigError, match="reversible_heun"):
        odeify.set_backward(resnet18[torch.float32], "reversible")
    model = load_model(DEFAULT_MODEL_PATH)
    with pytest.raises(ConfigError, match="reversible_heun"):
        odeify.convert(model, backward="reversible")
    with pytest.raises(ConfigError, match="reversible"):
        odeify.convert(model, integrator="reversible_heun", backward="reverse")
    with pytest.raises(ConfigError, match="integrator='alf' is inverted exactly"):
        odeify.convert(model, integrator="alf", backward="reverse")
    stage = digits_stage(0, torch.float32, integrator="reversible_heun", backward="reversible")
    with pytest.raises(ConfigError, match="reversible_heun"):
        stage.configure(integrator="euler", steps=8)  # refused as a whole: nothing changes
    assert (stage.integrator.name, stage.steps, stage.backward) == ("reversible_heun", 4, "reversible")


def test_unknown_backward_mode(resnet18) -> None:
    with pytest.raises(ConfigError, match="unknown backward mode 'adjoint'"):
        odeify.set_backward(resnet18[torch.float32], "adjoint")
    stage = digits_stage(0, torch.float32)
    stage.settings = dataclasses.replace(stage.settings, backward="adjoint")  # bypassing configure's checks
    with pytest.raises(ConfigError, match="'adjoint'"):
        runtime_stage.integrate_with_adjoint(stage, stage_input(stage, 1, torch.float32))


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "2"])
def test_checkpoint_every_is_validated(every) -> None:
    with pytest.raises(ConfigError, match="checkpoint_every"):
        digits_stage(0, torch.float32).configure(checkpoint_every=every)


# -- no silent wrong answers ------------------------------------------------------------------------
def input_grads(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """d(sum of the outputs)/dx per sample; a NaN sample's outputs are left out of the sum."""
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out[~out.isnan().any(dim=1)].sum().backward()
    return x.grad


@pytest.mark.parametrize(
    ("integrator", "mode"), [("euler", "reverse"), *((s, "reversible") for s in SCHEMES)]
)
def test_a_nan_sample_leaves_the_clean_samples_gradients_exact(integrator, mode) -> None:
    """One NaN sample made reverse's reconstruction error NaN, which passed the tolerance check, and
    made reversible's rebuild check pass unwarned: the clean samples' gradients were 49% wrong.

    Now a non-finite error or state is a failure: the pass falls back to an exact one, and says so.
    """
    clean = load_digits("test")[0][:4]
    steps = "native" if integrator == "alf" else 2  # ALF at 2 steps over 4 blocks is refused
    gm = odeify.convert(load_model(DEFAULT_MODEL_PATH), integrator=integrator, steps=steps)
    want = {"x": input_grads(gm, clean)}  # float32 backprop
    exact = {"x": input_grads(as_float64(gm), clean.double())}
    with_nan = torch.cat([clean, torch.full_like(clean[:1], math.nan)])
    memory_free = with_backward(gm, mode)
    with pytest.warns(RuntimeWarning, match="not finite"):
        got = input_grads(memory_free, with_nan)
    assert_as_accurate_as({"x": got[:4]}, want, exact, FP32_FACTOR)
    stats = [s.adjoint_stats for s in odeify.converted_stages(memory_free)]
    assert all(s.fallbacks == 1 for s in stats)
    if mode == "reverse":
        assert all(s.worst_error == math.inf for s in stats)


def test_reversible_lattice_holds_states_exactly_up_to_its_bound() -> None:
    """Counts below 2^52 are kept exactly (int8..int32, then 5 to 7 bytes: the narrowest that holds
    them); at 2^52 or non-finite, refused."""
    x = torch.ones(2, 3)
    grid = Lattice(x, Fraction(1, 8))
    heun = ReversibleHeun()  # y, then z kept as z - y
    for y_count, d_count, d_type, width in [
        (2.0**52 - 2**32, 2**31 - 1, torch.int32, None),
        (1e6, -(2.0**35) - 3, torch.uint8, 5),  # 5 bytes per count below 2^39
        (1e6, 2.0**40, torch.uint8, 6),
        (1e6, -(2.0**51) - 1, torch.uint8, 7),
    ]:
        y = torch.full((2, 3), y_count, dtype=torch.float64)
        z = y + d_count
        out, (residual, d, _), why = grid.pack([y, z.clone()], heun)  # pack consumes z
        assert torch.equal(out, grid.value(y))
        assert not why and d.dtype == d_type and (width is None or d.shape == (2, 3, width))
        assert residual is None or residual.dtype in (torch.int8, torch.int16, torch.int32)
        rebuilt = grid.unpack(out, (residual, d), heun)
        assert torch.equal(rebuilt[0], y) and torch.equal(rebuilt[1], z)
    for bad, reason in [(2.0**52, "grew"), (math.inf, "not finite"), (math.nan, "not finite")]:
        y = torch.full((2, 3), bad, dtype=torch.float64)
        _, packed, why = grid.pack([y, y.clone()], heun)
        assert packed is None and reason in why


def test_an_even_register_is_kept_halved_and_rebuilt() -> None:
    """ALF's p (v_0 = 0) is only ever reflected, so its counts stay even: past int32 it is kept halved,
    one bit fewer (counts below 2^40 in 5 bytes, where a register of any parity takes 6); MALI's start,
    v_0 = F, makes p odd, and it is kept whole."""
    assert AsyncLeapfrog().even_registers == {"p"}
    assert not AsyncLeapfrog("field").even_registers and not ReversibleHeun().even_registers
    grid = Lattice(torch.ones(2, 3), Fraction(1, 2))
    g = torch.Generator().manual_seed(0)
    z = torch.randint(-(2**30), 2**30, (2, 3), generator=g).double()
    for scheme, p_counts, width in [
        (AsyncLeapfrog(), [2.0**40 - 2, -(2.0**40) + 2, 2.0**32 + 2, -6, 0, 4], 5),
        (AsyncLeapfrog(), [2.0**31, 2.0**31 + 2, -(2.0**31) - 2, 2, 0, 8], 4),
        (AsyncLeapfrog("field"), [2.0**40 - 1, -(2.0**40) + 1, 2.0**32 + 1, -7, 0, 3], 6),
    ]:
        p = torch.tensor(p_counts, dtype=torch.float64).view(2, 3)
        out, (residual, kept, _), why = grid.pack([z.clone(), p.clone()], scheme)
        assert not why and kept.dtype == torch.uint8 and kept.shape == (2, 3, width)
        rebuilt = grid.unpack(out, (residual, kept), scheme)
        assert torch.equal(rebuilt[0], z) and torch.equal(rebuilt[1], p)


def test_the_outputs_residual_is_int16_at_the_edge_unless_a_tie_reaches_it() -> None:
    """An output of 2^39..2^40 counts bounds its fp32 rounding residual by 2^15, one past int16: the
    residual itself is looked at, and int16 holds it unless an exact tie of +2^15 is in it."""
    grid = Lattice(torch.ones(1, 4), Fraction(1, 2))
    ulp = 2.0**16  # fp32's spacing at 2^39..2^40
    base = 2.0**39 + 2 * ulp  # an even fp32 mantissa: a tie just above it rounds down to it
    for offsets, kind in [([0, 1, -(2**15) + 1, 2**15 - 1], torch.int16), ([0, 1, 2**15, 3], torch.int32)]:
        y = base + torch.tensor([offsets], dtype=torch.float64)
        out, (residual, d, _), why = grid.pack([y.clone(), y.clone()], ReversibleHeun())
        assert not why and residual.dtype == kind
        assert torch.equal(residual.double(), y - out.double() / grid.quantum), "what fp32 rounding left"
        rebuilt = grid.unpack(out, (residual, d), ReversibleHeun())
        assert torch.equal(rebuilt[0], y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_lattice_spacing_is_each_samples_own_power_of_two(dtype) -> None:
    """q per sample is 2^(e - bits) for max|x| in [2^(e-1), 2^e), at least the dtype's smallest normal,
    and depends on that sample alone: checked against Python's frexp on each sample's largest value,
    with samples from a 1e-30 scale (clamped in fp32) to 1e30, a zero one, and a NaN one beside them."""
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-30, 3e-5, 1.0, 1e30, 0.0, 1.0], dtype=torch.float64).view(6, 1, 1, 1)
    x = (torch.randn(6, 3, 4, 5, generator=g, dtype=torch.float64) * scales).to(dtype)
    x[2, 1, 2, 3] = -(2.0**7)  # a negative largest magnitude, exactly a power of two
    x[5, 0, 0, 0] = float("nan")
    quantum = Lattice(x, Fraction(1, 2)).quantum
    smallest = math.frexp(torch.finfo(dtype).smallest_normal)[1] - 1
    for sample in range(5):
        largest = max(abs(v) for v in x[sample].double().flatten().tolist())
        exponent = math.frexp(largest)[1] if largest else 0  # frexp: largest = m 2^e, 1/2 <= m < 1
        want = 2.0 ** max(exponent - lattice_bits(dtype), smallest)
        assert quantum[sample].item() == want, (sample, largest)
    alone = Lattice(x[:5], Fraction(1, 2)).quantum  # without the NaN sample: the same spacings
    assert torch.equal(alone, quantum[:5]) and quantum.shape == (6, 1, 1, 1)


@pytest.mark.parametrize("half", [Fraction(1, 2), Fraction(1, 8), Fraction(1), Fraction(1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_increments_made_in_the_input_dtype_are_the_float64_counts(half, dtype) -> None:
    """At h L / 2 a power of two (up to 1) an increment's counts are made in the input's dtype: they
    must be the integers float64 arithmetic gives, for tiny, large and exactly tied values."""
    g = torch.Generator().manual_seed(0)
    magnitude = torch.tensor([1e-30, 1.0, 1e30]).view(3, 1, 1)  # per sample: q from 2^-126 (clamped) up
    x = (torch.randn(3, 4, 16, generator=g) * magnitude).to(dtype)
    lattice = Lattice(x, half)
    assert lattice._narrow_increments == (half.denominator != 3)
    field = torch.randn(3, 4, 16, generator=g) * 10.0 ** torch.randint(-8, 4, (3, 4, 16), generator=g)
    field = (field * magnitude).to(dtype)
    for finer in (0, 3):
        scale = float(half * 2**finer) / lattice.quantum
        ties = (torch.arange(16, dtype=torch.float64) - 7.5) / scale[:, :, 0]  # counts k + 1/2
        field[:, 0] = ties.to(dtype)
        want = torch.round(field.double() * scale)  # the float64 oracle: exact product, then round
        assert torch.equal(lattice.increment(field, x, finer), want)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    ("dtype", "scale", "falls_back"),
    [(torch.float32, 3e1, False), (torch.float32, 1e3, True), (torch.float64, 1e8, True)],
)
def test_reversible_state_past_the_lattice_bound_falls_back_exactly(dtype, scale, falls_back, scheme) -> None:
    """A field grown x1e8 rebuilt with a relative error of 0.997 and no warning.

    The float64 lattice sums are exact while the state is below 2^(52 - bits) times the input:
    2^24 for fp32. Growing the input 2^14..2^16 (x3e1; measured per scheme) stays memory-free and exact;
    2^34..2^41 (x1e3 in fp32) and x1e8 in fp64 (bound 2^8) keep the input instead, recompute, warn, and
    are exact too.
    """
    stage = digits_stage(0, dtype, knots=4, steps=4, integrator=scheme)
    with torch.no_grad():
        stage.knots["conv2_weight"].mul_(scale)
    x = stage_input(stage, 2, dtype)
    cot = torch.randn(x.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    want = stage_reference(stage, x, cot)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = stage_grads(stage, "reversible", x, cot)
    messages = [str(w.message) for w in caught]
    assert_matches_backprop(got, want, "reversible")
    stats = stage.adjoint_stats
    assert (stats.fallbacks, stats.backward_passes) == (int(falls_back), 1)
    if falls_back:
        assert len(messages) == 1 and "cannot keep its final state exactly: its state grew" in messages[0]
        assert caught[0].category is odeify.FallbackWarning and caught[0].filename == __file__
    else:
        assert not messages and stats.last_errors == [0.0]


def _kept(kept: list[torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    kept.append(tensor)
    return tensor


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_one_step_stage_keeps_its_input_quietly(resnet18, scheme, dtype) -> None:
    """One step, or one block at any steps (resnet18's layer2 after its downsampling block, at 4
    steps): the stage keeps its input (one state, which the part before keeps anyway) instead of its
    output's residual and the other registers, recomputes its steps in backward, with backprop's
    gradients, and neither warns nor counts a fallback. Two steps of a four-block stage keep the
    packed registers."""
    one_block = odeify.retarget(resnet18[dtype], steps="x4", integrator=scheme)
    cases = [
        (digits_stage(0, dtype, knots=1, steps=1, integrator=scheme), True),
        (digits_stage(0, dtype, knots=2, steps=2, integrator=scheme), False),
        (odeify.converted_stages(one_block)[1].standalone(), True),
    ]
    for stage, keeps_input in cases:
        steps = stage.steps
        x = stage_input(stage, 2, dtype)
        cot = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dtype)
        want = stage_reference(stage, x, cot)
        stage.configure(backward="reversible")
        kept: list[torch.Tensor] = []
        leaf = x.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no FallbackWarning
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(_kept, kept), lambda t: t):
                out = stage(leaf)
        assert any(t.data_ptr() == leaf.data_ptr() for t in kept) == keeps_input, steps
        assert any(not t.is_floating_point() for t in kept) != keeps_input, steps  # packed counts
        del out, kept  # the forward above only shows what is kept; grads_of runs its own step
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = grads_of(stage, x, cot)
        assert stage.adjoint_stats.fallbacks == 0
        assert_matches_backprop(got, want, "reversible")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_reversible_lattice_is_per_sample(scheme) -> None:
    """A sample's accuracy does not depend on its batch: a huge neighbour leaves it as exact as before.

    With one lattice spacing for the batch, sample 0 would sit on a 2e-4-coarse lattice: 1e3 times
    float32's own error, far past FP32_FACTOR.
    """
    stage = digits_stage(0, torch.float32, integrator=scheme, backward="reversible")
    x = stage_input(stage, 2, torch.float32).requires_grad_()
    loud = x.detach().clone()
    loud[1] *= 1e6
    quiet_out, loud_out = stage(x)[0], stage(loud.requires_grad_())[0]
    with torch.no_grad():
        exact = as_float64(stage)(x.detach().double())[0]
    assert_as_accurate_as({"y": loud_out.detach()}, {"y": quiet_out.detach()}, {"y": exact}, FP32_FACTOR)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_reversible_warns_on_every_inexact_rebuild(scheme) -> None:
    """A field that returns other bits on a re-run breaks the exact rebuild: every such pass says so,
    attributed to the line that ran backward."""
    stage = digits_stage(0, torch.float32, knots=4, steps=4, integrator=scheme, backward="reversible")
    calls = itertools.count()
    hook = stage.template.act1.register_forward_hook(lambda module, args, out: out + 1e-4 * (next(calls) % 3))
    x = stage_input(stage, 2, torch.float32)
    for _ in range(2):
        with pytest.warns(odeify.FallbackWarning, match="did not rebuild its states exactly") as caught:
            stage(x).sum().backward()
        assert stage.adjoint_stats.last_errors[0] > 0
        assert [w.filename for w in caught] == [__file__]
    hook.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stage(x).sum().backward()
    assert stage.adjoint_stats.last_errors == [0.0] and stage.adjoint_stats.worst_error > 0


def test_train_mode_batchnorm_is_refused() -> None:
    stage = digits_stage(0, torch.float32, backward="checkpoint")
    stage.template.act1 = nn.Sequential(nn.BatchNorm2d(16), nn.ReLU())
    stage.configure()
    x = stage_input(stage, 2, torch.float32)
    with pytest.raises(ConfigError, match=r"BatchNorm 'template\.act1\.0'.*\.eval\(\)"):
        stage(x)
    stage.template.act1.eval()
    before = copy.deepcopy(stage.template.act1[0].state_dict())
    stage(x).sum().backward()  # frozen BN is fine, and its statistics stay as they were
    assert all(torch.equal(v, before[k]) for k, v in stage.template.act1[0].state_dict().items())


class _NormedBranch(nn.Module):
    """A pre-activation block whose branch holds a BatchNorm the stage does not fold: ``w * norm(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        branch = self.norm(x) * w
        return branch, x + branch


@pytest.mark.parametrize("mode", ["checkpoint", "reverse", "reversible"])
def test_train_mode_batchnorm_in_a_stage_is_refused_by_rerunning_modes(mode: str) -> None:
    """A re-run would update the running statistics a second time: refused in training mode, run in eval."""
    from odeify.ir.stage_ir import Slot

    knots = torch.full((2, 1, 4, 1, 1), 0.1)
    stage = odeify.ODEStage(
        "normed", torch.fx.symbolic_trace(_NormedBranch()), [Slot("w", "param")], {"w": knots}, "pre", 2
    )
    stage.configure(integrator="alf" if mode == "reversible" else "heun", backward=mode)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    with pytest.raises(ConfigError, match=r"holds BatchNorm '\S*norm' in training mode.*\.eval\(\)"):
        stage(x)
    stage.eval()
    before = copy.deepcopy(stage.state_dict())
    stage(x).sum().backward()
    assert x.grad is not None
    assert all(torch.equal(v, before[k]) for k, v in stage.state_dict().items() if "running" in k)
