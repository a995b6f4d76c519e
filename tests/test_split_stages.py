"""Split stages: a ViT's blocks as one stage dx/dt = F_attn + F_mlp, integrated by splitting.

A small ViT (vit_tiny_patch16_224's blocks at depth 4, width 64, 2 heads, 32x32 inputs: 5 tokens)
keeps the module to seconds; the full vit_tiny's 12 periods and native exactness are in
tests/test_families.py. Oracles: eager timm (native Lie-Trotter is the network), an eager
re-implementation of each scheme from timm's own block modules (Lie-Trotter at 2x the native
steps, Strang at 3, across knots), classical RK4 on the summed field for the splittings' orders, and
backprop's gradients for the memory-saving backward modes. Float64 throughout; every measured
figure below is on the CPU (2 shared cores, one torch thread).
"""

from __future__ import annotations

import copy
import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from precision import rel

import odeify
from odeify.core.errors import ConfigError, FallbackWarning
from odeify.numerics.splitting import SPLITTINGS
from odeify.runtime.split_stage import SplitStage

VIT = "vit_tiny_patch16_224"
SMALL = {"img_size": 32, "depth": 4, "embed_dim": 64, "num_heads": 2}
DEPTH = 4
INPUT = (2, 3, 32, 32)
TOKENS = (2, 5, 64)  # 4 patches and the class token
NATIVE_TOLERANCE = 1e-12  # measured: 0 (native Lie-Trotter runs the blocks' own code)
SCHEME_TOLERANCE = 1e-12  # measured: 0 against the eager schemes below
GRADIENT_TOLERANCE = 1e-10  # measured: <= 1.3e-17 for checkpoint, reverse (falls back to checkpointing)


@pytest.fixture(scope="module")
def vit(one_thread) -> torch.nn.Module:
    from odeify.models._testing import make_test_model

    return make_test_model(VIT, dtype=torch.float64, **SMALL).eval()


@pytest.fixture(scope="module")
def converted(vit):
    return odeify.convert(vit, input_size=INPUT)


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(INPUT, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _stage(model) -> SplitStage:
    (stage,) = odeify.converted_stages(model)
    assert isinstance(stage, SplitStage)
    return stage


def test_vit_is_one_split_stage_of_4_periods_exact_at_native(vit, converted, x) -> None:
    stage = _stage(converted)
    assert (stage.stage_name, stage.depth, stage.num_fields, stage.num_knots) == ("blocks", DEPTH, 2, DEPTH)
    assert stage.integrator.name == "lie_trotter" and stage.steps == DEPTH
    with torch.no_grad():
        assert rel(converted(x), vit(x)) <= NATIVE_TOLERANCE


def _branches(block):
    """timm's two residual branches of one ViT block, f_attn and f_mlp."""
    return (
        lambda y: block.drop_path1(block.ls1(block.attn(block.norm1(y)))),
        lambda y: block.drop_path2(block.ls2(block.mlp(block.norm2(y)))),
    )


def _eager_scheme(vit, x, substeps, steps: int) -> torch.Tensor:
    """The scheme run eagerly on timm's blocks: F_i(t, y) = L f_i^{block(t)}(y), constant weight path.

    ``substeps`` lists (field, start, length) in fractions of a step, run by the explicit midpoint
    rule (``midpoint=True``) or Euler; a time on a sub-interval's upper end reads the cell below it.
    """
    blocks = list(vit.blocks)
    depth = len(blocks)

    def field(i: int, t: Fraction, top: bool, y: torch.Tensor) -> torch.Tensor:
        cell = min(math.floor(t * depth) - (1 if top and (t * depth).denominator == 1 else 0), depth - 1)
        return depth * _branches(blocks[cell])[i](y)

    tokens = vit.norm_pre(vit._pos_embed(vit.patch_embed(x)))
    h = Fraction(1, steps)
    for n in range(steps):
        for i, start, length, midpoint in substeps:
            a, span = (n + start) * h, length * h
            if midpoint:
                k1 = field(i, a, False, tokens)
                tokens = tokens + float(span) * field(i, a + span / 2, False, tokens + float(span / 2) * k1)
            else:
                tokens = tokens + float(span) * field(i, a, False, tokens)
    return vit.forward_head(vit.norm(tokens))


def test_lie_trotter_at_twice_the_steps_is_the_eager_scheme(vit, converted, x) -> None:
    model = odeify.retarget(converted, integrator="lie_trotter", steps=2 * DEPTH)
    want = _eager_scheme(vit, x, [(0, 0, 1, False), (1, 0, 1, False)], 2 * DEPTH)
    with torch.no_grad():
        got = model(x)
        assert rel(got, want) <= SCHEME_TOLERANCE
        assert rel(got, vit(x)) > 1e-3  # measured 0.22: not the native network, the scheme changed it


def test_strang_at_3_steps_is_the_eager_scheme(vit, converted, x) -> None:
    """3 steps on 4 cells: sub-steps straddle knots, so each sub-field's clock picks its cell."""
    half = Fraction(1, 2)
    model = odeify.retarget(converted, integrator="strang", steps=3)
    substeps = [(0, 0, half, True), (1, 0, 1, True), (0, half, half, True)]
    with torch.no_grad():
        assert rel(model(x), _eager_scheme(vit, x, substeps, 3)) <= SCHEME_TOLERANCE


# --- orders of the splittings ----------------------------------------------------------------------

ORDER_STEPS = {name: (4, 8, 16) for name in SPLITTINGS}
"""Step counts per splitting, in the asymptotic range; errors against RK4 on the summed field.

Measured (ratio of errors per doubling of steps, 4 -> 8 -> 16): lie_trotter 2.15, 2.07 (order 1);
strang 4.003, 4.001 (order 2); errors 1.4e-2 .. 3.1e-3 and 1.5e-3 .. 9.5e-5 of the state.
strang_alf 3.9994, 3.9996 and strang_reversible_heun 3.9985, 3.9994 (order 2). Lie-Trotter with
reversible sub-steps is first order (the splitting's commutator term) with a small first-order
term: lie_trotter_alf 3.98, 3.93 (3.75 to 32 steps), lie_trotter_reversible_heun 3.99, 3.98 (3.92),
errors 1.7e-3 .. 1.1e-4 and 3.3e-3 .. 2.1e-4, so at these steps it is at least first order."""
ORDER_TOLERANCE = 0.15  # on the fitted slope; measured: lie_trotter 1.07, strang 2.00
PRE_ASYMPTOTIC = ("lie_trotter_alf", "lie_trotter_reversible_heun")  # measured slopes 1.98, 1.99
REFERENCE_STEPS = 32  # measured: RK4 at 32 is 9.6e-10 from RK4 at 64, 1e-5 of the smallest error above


def test_order_table_covers_every_splitting() -> None:
    assert set(ORDER_STEPS) == set(SPLITTINGS)


@pytest.fixture(scope="module")
def smooth_stage(converted):
    """The stage with 2 linear knots (one smooth weight path over [0, 1]), its input, and the reference.

    The path is smooth in t and the blocks (LayerNorm, softmax, GELU) are smooth in x, so the
    splittings reach their orders; the time dependence makes each sub-field's clock matter. The
    reference is classical RK4 on the summed field F_attn + F_mlp (no splitting involved).
    """
    (stage,) = odeify.converted_stages(odeify.retarget(converted, knots=2, basis="linear"))
    stage = stage.standalone()
    tokens = torch.randn(1, *TOKENS[1:], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return stage, tokens, _rk4_on_the_summed_field(stage, tokens, REFERENCE_STEPS)


@torch.no_grad()
def _rk4_on_the_summed_field(stage: SplitStage, y: torch.Tensor, steps: int) -> torch.Tensor:
    h = Fraction(1, steps)
    for n in range(steps):
        t = n * h
        k1 = stage.field(t, y)
        k2 = stage.field(t + h / 2, y + float(h / 2) * k1)
        k3 = stage.field(t + h / 2, y + float(h / 2) * k2)
        k4 = stage.field(t + h, y + float(h) * k3, left=True)
        y = y + float(h / 6) * (k1 + 2 * k2 + 2 * k3 + k4)
    return y


@torch.no_grad()
def _run_steps(stage: SplitStage, integrator: str, steps: int, y: torch.Tensor) -> torch.Tensor:
    stage.configure(integrator=integrator, steps=steps)
    if SPLITTINGS[integrator].reversible:  # its step graphs take every register: run it whole
        return stage.run_graph(stage.unrolled_graph(), (y,))
    for n in range(steps):
        (y,) = stage.run_graph(stage.step_graph(n), (y,))
    return y


@pytest.mark.parametrize("name", sorted(ORDER_STEPS))
def test_splitting_order(smooth_stage, name: str) -> None:
    stage, tokens, reference = smooth_stage
    assert rel(reference, tokens) > 1e-2  # measured 3.4e-2: the flow moves the state
    steps = ORDER_STEPS[name]
    errors = [rel(_run_steps(stage, name, n, tokens), reference) for n in steps]
    slope = -np.polyfit(np.log(steps), np.log(errors), 1)[0]
    order = SPLITTINGS[name].order
    if name in PRE_ASYMPTOTIC:
        assert slope >= order - ORDER_TOLERANCE, f"{name}: order {slope:.2f}, {errors}"
    else:
        assert abs(slope - order) <= ORDER_TOLERANCE, f"{name}: order {slope:.2f}, {errors}"


def test_the_code_shows_the_split_steps(converted) -> None:
    code = odeify.model_code(odeify.retarget(converted, integrator="strang", steps=3))
    # step 0: half F1, full F2 (naming the states between), then the second half of F1 ends at x1
    for state in ("blocks_x0_1_F1 =", "blocks_x0_2_F2 =", "blocks_x1 =", "blocks_x3 ="):
        assert state in code, state
    assert "blocks_field_templates_0_attn" in code or "attn_qkv" in code  # F1 is the attention


def test_the_code_shows_the_reversible_sub_steps(converted) -> None:
    """ALF's split step: each sub-step moves z by its field's velocity register p<field>, evaluates
    that field once and reflects the register; the registers are named after each sub-step."""
    code = odeify.model_code(odeify.retarget(converted, integrator="strang_alf", steps=2 * DEPTH))
    for state in (
        "blocks_p1_0_1_F1 =",
        "blocks_z_0_1_F1 =",
        "blocks_p2_0_2_F2 =",
        "blocks_z_1 =",
        "blocks_p1_1 =",
    ):
        assert state in code, state
    assert "blocks_z_1_1_F1_part = blocks_z_1 + blocks_p1_1" in code  # the next step's predictor
    assert "blocks_F_s0_1_F1_1 =" in code and "blocks_F_s0_2_F2_1 =" in code  # one evaluation a sub-step


def _gradients(model, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    x = x.clone().requires_grad_(True)
    out = model(x)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"input": x.grad, **grads}


@pytest.mark.parametrize(
    ("integrator", "steps", "modes"),
    [("lie_trotter", 2 * DEPTH, ("checkpoint", "reverse")), ("strang", 3, ("checkpoint",))],
)
def test_memory_saving_gradients_equal_backprop(converted, x, integrator, steps, modes) -> None:
    """At these steps reverse cannot rebuild the random ViT's states and falls back to checkpointing."""
    x = x[:1]
    want = _gradients(odeify.retarget(converted, integrator=integrator, steps=steps), x)
    for mode in modes:
        model = odeify.retarget(converted, integrator=integrator, steps=steps, backward=mode)
        with pytest.warns(FallbackWarning) if mode == "reverse" else _no_warning():
            got = _gradients(model, x)
        assert set(got) == set(want)
        worst = max(rel(got[k], want[k]) for k in want)
        assert worst <= GRADIENT_TOLERANCE, (mode, worst)


REVERSIBLE = [("alf", "native"), ("reversible_heun", 3), ("strang_alf", "x2"), ("strang_reversible_heun", 3)]
"""Each reversible splitting (alf, reversible_heun: Lie-Trotter) at steps that put evaluations
inside blocks, on their ends and across knots."""


@pytest.mark.parametrize(("integrator", "steps"), REVERSIBLE)
def test_reversible_gradients_equal_backprop(converted, x, integrator, steps) -> None:
    """The lattice rebuilds every state exactly (no fallback) and the gradients are backprop's.
    Measured (float64): 4.0e-12 .. 6.4e-12."""
    want = _gradients(odeify.retarget(converted, integrator=integrator, steps=steps), x)
    model = odeify.retarget(converted, integrator=integrator, steps=steps, backward="reversible")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        got = _gradients(model, x)
    stats = _stage(model).adjoint_stats
    assert (stats.backward_passes, stats.fallbacks, stats.worst_error) == (1, 0, 0.0)
    assert set(got) == set(want)
    worst = max(rel(got[k], want[k]) for k in want)
    assert worst <= GRADIENT_TOLERANCE, worst


FLOAT32_FACTOR = 2
"""float32 reversible's gradient error against float64 backprop, as a multiple of float32 backprop's
own in the same run. Measured with the 28-bit lattice: 1.04 (alf), 0.99 (reversible_heun), 1.08
(strang_alf), 1.13 (strang_reversible_heun), float32 backprop 1.1e-6 .. 1.3e-6 (with 26 bits:
1.32 .. 1.64, the lattice coarser than fp32 for a token's small values)."""


@pytest.mark.parametrize(("integrator", "steps"), REVERSIBLE)
def test_reversible_float32_gradients_are_as_close_as_backprops(converted, x, integrator, steps) -> None:
    backprop = odeify.retarget(converted, integrator=integrator, steps=steps)
    want = _gradients(backprop, x)
    single = _gradients(copy.deepcopy(backprop).float(), x.float())
    reversible = odeify.set_backward(copy.deepcopy(backprop), "reversible").float()
    got = _gradients(reversible, x.float())
    assert _stage(reversible).adjoint_stats.fallbacks == 0
    baseline = max(rel(single[k].double(), want[k]) for k in want)
    worst = max(rel(got[k].double(), want[k]) for k in want)
    assert 0 < baseline and worst <= FLOAT32_FACTOR * baseline, (worst, baseline)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_reverse_steps_rebuild_the_state_with_more_steps(converted, x) -> None:
    """A split step run backward undoes the forward step better as h shrinks.

    Measured: 5.1e-6 and 3.2e-7 of the state at 16 and 32 steps (16x per doubling); at least 8x is asked.
    """
    tokens = torch.randn(TOKENS, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.1
    errors = []
    for steps in (16, 32):
        stage = _stage(odeify.retarget(converted, integrator="strang", steps=steps)).standalone()
        with torch.no_grad():
            end = stage.run_graph(stage.step_graph(0), (tokens,))
            (back,) = stage.run_graph(stage.step_graph(0, "reverse"), tuple(end))
        errors.append(rel(back, tokens))
    assert errors[1] < errors[0] / 8, errors


def test_save_and_load_round_trip(vit, converted, x, tmp_path) -> None:
    """The small ViT's width and depth are kwargs a file may carry (issue 23): the file alone rebuilds it."""
    model = odeify.retarget(converted, integrator="strang", steps=3, knots=2, basis="linear")
    path = tmp_path / "vit.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot rebuild this model's source by name"
        odeify.save(model, path)
    loaded = odeify.load(path)
    stage = _stage(loaded)
    assert (stage.integrator.name, stage.steps, stage.num_knots, stage.basis) == ("strang", 3, 2, "linear")
    with torch.no_grad():
        assert rel(loaded(x), model(x)) == 0  # measured: bit for bit


def test_refusals_name_the_working_alternative(converted, test_model) -> None:
    with pytest.raises(ConfigError, match="integrator='alf'.*backward='checkpoint'"):
        odeify.retarget(converted, backward="reversible")
    with pytest.raises(ConfigError, match="integrator='strang_alf'"):
        odeify.retarget(converted, integrator="strang", backward="reversible")
    with pytest.raises(ConfigError, match="use backward='reversible'"):
        odeify.retarget(converted, integrator="strang_alf", steps="x2", backward="reverse")
    with pytest.raises(ConfigError, match="reversible integrator.*integrator=.alf."):
        odeify.retarget(converted, integrator="rk4", backward="reversible")
    with pytest.raises(ConfigError, match="t = 1/4 falls on a jump.*'strang_reversible_heun'"):
        odeify.retarget(converted, integrator="strang_alf", steps=DEPTH // 2, backward="reversible")
    with pytest.raises(ConfigError, match="summed field.*lie_trotter"):
        odeify.retarget(converted, integrator="rk4")
    resnet = odeify.convert(test_model("resnet18"), input_size=(1, 3, 32, 32))
    with pytest.raises(ConfigError, match="splits a stage's field"):
        odeify.retarget(resnet, integrator="strang")


@pytest.mark.parametrize("draw", [torch.randn_like, torch.nn.functional.dropout], ids=["randn", "dropout"])
def test_glue_that_draws_random_numbers_is_refused_under_reversible(converted, draw) -> None:
    """Glue between a sub-field's sub-blocks is re-run in backward without the sub-blocks' replay of
    their draws: under backward='reversible' a glue node that may draw random numbers is refused,
    naming checkpoint; the same stage without it is accepted (the oracle that the check can pass)."""
    stage = _stage(converted).standalone()
    stage.configure(integrator="alf", backward="reversible")  # accepted as converted
    stage.configure(backward="checkpoint")
    template = stage.field_templates[0]
    first = next(n for n in template.graph.nodes if n.op == "placeholder")
    with template.graph.inserting_after(first):
        template.graph.create_node("call_function", draw, (first,), name="glue_noise")
    template.recompile()
    with pytest.raises(ConfigError, match=r"F_1 holds glue 'glue_noise'.*backward='checkpoint'"):
        stage.configure(backward="reversible")
    stage.configure(backward="checkpoint")  # the working alternative stays open


# --- the full vit_tiny (issue 23's acceptance) -------------------------------------------------------

FULL_INPUT = (1, 3, 64, 64)  # vit_tiny_patch16_224 at img_size 64: 16 patches and the class token
REVERSE_FACTOR = 10  # reverse steps back: within 10x its reported reconstruction errors (test_families)


@pytest.fixture(scope="module")
def full_vit(one_thread):
    from odeify.models._testing import make_test_model

    vit = make_test_model(VIT, dtype=torch.float64, img_size=64).eval()
    return vit, odeify.convert(vit, input_size=FULL_INPUT)


@pytest.mark.parametrize(("integrator", "steps"), [("strang", 6), ("lie_trotter", 24)])
def test_full_vit_tiny_schemes_and_every_backward_mode(full_vit, integrator: str, steps: int) -> None:
    """vit_tiny's one stage of 12 periods at Strang 6 / Lie-Trotter 24: checkpoint's gradients equal
    backprop's to 1e-10; reverse's too where it falls back, else within 10x the reconstruction errors
    it reports; reversible is refused, naming checkpoint. Measured (AMD EPYC, 1 thread): the schemes
    are 1.09 / 0.47 from the native network; checkpoint 0; reverse cannot rebuild the random ViT's
    states (reconstruction errors 4.7e-2 / 5.3e-3, over 1e-3), falls back to checkpointing: 0."""
    vit, converted = full_vit
    (stage,) = odeify.converted_stages(converted)
    assert isinstance(stage, SplitStage) and stage.num_fields == 2
    x = torch.randn(FULL_INPUT, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    backprop = odeify.retarget(converted, integrator=integrator, steps=steps)
    with torch.no_grad():
        assert rel(backprop(x), vit(x)) > 1e-6  # the scheme at these steps is not the native network
    want = _gradients(backprop, x)
    for mode in ("checkpoint", "reverse"):
        model = odeify.retarget(converted, integrator=integrator, steps=steps, backward=mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            got = _gradients(model, x)
        worst = max(rel(got[k], want[k]) for k in want)
        (memory_free,) = odeify.converted_stages(model)
        stats = memory_free.adjoint_stats
        bound = GRADIENT_TOLERANCE
        if mode == "reverse" and not stats.fallbacks:
            bound = REVERSE_FACTOR * sum(stats.last_errors)
        assert worst <= bound, (mode, worst, bound)
    with pytest.raises(ConfigError, match="checkpoint"):
        odeify.retarget(converted, integrator=integrator, steps=steps, backward="reversible")


def test_fine_tuning_defaults_know_the_reversible_splittings(converted) -> None:
    """A splitting of ALF or reversible Heun sub-steps trains with backward='reversible' when no mode
    is asked for, and one of ALF sub-steps at ALF's peak learning rate, as the plain schemes do."""
    from odeify.numerics.splitting import SPLITTINGS
    from odeify.train.manifestations import memory_free_backward
    from odeify.train.recipe import ALF_LR, DEFAULT_LR, default_lr

    names = ("strang_alf", "strang_reversible_heun", "strang")
    modes = {name: memory_free_backward(converted, name) for name in names}
    assert modes == {
        "strang_alf": "reversible",
        "strang_reversible_heun": "reversible",
        "strang": "checkpoint",
    }
    assert default_lr([SPLITTINGS["lie_trotter_alf"]]) == ALF_LR
    assert default_lr([SPLITTINGS["strang_reversible_heun"]]) == DEFAULT_LR


def test_default_lr_knows_alf_by_its_class_not_its_name() -> None:
    """ALF's peak goes to ALF with either start (v_0 = F(t_0, z_0) is named 'alf_field_start', so a
    check of ``name == 'alf'`` would miss it) and to splittings of ALF sub-steps; nothing else gets it."""
    from odeify.numerics.schemes import AsyncLeapfrog
    from odeify.numerics.splitting import SPLITTINGS
    from odeify.numerics.tableaus import resolve_integrator
    from odeify.train.recipe import ALF_LR, DEFAULT_LR, default_lr

    assert AsyncLeapfrog("field").name == "alf_field_start"
    for alf in (resolve_integrator("alf"), AsyncLeapfrog("field"), SPLITTINGS["strang_alf"]):
        assert default_lr([alf]) == ALF_LR
        assert default_lr([resolve_integrator("euler"), alf]) == ALF_LR  # one ALF stage is enough
    for other in ("euler", "rk4", "reversible_heun", "strang", "lie_trotter_reversible_heun"):
        assert default_lr([resolve_integrator(other)]) == DEFAULT_LR
    assert default_lr([]) == DEFAULT_LR


def test_a_converted_vit_trains_exactly_and_memory_free_by_default(converted) -> None:
    """As converted (native Lie-Trotter: the network), a ViT is at its source's manifestation: nothing
    to calibrate, and fine-tuning with nothing asked for trains its reversible ALF splitting (vit_small:
    12 MiB saved against checkpoint's 35 at the same step time, results/train_step_transformers.md)."""
    from odeify.train.manifestations import at_source_manifestation, for_training

    assert at_source_manifestation(converted)
    trained = _stage(for_training(converted))
    assert (trained.integrator.name, trained.backward) == ("lie_trotter_alf", "reversible")
    with pytest.raises(ConfigError, match="nothing to fit"):
        odeify.calibrate(converted, torch.rand(4, 3, 32, 32, dtype=torch.float64), progress=False)
    half = odeify.retarget(converted, steps=DEPTH // 2)
    assert not at_source_manifestation(half)
