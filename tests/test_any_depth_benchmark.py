"""benchmarks/any_depth.py's baselines: the depths a model is compared at and LayerDrop's block.

Oracles: the model's own stage depths (what a depth's steps must be), the wrapped block's output
(kept) and its input (dropped), and a timm ResNet whose runs the wrapper must find and give back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import timm
import torch

import odeify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from any_depth import LayerDropBlock, _run_blocks, depths_of, pruned_fraction  # noqa: E402


def test_depths_are_native_half_and_a_quarter_each_with_its_own_steps(native) -> None:
    assert depths_of(native) == ["native", "x0.5", "x0.25"]  # stages of 4 and 3 blocks: 4+3, 2+2, 1+1
    assert pruned_fraction(native, "x0.5") == 1 - 4 / 7
    assert pruned_fraction(native, "x0.25") == 1 - 2 / 7


def test_a_depth_that_gives_the_steps_of_one_before_is_left_out() -> None:
    model = timm.create_model("resnet18", num_classes=10)  # runs of 1 identity block but layer1's 2
    converted = odeify.convert(model.eval(), input_size=(3, 32, 32))
    assert depths_of(converted) == ["native", "x0.5"]


def test_layer_drop_skips_whole_blocks_in_training_only() -> None:
    block = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    dropped = LayerDropBlock(block, 1.0, torch.Generator().manual_seed(0))
    kept = LayerDropBlock(block, 0.0, torch.Generator().manual_seed(0))
    assert torch.equal(dropped.train()(x), x)
    assert torch.equal(kept.train()(x), block(x))
    assert torch.equal(dropped.eval()(x), block(x))  # inference runs every block; pruning is separate
    half = LayerDropBlock(block, 0.5, torch.Generator().manual_seed(0)).train()
    skipped = sum(torch.equal(half(x), x) for _ in range(400))
    assert 160 < skipped < 240  # binomial(400, 0.5): 5 standard deviations either side


def test_the_blocks_wrapped_are_the_runs_identity_blocks() -> None:
    model = timm.create_model("resnet18", num_classes=10)
    assert _run_blocks(model) == ["layer1.0", "layer1.1", "layer2.1", "layer3.1", "layer4.1"]
