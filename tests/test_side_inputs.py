"""Blocks that read a value from outside themselves: a rotary ViT's position table, SAM's grid shape.

DINOv3 builds its rotary table once from the patch grid (``H, W`` of the patch embedding) and every
attention half reads it; before, the table's users in the other blocks made no attention half a
block, so no two found halves were neighbours and the model got one-block stages. Now the table is a
*constant input* of one deep stage (``stage(x, table)``), computed by the model at the input's size.
SAM's windowed blocks read ``B, H, W, C = x.shape`` of their input, which the reshapes after them
read too; its windowed and global blocks alternate with period 6 halves.

Oracles: the eager timm model in float64 (exact at native depth), float32 judged against float64,
and backprop's float64 gradients for the memory-saving modes.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from precision import as_float64, assert_as_accurate_as, rel
from torch import nn

import odeify
from odeify.compiler.conversion import converted_stages
from odeify.core.errors import ConfigError
from odeify.models._testing import make_test_model
from odeify.passes.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")

NATIVE_TOLERANCE = 1e-13  # float64, against eager timm; measured 0 (the blocks' own code at native depth)
GRADIENT_TOLERANCE = 1e-10  # float64, against backprop; measured 0 (checkpoint) and 4.5e-13 (ALF)
DINOV3 = {"img_size": 32, "depth": 3, "dynamic_img_size": True}
SAM = {
    "img_size": 32,
    "depth": 6,
    "global_attn_indexes": (2, 5),
    "window_size": 1,
    "embed_dim": 64,
    "num_heads": 2,
}


def _dinov3(dtype: torch.dtype = torch.float64) -> nn.Module:
    return make_test_model("vit_tiny_patch16_dinov3_qkvb", dtype=dtype, **DINOV3)


def _image(size: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size), dtype=dtype)


@pytest.fixture(scope="module")
def dinov3() -> tuple[nn.Module, fx.GraphModule]:
    model = _dinov3()
    return model, odeify.convert(model, input_size=(2, 3, 32, 32))


def test_rotary_vit_is_one_deep_stage_with_its_table_as_input(dinov3) -> None:
    model, converted = dinov3
    (stage,) = converted_stages(converted)
    assert (stage.depth, stage.num_fields, len(stage.inputs)) == (3, 2, 1)
    plan = odeify.analyze(model, input_size=(2, 3, 32, 32))
    assert len(plan.blocks) == 6, "every attention and MLP half is a block"


@pytest.mark.parametrize("size", [32, 48])
def test_rotary_vit_exact_at_native_depth_at_any_input_size(dinov3, size: int) -> None:
    """The table is computed by the converted model from its input, not frozen at convert's size."""
    model, converted = dinov3
    x = _image(size)
    with torch.no_grad():
        assert rel(converted(x), model(x)) <= NATIVE_TOLERANCE


def test_rotary_vit_float32_as_accurate_as_timm() -> None:
    model = _dinov3(torch.float32)
    converted = odeify.convert(model, input_size=(2, 3, 32, 32))
    x = _image(32, torch.float32)
    with torch.no_grad():
        exact = as_float64(model)(x.double())
        assert_as_accurate_as({"out": converted(x)}, {"out": model(x)}, {"out": exact}, 2.0)


def test_rotary_vit_retargets_through_its_input(dinov3) -> None:
    """Raise, re-emit and lower again with the table passed along: half depth, and back to native."""
    model, converted = dinov3
    half = odeify.retarget(converted, steps="x0.5")
    again = odeify.retarget(half, steps="native")
    x = _image(32)
    with torch.no_grad():
        assert torch.isfinite(half(x)).all()
        assert rel(again(x), model(x)) <= NATIVE_TOLERANCE


@pytest.mark.parametrize(
    "settings",
    [{"backward": "checkpoint"}, {"backward": "reversible", "integrator": "alf"}],
    ids=["checkpoint", "reversible-alf"],
)
def test_memory_saving_gradients_with_a_constant_input(dinov3, settings: dict) -> None:
    _, converted = dinov3
    saving = odeify.retarget(converted, **settings)
    plain = odeify.retarget(converted, backward="backprop", integrator=settings.get("integrator", "euler"))
    grads = []
    for model in (saving, plain):
        x = _image(32).requires_grad_()
        model(x).square().sum().backward()
        grads.append([x.grad, *(p.grad for p in model.parameters() if p.requires_grad)])
    for got, want in zip(*grads, strict=True):
        assert rel(got, want) <= GRADIENT_TOLERANCE


def test_a_constant_input_that_wants_a_gradient_is_refused_by_memory_saving_modes(dinov3) -> None:
    _, converted = dinov3
    (stage,) = converted_stages(odeify.retarget(converted, backward="checkpoint"))
    x = torch.randn(2, 5, 192, dtype=torch.float64)
    table = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ConfigError, match="requires grad"):
        stage(x, table)


def test_sam_windowed_and_global_blocks_are_one_stage_of_period_six() -> None:
    model = make_test_model("samvit_base_patch16_224", dtype=torch.float64, **SAM)
    converted = odeify.convert(model, input_size=(2, 3, 32, 32))
    (stage,) = converted_stages(converted)
    assert (stage.depth, stage.num_fields) == (2, 6)
    x = _image(32)
    with torch.no_grad():
        assert rel(converted(x), model(x)) <= NATIVE_TOLERANCE


class _SharedTable(nn.Module):
    """Blocks that each add a table computed outside them: from a buffer, or from a trainable weight."""

    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.source = nn.Parameter(torch.randn(4)) if trainable else None
        self.register_buffer("fixed", torch.randn(4))
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = (self.source if self.source is not None else self.fixed).cos() * x.shape[-1]
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x) * table
        return x


def test_a_table_from_a_buffer_is_an_input_one_from_a_weight_keeps_the_blocks_discrete() -> None:
    """A constant input needs no gradient; a value computed from a trainable weight is not one."""
    x = torch.randn(2, 4, dtype=torch.float64)
    fixed = _SharedTable(trainable=False).double().eval()
    converted = odeify.convert(fixed, input_size=(2, 4))
    (stage,) = converted_stages(converted)
    assert (stage.depth, len(stage.inputs)) == (3, 1)
    with torch.no_grad():
        assert rel(converted(x), fixed(x)) <= NATIVE_TOLERANCE
    trainable = _SharedTable(trainable=True).double().eval()
    with pytest.warns(UserWarning):  # the conversion says which run it could not lift, and why
        kept = odeify.convert(trainable, input_size=(2, 4))
    assert "trainable" in next(iter(kept.meta["odeify"]["not_lifted"].values()))


def test_calibration_fits_a_stage_that_takes_a_constant_input(dinov3) -> None:
    """Calibration runs the stage alone: it passes the table the model computes for the images' size."""
    model, converted = dinov3
    half = odeify.retarget(converted, steps="x0.5")
    images = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    fitted, report = odeify.calibrate(half, images, iterations=20, progress=False)
    (stage,) = report.stages
    assert stage.fitted and stage.after < stage.before


def test_a_model_traced_before_converts_to_a_file_load_reads(tmp_path) -> None:
    """fx keeps DINOv3's rotary periods as a tensor constant on the traced model: tracing must not leave
    it there, or the model is changed and its conversion names it otherwise than load's rebuild."""
    model = make_test_model("vit_tiny_patch16_dinov3_qkvb", img_size=32, depth=2)
    before = set(vars(model))
    trace(model)  # as a benchmark or a user's own analysis does
    assert set(vars(model)) == before, "tracing changed the model"
    again = odeify.convert(model, input_size=(2, 3, 32, 32))
    path = tmp_path / "dinov3.safetensors"
    odeify.save(again, path)
    x = _image(32, torch.float32)
    with torch.no_grad():
        assert torch.equal(odeify.load(path)(x), again(x))


DAVIT = {"depths": (1, 1, 2, 1), "embed_dims": (16, 32, 64, 128), "num_heads": (1, 2, 4, 8)}


def test_davit_blocks_reading_their_pairs_input_shape_form_one_stage() -> None:
    """DaViT's halves read ``B, C, H, W`` of their block pair's input, a tensor before them: their
    signatures describe it by its shape, so the third stage's two pairs are one stage of period 8; a
    lone pair's halves take ``H, W`` as constant inputs (Python numbers), also in checkpoint mode."""
    model = make_test_model("davit_tiny", dtype=torch.float64, **DAVIT)
    converted = odeify.convert(model, input_size=(1, 3, 64, 64))
    stages = converted_stages(converted)
    assert max((stage.depth, getattr(stage, "num_fields", 1)) for stage in stages) == (2, 8)
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        assert rel(converted(x), model(x)) <= NATIVE_TOLERANCE
    grads = []
    for mode in ("checkpoint", "backprop"):
        leaf = x.clone().requires_grad_()
        odeify.retarget(converted, backward=mode)(leaf).square().sum().backward()
        grads.append(leaf.grad)
    assert rel(*grads) <= GRADIENT_TOLERANCE
