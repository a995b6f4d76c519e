"""benchmarks/layer_drop.py's student: a timm ViT that runs some of its source's blocks, and only those."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import timm
import torch

import odeify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from layer_drop import layer_dropped  # noqa: E402  (benchmarks/ is not a package)


@pytest.fixture(scope="module")
def vit() -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, num_classes=10)
    return model.double().eval()


def _through_blocks(vit: torch.nn.Module, x: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """timm's VisionTransformer.forward, written out, running the source's blocks ``keep``."""
    h = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))
    for k in keep:
        h = vit.blocks[k](h)
    return vit.forward_head(vit.norm(h))


@pytest.mark.parametrize("keep", [[0, 1, 2, 3], [0, 2], [3, 1]])
def test_the_student_runs_the_kept_blocks_in_order(vit: torch.nn.Module, keep: list[int]) -> None:
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    student = layer_dropped(vit, keep)
    with torch.no_grad():
        expected = _through_blocks(vit, x, keep)
        # the same operations in the same order: equal to the bit
        torch.testing.assert_close(student(x), expected, rtol=0, atol=0)
        if keep == [0, 1, 2, 3]:
            torch.testing.assert_close(student(x), vit(x), rtol=0, atol=0)
        else:
            assert not torch.allclose(expected, vit(x))  # the dropped blocks did something
    assert len(vit.blocks) == 4  # the source keeps its blocks


def test_bad_block_lists_are_refused(vit: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match=r"blocks 0\.\.3"):
        layer_dropped(vit, [0, 4])
    with pytest.raises(ValueError, match="no timm `blocks`"):
        layer_dropped(torch.nn.Linear(2, 2), [0])


def test_lie_trotter_at_half_the_steps_is_the_student_with_doubled_branches(vit: torch.nn.Module) -> None:
    """A coarse Lie-Trotter step reads the kept block's weights at its start over two blocks' length:
    the layer-drop student with each kept block's last projections doubled, the same function class
    (why the two calibrate alike: docs/calibration.md)."""
    half = odeify.retarget(odeify.convert(vit, input_size=(3, 32, 32)), steps="x0.5")
    doubled = copy.deepcopy(vit)
    with torch.no_grad():
        for k in (0, 2):
            for layer in (doubled.blocks[k].attn.proj, doubled.blocks[k].mlp.fc2):
                layer.weight.mul_(2)
                layer.bias.mul_(2)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        coarse, expected = half(x), _through_blocks(doubled, x, [0, 2])
        # float64; 0.0 measured (doubling is exact in floating point), 1e-13 allows another kernel order
        torch.testing.assert_close(coarse, expected, rtol=1e-13, atol=0)
        assert not torch.allclose(coarse, _through_blocks(vit, x, [0, 2]))  # the doubling matters
