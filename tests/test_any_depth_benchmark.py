"""benchmarks/any_depth.py's baselines: the depths a model is compared at and LayerDrop's block;
the sweep's runs and the report's hand-written section.

Oracles: the model's own stage depths (what a depth's steps must be), the wrapped block's output
(kept) and its input (dropped), a timm ResNet whose runs the wrapper must find and give back, the
methods' own list (every method at every budget, but a learning-rate variant before fine-tuning),
and a results file written here with a section around which the report's own parts lie.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import timm
import torch

import odeify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from any_depth import (  # noqa: E402
    ANY_DEPTH,
    METHODS,
    TRIED,
    LayerDropBlock,
    _keys,
    _run_blocks,
    depths_of,
    kept_section,
    pruned_fraction,
)


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


def test_every_method_runs_at_every_budget_but_a_learning_rate_variant_before_fine_tuning() -> None:
    args = argparse.Namespace(seeds=2, epochs=[0, 1])
    keys = _keys(args, "m", ["native", "x0.5", "x0.25"])
    for seed in (0, 1):
        for epochs in (0, 1):
            ran = {(k["method"], k["depth"]) for k in keys if k["seed"] == seed and k["epochs"] == epochs}
            wanted = {(m, "all") for m, lr in ANY_DEPTH.items() if epochs or lr is None}
            wanted |= {(m, d) for m in METHODS if m not in ANY_DEPTH for d in ("x0.5", "x0.25")}
            assert ran == wanted
    assert len(keys) == len({tuple(sorted(k.items())) for k in keys})  # no run twice


def test_the_report_keeps_the_hand_written_section_and_nothing_around_it(tmp_path) -> None:
    written = ["a line of the trials", "", "- a bullet", ""]
    path = tmp_path / "results.md"
    path.write_text("\n".join(["# title", "", "## m (source 99%)", "| t |", "", TRIED, *written,
                               "The runs: `x`.", "", "Command: `y`", ""]))  # fmt: skip
    assert kept_section(path) == [TRIED, *written]
    path.write_text("\n".join(["# title", "", TRIED, "last line"]))  # the section ends the file
    assert kept_section(path) == [TRIED, "last line", ""]
    path.write_text("# title\n\n## m\n")
    assert kept_section(path) == []
    assert kept_section(tmp_path / "absent.md") == []
