"""Pictures: the weight path's numbers against the basis by hand, and PNG files written atomically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import odeify
from odeify.inspection.plots import plot_history, plot_memory, plot_sweep, plot_weight_path, weight_path
from odeify.train.finetune import EpochRecord
from odeify.train.sweep import SweepPoint

PNG = b"\x89PNG\r\n\x1a\n"


def test_constant_path_holds_each_knot_over_its_cell(native: torch.nn.Module) -> None:
    stage = odeify.converted_stages(native)[0]  # layer1: 4 knots, cells [k/4, (k+1)/4)
    times, norms, knot_norms = weight_path(stage, points=8)["conv1_weight"]
    stack = stage.knots["conv1_weight"].detach().double()
    assert knot_norms == pytest.approx([stack[k].norm().item() for k in range(4)])
    assert times == [i / 8 for i in range(9)]
    assert norms == pytest.approx([stack[min(i // 2, 3)].norm().item() for i in range(9)])


def test_linear_path_interpolates_between_knots(native: torch.nn.Module) -> None:
    linear = odeify.retarget(native, basis="linear", knots=2)
    stage = odeify.converted_stages(linear)[1]  # 2 knots at t = 0 and 1/2, held after the last
    _, norms, _ = weight_path(stage, points=4)["conv2_bias"]
    a, b = stage.knots["conv2_bias"].detach().double()
    expected = [a.norm(), ((a + b) / 2).norm(), b.norm(), b.norm(), b.norm()]
    assert norms == pytest.approx([value.item() for value in expected])


def test_plots_write_png_files_and_nothing_else(native: torch.nn.Module, tmp_path: Path) -> None:
    plot_weight_path(native, tmp_path / "path.png")
    points = [
        SweepPoint("euler", "1", "native", "constant", 2, 0.9, 0.01),
        SweepPoint("euler", "2", "native", "constant", 4, 0.97, 0.02),
    ]
    plot_sweep(points, tmp_path / "sweep.png")
    plot_history(
        {"run": [EpochRecord(0, 0.9), EpochRecord(1, 0.99, 0.1, 0.97, 1.0)]}, tmp_path / "history.png"
    )
    plot_memory({"backprop": [(4, 2**20), (8, 2**21)]}, tmp_path / "memory.png")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["history.png", "memory.png", "path.png", "sweep.png"]  # no temporary files left
    assert all((tmp_path / name).read_bytes().startswith(PNG) for name in names)
