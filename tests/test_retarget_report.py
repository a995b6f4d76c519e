"""What ``odeify retarget`` says it did (issue 21, s6): per stage the settings that changed, the
refit's relative error, and a warning where a request is not met as asked.

Oracle of the error: a constant weight path of K knots compressed to one constant knot is refitted
by least squares to the knots' mean, so its relative error is sqrt(sum_k ||w_k - mean||^2 / sum_k
||w_k||^2), computed here from the saved knots alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import odeify
from odeify.cli.parser import main
from odeify.compiler.conversion import converted_stages

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("retarget") / "digits_ode.safetensors"
    assert main(["convert", "-o", str(path)]) == 0  # layer1: 4 blocks, layer2: 3 blocks
    return path


def _expected_error(stage) -> float:  # noqa: ANN001
    knots = [k.detach().double() for k in stage.knot_tensors()]
    error = sum(float((k - k.mean(0)).pow(2).sum()) for k in knots)
    return (error / sum(float(k.pow(2).sum()) for k in knots)) ** 0.5


def test_a_compression_reports_each_stages_fit_error(
    converted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "one_knot.safetensors"
    assert main(["retarget", str(converted), "-o", str(out), "--knots", "1", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["model"] == out.name  # the table is the result's, not the input's
    stages = {s.stage_name: s for s in converted_stages(odeify.load(converted))}
    for change in result["changes"]:
        stage = stages[change["stage"]]
        assert change["changed"] == [f"knots {stage.num_knots} -> 1"]
        assert change["fit_error"] == pytest.approx(_expected_error(stage), rel=1e-9)
        assert change["fit_error"] > 0.01 and change["warnings"] == []
    assert "layer1: knots 4 -> 1; weights refitted: relative error" in captured.err


def test_requests_not_met_as_asked_warn(
    converted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "more.safetensors"
    argv = ["retarget", str(converted), "-o", str(out), "--steps", "x1.1", "--knots", "8", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.count("more knots than blocks: 'layer1' (8 knots for 4 blocks)") == 1  # said once
    changes = {c["stage"]: c for c in json.loads(captured.out)["changes"]}
    layer1 = changes["layer1"]  # 4 blocks: 4.4 steps round to 4, 8 knots interpolate 4 blocks
    assert layer1["changed"] == ["knots 4 -> 8"]
    assert layer1["fit_error"] == pytest.approx(0, abs=1e-12)  # more knots: the path is kept exactly
    assert layer1["warnings"] == ["layer1: --steps x1.1 of its 4 step(s) rounds back to 4: unchanged (a "
                                  "stage takes whole steps)"]  # fmt: skip
    # without a change of knots or basis the weights are not refitted
    assert main(["retarget", str(converted), "-o", str(out), "--integrator", "rk4", "--json"]) == 0
    changes = json.loads(capsys.readouterr().out)["changes"]
    assert all(c["changed"] == ["integrator euler -> rk4"] and c["fit_error"] is None for c in changes)
    assert torch.equal(
        odeify.load(out).layer1_ode.knot_tensors()[0], odeify.load(converted).layer1_ode.knot_tensors()[0]
    )
