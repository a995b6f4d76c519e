"""Every script in examples/ runs as a user would run it (small sizes), and does what it says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import odeify
from odeify.models.digits import load_digits

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
PNG = b"\x89PNG\r\n\x1a\n"


def run(script: str, *argv: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *argv],
        env=ENV, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_convert_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "converted.safetensors"
    stdout = run("convert_checkpoint.py", "-o", str(out))
    exact = float(re.search(r"in float64 max relative error (\S+);", stdout).group(1))
    assert exact < 1e-12  # measured 2.3e-16
    assert "reloaded output identical: True" in stdout
    assert len(odeify.converted_stages(odeify.load(out))) == 2


def test_finetune_memory_free(tmp_path: Path) -> None:
    stdout = run("finetune_memory_free.py", "--epochs", "1", "--max-batches", "2", "--out", str(tmp_path))
    assert re.search(r"test accuracy \d+\.\d+% -> \d+\.\d+%", stdout)
    stages = odeify.converted_stages(odeify.load(tmp_path / "last.safetensors"))
    assert [(s.integrator.name, s.backward, s.num_knots) for s in stages] == [
        ("reversible_heun", "reversible", 2)
    ] * 2


def test_depth_sweep(tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    stdout = run("depth_sweep.py", "--integrators", "euler", "--steps", "1,native", "--plot", str(png))
    assert "| euler | 1 | native | constant | 2 |" in stdout
    assert "| euler | native | native | constant | 7 |" in stdout
    assert png.read_bytes().startswith(PNG)


def test_inspect_graph(tmp_path: Path) -> None:
    run("inspect_graph.py", "--out", str(tmp_path))
    code = (tmp_path / "model.py").read_text()
    assert "def forward" in code and "layer1_ode" in code
    assert (tmp_path / "graph.dot").read_text().startswith("digraph")
    assert (tmp_path / "weight_path.png").read_bytes().startswith(PNG)


def test_train_digits(tmp_path: Path) -> None:
    out = tmp_path / "digits.safetensors"
    stdout = run("train_digits.py", "--epochs", "1", "--threads", "1", "--out", str(out))
    accuracy = float(re.search(r"test accuracy (\S+)", stdout).group(1))
    x, y = load_digits("test")
    with torch.no_grad():
        assert (odeify.load_model(out)(x).argmax(1) == y).double().mean().item() == pytest.approx(
            accuracy, abs=5e-5
        )
