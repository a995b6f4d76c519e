"""Integrators: convergence orders of every tableau, and single steps against torchdiffeq.

The orders are measured on layer1 of the shipped digits ResNet (4 blocks, trained weights), converted
with the cubic basis in fp64, with its ReLUs swapped for SiLU. Why SiLU: with ReLU the field is only
Lipschitz in x, and every time an activation crosses zero inside a step the local error is O(h^2);
measured on the ReLU model, euler and heun keep orders 1 and 2 but kutta3 and rk4 fall to about 2
(rk4: 3.3e-4, 6.8e-5, 1.6e-5 at 32, 64, 128 steps). SiLU keeps the trained weights and makes the field
smooth in x; the cubic weight path is smooth in t between knots, so step counts are multiples of the
4 blocks (no step straddles a knot, nor the end of the last cubic piece at t = 3/4 where the path
starts to hold its end value). The reference is rk4 with 512 steps; step ranges sit in the asymptotic
regime and above round-off (errors 1e-2 .. 1e-9).

Single steps use the shipped model as it is (ReLU): a step is a fixed computation, smooth or not.
torchdiffeq calls the field with float times; they map back to exact times with
``Fraction(t).limit_denominator(10**6)`` (all times here have denominators <= 24).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
import torchdiffeq
from torch import nn

import odeify
from odeify.compiler.conversion import converted_stages
from odeify.models.digits import DEFAULT_MODEL_PATH, load_digits
from odeify.numerics.splitting import SPLITTINGS
from odeify.numerics.tableaus import KNOWN_INTEGRATORS, REVERSIBLE_SCHEMES, TABLEAUS, AsyncLeapfrog, Tableau

# steps per integrator: multiples of the stage depth (4) in the asymptotic range of each method
ORDER_STEPS = {
    "euler": (32, 64, 128),
    "midpoint": (16, 32, 64),
    "heun": (16, 32, 64),
    "ralston": (16, 32, 64),
    "kutta3": (16, 32, 64),
    "ssprk3": (16, 32, 64),
    "rk4": (32, 64, 128),
    "rk4_38": (32, 64, 128),
    "reversible_heun": (32, 64, 128),
    "alf": (32, 64, 128),
    "alf_field_start": (32, 64, 128),
}
INTEGRATORS = {**TABLEAUS, **REVERSIBLE_SCHEMES, "alf_field_start": AsyncLeapfrog("field")}
"""By name; ALF with v_0 = F(t_0, z_0) too, the start measured against the default v_0 = 0 (both
order 2; on this stage v_0 = 0 errs about 7x more at every step count: 4.4e-4 against 6.1e-5 at 128)."""
REFERENCE_STEPS = 512


pytestmark = pytest.mark.usefixtures("one_thread")


def stage_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the digits model feeds its layer1 run: the stem's output."""
    with torch.no_grad():
        return model.maxpool(model.act1(model.bn1(model.conv1(x))))


def make_layer1(act_layer: type[nn.Module] | None, basis: str) -> tuple[odeify.ODEStage, torch.Tensor]:
    """The digits model's layer1 stage (fp64) and its input for two test images."""
    kwargs = {"act_layer": act_layer} if act_layer is not None else {}
    model = odeify.load_model(DEFAULT_MODEL_PATH, **kwargs).double()
    converted = odeify.convert(model, basis=basis, input_size=(2, 1, 32, 32))
    stage = converted_stages(converted)[0].standalone()
    assert (stage.stage_name, stage.depth) == ("layer1", 4)
    x = load_digits("test")[0][:2].double()
    return stage, stage_input(model, x)


def integrate(stage: odeify.ODEStage, integrator, steps: int, x: torch.Tensor) -> torch.Tensor:
    stage.configure(integrator=integrator, steps=steps)
    with torch.no_grad():
        return stage(x)


# --- convergence orders --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smooth_stage():
    threads = torch.get_num_threads()  # module fixtures run before the autouse one
    torch.set_num_threads(1)
    try:
        stage, x = make_layer1(nn.SiLU, "cubic")
        reference = integrate(stage, "rk4", REFERENCE_STEPS, x)
    finally:
        torch.set_num_threads(threads)
    return stage, x, reference


def test_order_table_covers_every_integrator() -> None:
    """Every one-field integrator is measured here; splittings (split stages only) are their own kind.

    A splitting integrates a sum of sub-fields, so this one-field stage refuses it; its order is
    measured on a split stage in tests/test_split_stages.py, whose own table covers every splitting.
    """
    one_field = set(KNOWN_INTEGRATORS) - set(SPLITTINGS)
    assert set(SPLITTINGS) <= set(KNOWN_INTEGRATORS)
    assert set(ORDER_STEPS) == {*one_field, "alf_field_start"} == set(INTEGRATORS)
    assert all(n % 4 == 0 for steps in ORDER_STEPS.values() for n in steps)


@pytest.mark.parametrize("name", sorted(ORDER_STEPS))
def test_convergence_order(smooth_stage, name: str) -> None:
    stage, x, reference = smooth_stage
    integrator = INTEGRATORS[name]
    steps = ORDER_STEPS[name]
    errors = [
        ((integrate(stage, integrator, n, x) - reference).abs().max() / reference.abs().max()).item()
        for n in steps
    ]
    slope = -np.polyfit(np.log(steps), np.log(errors), 1)[0]
    assert abs(slope - integrator.order) <= 0.3, f"{name}: observed order {slope:.2f}, errors {errors}"
    assert errors[-1] > 1e-12  # above round-off: the fit measures truncation error


# --- single steps against torchdiffeq ------------------------------------------------------------------


def exact_time(t: torch.Tensor) -> tuple[Fraction, bool]:
    """An exact stage time for a float time; ``left`` when the float sits just below it (perturb=True)."""
    value = float(t)
    exact = Fraction(value).limit_denominator(10**6)
    return exact, value < float(exact)


def torchdiffeq_step(
    stage: odeify.ODEStage, method: str, steps: int, n: int, x: torch.Tensor, **options
) -> torch.Tensor:
    """Step n of ``steps`` by torchdiffeq's fixed-grid solver; the field is odeify's at exact times."""

    def field(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        time, left = exact_time(t)
        return stage.field(time, y, left=left)

    grid = torch.tensor([n / steps, (n + 1) / steps], dtype=torch.float64)
    with torch.no_grad():
        return torchdiffeq.odeint(field, x, grid, method=method, options=options)[-1]


def odeify_step(stage: odeify.ODEStage, integrator, steps: int, n: int, x: torch.Tensor) -> torch.Tensor:
    stage.configure(integrator=integrator, steps=steps)
    with torch.no_grad():
        return stage.run_graph(stage.step_graph(n), (x,))[0]


HEUN3 = Tableau.create("heun3", [[0, 0, 0], ["1/3", 0, 0], [0, "2/3", 0]], ["1/4", 0, "3/4"], order=3)
# odeify name or tableau -> torchdiffeq's fixed-grid method with the same tableau. torchdiffeq's "rk4"
# is the 3/8 rule (rk4_alt_step_func), i.e. odeify's rk4_38, not the classic rk4.
PAIRS = [("euler", "euler"), ("midpoint", "midpoint"), ("heun", "heun2"), ("rk4_38", "rk4"), (HEUN3, "heun3")]


@pytest.fixture(scope="module")
def relu_stages():
    """The shipped (ReLU) digits model's layer1 in fp64, per basis."""
    return {basis: make_layer1(None, basis) for basis in ("constant", "linear", "cubic")}


@pytest.mark.parametrize("basis", ["linear", "cubic"])
@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=[t for _, t in PAIRS])
def test_single_step_matches_torchdiffeq(relu_stages, basis: str, ours, theirs: str) -> None:
    stage, x = relu_stages[basis]
    for steps, n in ((4, 1), (6, 4)):  # on the knot grid, and across knots
        mine = odeify_step(stage, ours, steps, n, x)
        other = torchdiffeq_step(stage, theirs, steps, n, x)
        assert ((mine - other).abs().max() / other.abs().max()).item() <= 1e-10, (steps, n)


def test_torchdiffeq_rk4_is_the_three_eighths_rule(relu_stages) -> None:
    stage, x = relu_stages["cubic"]
    other = torchdiffeq_step(stage, "rk4", 6, 1, x)
    classic = odeify_step(stage, "rk4", 6, 1, x)
    three_eighths = odeify_step(stage, "rk4_38", 6, 1, x)
    assert (three_eighths - other).abs().max() <= 1e-10 * other.abs().max()
    assert (classic - other).abs().max() > 1e-8 * other.abs().max()


def test_left_limit_matters_only_for_constant_basis_at_knots(relu_stages) -> None:
    """theta(t-) differs from theta(t) only where a piecewise-constant path jumps: t = k/L, 0 < k < L."""
    for basis, (stage, x) in relu_stages.items():
        for t in [Fraction(k, 8) for k in range(9)] + [Fraction(1, 3), Fraction(5, 7)]:
            right = stage.field(t, x)
            left = stage.field(t, x, left=True)
            jumps = basis == "constant" and (t * stage.depth).denominator == 1 and 0 < t < 1
            assert torch.equal(left, right) != jumps, (basis, t)


def test_step_ends_take_the_left_limit(relu_stages) -> None:
    """A stage at c = 1 reads theta(t_{n+1}-): torchdiffeq agrees when its end time is nudged below.

    With a constant basis and steps on the knots, torchdiffeq's plain rk4 evaluates its last stage with
    the next block's weights; with ``perturb=True`` it evaluates just before t_{n+1}, i.e. the left
    limit, and matches odeify's rk4_38 step (its first stage is nudged just after t_n: the right limit).
    """
    stage, x = relu_stages["constant"]
    mine = odeify_step(stage, "rk4_38", 4, 1, x)
    plain = torchdiffeq_step(stage, "rk4", 4, 1, x)
    perturbed = torchdiffeq_step(stage, "rk4", 4, 1, x, perturb=True)
    scale = mine.abs().max()
    assert (mine - perturbed).abs().max() <= 1e-10 * scale
    assert (mine - plain).abs().max() > 1e-6 * scale
    stage, x = relu_stages["cubic"]  # a continuous path: the convention does not matter
    mine = odeify_step(stage, "rk4_38", 4, 1, x)
    for options in ({}, {"perturb": True}):
        assert (mine - torchdiffeq_step(stage, "rk4", 4, 1, x, **options)).abs().max() <= 1e-10 * scale


# --- a user tableau against a hand-written Runge-Kutta loop ---------------------------------------------


def hand_rk(stage: odeify.ODEStage, tableau: Tableau, steps: int, x: torch.Tensor, left_at_end: bool = True):
    """The textbook explicit RK loop over odeify's field at exact times."""
    h = Fraction(1, steps)
    with torch.no_grad():
        for n in range(steps):
            ks = []
            for i in range(tableau.stages):
                y = x + sum(
                    (float(h * a) * k for a, k in zip(tableau.a[i][:i], ks, strict=True)), torch.zeros_like(x)
                )
                t = (n + tableau.c[i]) * h
                ks.append(stage.field(t, y, left=left_at_end and tableau.c[i] == 1))
            x = x + sum((float(h * b) * k for b, k in zip(tableau.b, ks, strict=True)), torch.zeros_like(x))
    return x


# three stages, the last one at the step's end (c = 1), order 2
MINE = Tableau.create("mine", [[0, 0, 0], ["1/2", 0, 0], [0, 1, 0]], ["1/6", "2/3", "1/6"], order=2)


@pytest.mark.parametrize("basis", ["constant", "linear", "cubic"])
@pytest.mark.parametrize("tableau", [MINE, HEUN3], ids=["mine", "heun3"])
def test_user_tableau_matches_hand_written_loop(relu_stages, basis: str, tableau: Tableau) -> None:
    stage, x = relu_stages[basis]
    for steps in (4, 6):
        ours = integrate(stage, tableau, steps, x)
        theirs = hand_rk(stage, tableau, steps, x)
        assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-12, steps
    if basis == "constant" and 1 in tableau.c:  # a right limit at c = 1 would read the next block
        right = hand_rk(stage, tableau, 4, x, left_at_end=False)
        assert not torch.allclose(integrate(stage, tableau, 4, x), right, rtol=1e-6, atol=0)


def test_user_tableau_order(smooth_stage) -> None:
    """A user tableau runs through the same path as the built-ins, at its own order."""
    stage, x, reference = smooth_stage
    steps = (16, 32, 64)
    errors = [((integrate(stage, HEUN3, n, x) - reference).abs().max()).item() for n in steps]
    slope = -np.polyfit(np.log(steps), np.log(errors), 1)[0]
    assert abs(slope - 3) <= 0.3, (slope, errors)
