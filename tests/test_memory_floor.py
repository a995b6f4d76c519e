"""benchmarks/memory_floor.py's floor: the model with every block an identity runs its glue alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from memory_floor import without_blocks  # noqa: E402  (benchmarks/ is not a package)


def test_a_vit_without_blocks_runs_its_glue_alone() -> None:
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, num_classes=10)
    vit = vit.double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        glue = vit.forward_head(vit.norm(vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))))
        assert not torch.equal(vit(x), glue)  # the blocks did something
        torch.testing.assert_close(without_blocks(vit)(x), glue, rtol=0, atol=0)


def test_every_swin_block_is_replaced() -> None:
    swin = timm.create_model(
        "swin_tiny_patch4_window7_224", img_size=56, window_size=7, depths=(2, 1), num_heads=(2, 4),
        embed_dim=16, num_classes=10,
    )  # fmt: skip
    blocks = sum(type(m).__name__ == "SwinTransformerBlock" for m in swin.modules())
    assert blocks == 3
    stripped = without_blocks(swin)
    assert not any(type(m).__name__ == "SwinTransformerBlock" for m in stripped.modules())


def test_a_model_without_those_blocks_is_refused() -> None:
    resnet = timm.create_model("resnet18", num_classes=10)
    with pytest.raises(ValueError, match="no block"):
        without_blocks(resnet)
