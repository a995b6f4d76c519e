"""Swin's stages as split stages: period 4 (unshifted attention, MLP, shifted attention, MLP).

A small Swin (swin_tiny_patch4_window7_224's blocks at embed_dim 24, depths (4, 2), 56x56 inputs:
a 14x14 map in 7x7 windows, shifted by 3, then a 7x7 map its window covers, which never shifts)
keeps the module to seconds. Stage 1 is 2 periods of 4 half-blocks; stage 2, unshifted, 2 periods
of 2. Between the halves Swin reshapes its (B, H, W, C) map to tokens (B, H*W, C) and back: the
stage state is the map, and each MLP sub-field holds that glue (F(x) = back(mlp(norm(to_tokens(x))))).

Oracles: eager timm (native Lie-Trotter is the network), an eager re-implementation of each scheme
from timm's own block modules (Lie-Trotter at 2x the native steps, Strang at 3), and backprop's
gradients for the memory-saving backward modes. Float64 throughout; figures measured on the CPU
(2 shared cores, one torch thread).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from precision import rel
from torch import nn

import odeify
from odeify.core.errors import ConfigError, FallbackWarning
from odeify.runtime.split_stage import SplitStage

pytestmark = pytest.mark.usefixtures("one_thread")

SWIN = "swin_tiny_patch4_window7_224"
SMALL = {"img_size": 56, "embed_dim": 24, "depths": (4, 2), "num_heads": (1, 2)}
INPUT = (2, 3, 56, 56)
NATIVE_TOLERANCE = 1e-12  # measured: 0 (native Lie-Trotter runs the blocks' own code, glue included)
SCHEME_TOLERANCE = 1e-12  # measured: 0 against the eager schemes below (Lie-Trotter at 4, Strang at 3)
GRADIENT_TOLERANCE = 1e-10  # measured: 1.2e-16 for checkpoint and for reverse when it falls back
REVERSE_FACTOR = 10  # reverse's gradient error against its summed reconstruction errors: measured 0.36x


@pytest.fixture(scope="module")
def swin() -> nn.Module:
    from odeify.models._testing import make_test_model

    return make_test_model(SWIN, dtype=torch.float64, **SMALL).eval()


@pytest.fixture(scope="module")
def converted(swin):
    return odeify.convert(swin, input_size=INPUT)


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(INPUT, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _glue(template) -> list[str]:
    return [n.target for n in template.graph.nodes if n.name.startswith("glue_")]


def _rolls(template) -> int:
    return sum(n.target is torch.roll for n in template.graph.nodes)


def test_swin_stages_are_split_stages_of_period_4_and_2_exact_at_native(swin, converted, x) -> None:
    plan = odeify.analyze(swin, input_size=INPUT)
    runs = [("layers.0.blocks", 2, 4), ("layers.1.blocks", 2, 2)]  # (name, periods, period)
    assert [(r.name, r.length, r.period) for r in plan.runs] == runs
    stages = odeify.converted_stages(converted)
    assert all(isinstance(s, SplitStage) for s in stages)
    assert [(s.stage_name, s.depth, s.num_fields) for s in stages] == [
        ("layers.0.blocks", 2, 4),
        ("layers.1.blocks", 2, 2),
    ]
    assert converted.meta["odeify"]["not_lifted"] == {}
    shifted, unshifted = (s.field_templates for s in stages)
    # the MLP halves reshape the map to tokens and back; the attention halves see the map as it is
    assert [_glue(t) for t in shifted] == [[], ["reshape", "reshape"], [], ["reshape", "reshape"]]
    assert [_glue(t) for t in unshifted] == [[], ["reshape", "reshape"]]
    # the window shift (a roll there and back) belongs to the third sub-field, the shifted attention
    assert [_rolls(t) for t in shifted] == [0, 0, 2, 0]
    assert [_rolls(t) for t in unshifted] == [0, 0]
    with torch.no_grad():
        assert rel(converted(x), swin(x)) <= NATIVE_TOLERANCE


# --- the schemes, against an eager re-implementation from timm's blocks ------------------------------


def _halves(block: nn.Module):
    """timm's two residual branches of one Swin block on the (B, H, W, C) map, the MLP's through tokens."""

    def mlp(y: torch.Tensor) -> torch.Tensor:
        B, H, W, C = y.shape
        return block.drop_path2(block.mlp(block.norm2(y.reshape(B, -1, C)))).reshape(B, H, W, C)

    return (lambda y: block.drop_path1(block._attn(block.norm1(y))), mlp)


def _eager_stage(blocks: list[nn.Module], y: torch.Tensor, substeps, steps: int) -> torch.Tensor:
    """A scheme over one Swin stage: sub-field i of period k is half i % 2 of block k * q + i // 2.

    q = 2 Swin blocks per period where the windows shift (period 4 in halves), else 1 (period 2).
    ``substeps`` lists (field, start, length, midpoint) in fractions of a step; weights are
    piecewise constant (one knot per period), a time on a cell's upper end reads the cell below it.
    """
    q = 2 if any(blocks[1].shift_size) else 1
    depth = len(blocks) // q

    def field(i: int, t: Fraction, y: torch.Tensor) -> torch.Tensor:
        cell = min(math.floor(t * depth), depth - 1)
        return depth * _halves(blocks[cell * q + i // 2])[i % 2](y)

    h = Fraction(1, steps)
    for n in range(steps):
        for i, start, length, midpoint in substeps(2 * q):
            a, span = (n + start) * h, length * h
            if midpoint:
                k1 = field(i, a, y)
                y = y + float(span) * field(i, a + span / 2, y + float(span / 2) * k1)
            else:
                y = y + float(span) * field(i, a, y)
    return y


def _eager_scheme(swin: nn.Module, x: torch.Tensor, substeps, steps: int) -> torch.Tensor:
    y = swin.patch_embed(x)
    for layer in swin.layers:
        y = _eager_stage(list(layer.blocks), layer.downsample(y), substeps, steps)
    return swin.forward_head(swin.norm(y))


def _lie_trotter(fields: int):
    return [(i, 0, 1, False) for i in range(fields)]


def _strang(fields: int):
    half = Fraction(1, 2)
    first = [(i, 0, half, True) for i in range(fields - 1)]
    return [*first, (fields - 1, 0, 1, True), *[(i, half, half, True) for i in reversed(range(fields - 1))]]


def test_native_lie_trotter_is_the_eager_scheme(swin, converted, x) -> None:
    """The oracle itself: at native steps the eager scheme is timm's forward."""
    with torch.no_grad():
        assert rel(_eager_scheme(swin, x, _lie_trotter, 2), swin(x)) <= NATIVE_TOLERANCE


@pytest.mark.parametrize(("integrator", "steps"), [("lie_trotter", 4), ("strang", 3)])
def test_other_step_counts_are_the_eager_scheme(swin, converted, x, integrator, steps) -> None:
    """Strang at 3 steps straddles the 2 knots, so each sub-field's clock picks its cell."""
    model = odeify.retarget(converted, integrator=integrator, steps=steps)
    substeps = {"lie_trotter": _lie_trotter, "strang": _strang}[integrator]
    with torch.no_grad():
        got = model(x)
        assert rel(got, _eager_scheme(swin, x, substeps, steps)) <= SCHEME_TOLERANCE
        assert rel(got, swin(x)) > 1e-3  # not the native network: the scheme changed it


# --- backward modes, code, refusals --------------------------------------------------------------------


def _gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    x = x.clone().requires_grad_(True)
    out = model(x)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"input": x.grad, **grads}


@pytest.fixture(scope="module")
def strang_gradients(converted, x) -> dict[str, torch.Tensor]:
    """Backprop's gradients through Strang at 3 steps (one image)."""
    return _gradients(odeify.retarget(converted, integrator="strang", steps=3), x[:1])


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max(rel(got[k], want[k]) for k in want)


def test_checkpoint_gradients_equal_backprop(converted, x, strang_gradients) -> None:
    model = odeify.retarget(converted, integrator="strang", steps=3, backward="checkpoint")
    assert _worst(_gradients(model, x[:1]), strang_gradients) <= GRADIENT_TOLERANCE


def test_reverse_steps_back_within_its_reconstruction_error(converted, x, strang_gradients) -> None:
    """``reverse`` runs the split steps backward: approximate by design, within 10x what it reports.

    Measured: the shifted stage steps back (reconstruction errors summing to 3.0e-5), the unshifted
    one (error 2.8e-3 > 1e-3) falls back to checkpointing; the gradients are 1.1e-5 off (0.36x).
    """
    model = odeify.retarget(converted, integrator="strang", steps=3, backward="reverse")
    with pytest.warns(FallbackWarning):
        got = _gradients(model, x[:1])
    stepped_back = [s for s in odeify.converted_stages(model) if not s.adjoint_stats.fallbacks]
    assert [s.stage_name for s in stepped_back] == ["layers.0.blocks"]
    reported = sum(sum(s.adjoint_stats.last_errors) for s in stepped_back)
    assert 0 < _worst(got, strang_gradients) <= REVERSE_FACTOR * reported


def test_reverse_falling_back_is_exact(converted, x, strang_gradients) -> None:
    """With no reconstruction error accepted, every stage falls back: backprop's gradients (1.2e-16)."""
    model = odeify.retarget(converted, integrator="strang", steps=3, backward="reverse")
    for stage in odeify.converted_stages(model):
        stage.reverse_tolerance = 0.0
    with pytest.warns(FallbackWarning):
        got = _gradients(model, x[:1])
    assert all(s.adjoint_stats.fallbacks for s in odeify.converted_stages(model))
    assert _worst(got, strang_gradients) <= GRADIENT_TOLERANCE


def test_reversible_is_refused_with_the_working_alternative(converted) -> None:
    with pytest.raises(ConfigError, match="integrator='alf'.*backward='checkpoint'"):
        odeify.retarget(converted, backward="reversible")


@pytest.mark.parametrize(("integrator", "steps"), [("alf", "x2"), ("strang_reversible_heun", 3)])
def test_reversible_gradients_equal_backprop(converted, x, integrator, steps) -> None:
    """Period 4 with glue inside the sub-fields: every state rebuilt bit for bit, backprop's gradients.
    Measured: 4.2e-13 (Lie-Trotter ALF, 5 registers: z and one velocity per sub-field), 6.1e-13."""
    want = _gradients(odeify.retarget(converted, integrator=integrator, steps=steps), x[:1])
    model = odeify.retarget(converted, integrator=integrator, steps=steps, backward="reversible")
    got = _gradients(model, x[:1])
    stages = odeify.converted_stages(model)
    registers = [r.name for r in stages[0].reversible_scheme().registers]
    assert registers == (["z", "p1", "p2", "p3", "p4"] if integrator == "alf" else ["y", "z"])
    assert all(s.adjoint_stats.worst_error == 0 and s.adjoint_stats.backward_passes == 1 for s in stages)
    assert _worst(got, want) <= GRADIENT_TOLERANCE


def test_reversible_refuses_glue_that_draws_random_numbers(converted) -> None:
    """A dropout in the glue between sub-blocks: reversible is refused, naming checkpoint."""
    model = odeify.retarget(converted, integrator="alf", steps="x2")
    stage = odeify.converted_stages(model)[0].standalone()
    template = stage.field_templates[1]
    glue = next(n for n in template.graph.nodes if n.name.startswith("glue_"))
    with template.graph.inserting_after(glue):
        dropped = template.graph.call_function(F.dropout, (glue,), {"p": 0.1}, name="glue_dropout")
    glue.replace_all_uses_with(dropped, delete_user_cb=lambda user: user is not dropped)
    template.recompile()
    with pytest.raises(ConfigError, match="glue 'glue_dropout'.*backward='checkpoint'"):
        stage.configure(backward="reversible")


def test_the_code_shows_the_split_steps_and_the_glue(converted) -> None:
    code = odeify.model_code(odeify.retarget(converted, integrator="strang", steps=3))
    # Strang over 4 sub-fields: F1 F2 F3 halves, F4 whole, F3 F2 F1 halves; states named between them
    for k, field in enumerate([1, 2, 3, 4, 3, 2], start=1):
        assert f"layers_0_blocks_x0_{k}_F{field} =" in code, (k, field)
    assert "layers_0_blocks_x1 =" in code and "layers_0_blocks_x3 =" in code
    # the MLP sub-fields reshape the state to tokens and back, the shifted attention rolls it
    assert "layers_0_blocks_glue_reshape_2_s0_2_F2_1 = layers_0_blocks_x0_1_F1.reshape(" in code
    assert "layers_0_blocks_roll_1_s0_3_F3_1 = torch.roll(" in code


# --- the glue rules, on a model of Swin's pattern in miniature ------------------------------------------


class TokenPair(nn.Module):
    """``x + f(x)`` on (B, H, W, C), then ``x + g(x)`` on the tokens (B, H*W, C), reshaped back;
    ``twist`` transposes H and W at the end (a layout the next pair does not undo).

    Unlike Swin's MLP (token by token, so the same on the map), ``g`` normalises over all tokens:
    a sub-field that did not reshape the state to tokens would compute something else.
    """

    def __init__(self, c: int, twist: bool = False) -> None:
        super().__init__()
        self.f, self.g, self.twist = nn.Linear(c, c), nn.Linear(c, c), twist

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        x = x + F.gelu(self.f(x))
        x = x.reshape(B, -1, C)
        x = x + torch.softmax(self.g(x), dim=1)
        x = x.reshape(B, H, W, C)
        return x.transpose(1, 2) if self.twist else x


class TokenNet(nn.Module):
    def __init__(self, pairs: int, twist: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(*(TokenPair(8, twist) for _ in range(pairs)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x).permute(0, 2, 3, 1)).mean((1, 2))


def _token_net(twist: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return TokenNet(3, twist).double().eval()


def test_glue_that_returns_the_state_to_its_layout_lifts_exactly(image) -> None:
    model = _token_net()
    converted = odeify.convert(model, input_size=(2, 3, 6, 6))
    (stage,) = odeify.converted_stages(converted)
    assert (stage.depth, stage.num_fields) == (3, 2)
    x = image((2, 3, 6, 6), dtype=torch.float64)
    with torch.no_grad():
        assert rel(converted(x), model(x)) <= NATIVE_TOLERANCE  # measured: 0


def test_glue_that_changes_the_layout_is_refused_and_stays_exact(image) -> None:
    """Each pair transposes its map: no sub-field maps the state to a same-shape update of it."""
    model = _token_net(twist=True)
    converted = odeify.convert(model, input_size=(2, 3, 6, 6))
    assert odeify.converted_stages(converted) == []
    (why,) = converted.meta["odeify"]["not_lifted"].values()
    assert "does not bring the state back to its layout" in why
    x = image((2, 3, 6, 6), dtype=torch.float64)
    with torch.no_grad():
        assert rel(converted(x), model(x)) <= NATIVE_TOLERANCE


def test_fine_tuning_default_keeps_checkpointing_where_reversible_keeps_more(converted) -> None:
    """A Swin whose first stage has two blocks converts to one-block stages, which keep their input
    under reversible as under checkpointing, at more time (swin_tiny: 89 MiB against 86 at 1.57x
    against 1.36x timm plain, results/train_step_transformers.md): with nothing asked for it trains
    with checkpoint. The small Swin above (stages of two periods) trains reversible, as a ViT does."""
    from odeify.models._testing import make_test_model
    from odeify.train.manifestations import for_training

    modes = {(s.integrator.name, s.backward) for s in odeify.converted_stages(for_training(converted))}
    assert modes == {("lie_trotter_alf", "reversible")}
    shallow = make_test_model(SWIN, **{**SMALL, "depths": (2, 2)}).eval()
    native = odeify.convert(shallow, input_size=(1, 3, 56, 56))
    stages = odeify.converted_stages(for_training(native))
    assert any(s.depth == 1 for s in stages)
    assert {s.backward for s in stages} == {"checkpoint"}
