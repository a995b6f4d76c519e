"""Split stages: a ViT's 12 blocks as one stage dx/dt = F_attn + F_mlp, integrated by splitting.

Oracles: eager timm (native Lie-Trotter is the network), an eager re-implementation of each
scheme from timm's own block modules (Lie-Trotter at 24 steps, Strang at 6), and backprop's
gradients for the memory-saving backward modes. Float64 throughout; every measured error below
is on the CPU (2 cores, torch 2.x).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from precision import rel

import odeify
from odeify.core.errors import ConfigError, FallbackWarning
from odeify.runtime.split_stage import SplitStage

VIT = "vit_tiny_patch16_224"
INPUT = (2, 3, 64, 64)
NATIVE_TOLERANCE = 1e-12  # measured: 0 (native Lie-Trotter runs the blocks' own code)
SCHEME_TOLERANCE = 1e-12  # measured: <= 3e-16 against the eager schemes below
GRADIENT_TOLERANCE = 1e-10  # measured: 0 for checkpoint and reverse (which falls back to checkpointing)


@pytest.fixture(scope="module")
def vit() -> torch.nn.Module:
    from odeify.models._testing import make_test_model

    return make_test_model(VIT, dtype=torch.float64, img_size=64).eval()


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


def test_vit_is_one_split_stage_of_12_periods_exact_at_native(vit, converted, x) -> None:
    stage = _stage(converted)
    assert (stage.stage_name, stage.depth, stage.num_fields, stage.num_knots) == ("blocks", 12, 2, 12)
    assert stage.integrator.name == "lie_trotter" and stage.steps == 12
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


def test_lie_trotter_at_24_steps_is_the_eager_scheme(vit, converted, x) -> None:
    model = odeify.retarget(converted, integrator="lie_trotter", steps=24)
    want = _eager_scheme(vit, x, [(0, 0, 1, False), (1, 0, 1, False)], 24)
    with torch.no_grad():
        got = model(x)
        assert rel(got, want) <= SCHEME_TOLERANCE
        assert rel(got, vit(x)) > 1e-3  # not the native network: the scheme changed something


def test_strang_at_6_steps_is_the_eager_scheme(vit, converted, x) -> None:
    half = Fraction(1, 2)
    model = odeify.retarget(converted, integrator="strang", steps=6)
    substeps = [(0, 0, half, True), (1, 0, 1, True), (0, half, half, True)]
    with torch.no_grad():
        assert rel(model(x), _eager_scheme(vit, x, substeps, 6)) <= SCHEME_TOLERANCE


def test_the_code_shows_the_split_steps(converted) -> None:
    code = odeify.model_code(odeify.retarget(converted, integrator="strang", steps=6))
    # step 0: half F1, full F2 (naming the states between), then the second half of F1 ends at x1
    for state in ("blocks_x0_1_F1 =", "blocks_x0_2_F2 =", "blocks_x1 =", "blocks_x6 ="):
        assert state in code, state
    assert "blocks_field_templates_0_attn" in code or "attn_qkv" in code  # F1 is the attention


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
    [("lie_trotter", 24, ("checkpoint", "reverse")), ("strang", 6, ("checkpoint",))],
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


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_reverse_steps_rebuild_the_state_with_more_steps(converted, x) -> None:
    """A split step run backward undoes the forward step to O(h^2): the error shrinks ~4x per 2x steps."""
    tokens = torch.randn(2, 17, 192, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.1
    errors = []
    for steps in (48, 96):
        stage = _stage(odeify.retarget(converted, integrator="strang", steps=steps)).standalone()
        with torch.no_grad():
            end = stage.run_graph(stage.step_graph(0), (tokens,))
            (back,) = stage.run_graph(stage.step_graph(0, "reverse"), tuple(end))
        errors.append(rel(back, tokens))
    assert errors[1] < errors[0] / 3, errors


def test_save_and_load_round_trip(converted, x, tmp_path) -> None:
    model = odeify.retarget(converted, integrator="strang", steps=6, knots=4, basis="linear")
    path = tmp_path / "vit.safetensors"
    odeify.save(model, path)
    loaded = odeify.load(path)
    stage = _stage(loaded)
    assert (stage.integrator.name, stage.steps, stage.num_knots, stage.basis) == ("strang", 6, 4, "linear")
    with torch.no_grad():
        assert rel(loaded(x), model(x)) == 0  # measured: bit for bit


def test_refusals_name_the_working_alternative(converted, test_model) -> None:
    with pytest.raises(ConfigError, match="backward='checkpoint'"):
        odeify.retarget(converted, backward="reversible")
    with pytest.raises(ConfigError, match="summed field.*lie_trotter"):
        odeify.retarget(converted, integrator="rk4")
    resnet = odeify.convert(test_model("resnet18"), input_size=(1, 3, 32, 32))
    with pytest.raises(ConfigError, match="splits a stage's field"):
        odeify.retarget(resnet, integrator="strang")
