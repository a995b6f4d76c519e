"""Calibration's ``objective="output"``: the network's last stage fitted to the network's output too.

The oracles: the model's own forward (the tail after the last stage must compute it from that
stage's output, float64), the source network's outputs (the reported output residual is recomputed
from them), and the ``"stage"`` objective's fit (the stages before the last must come out the same).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import timm
import torch
from torch import nn

import odeify
from odeify.compiler.source_network import source_network
from odeify.core.errors import ConfigError
from odeify.train.calibration import calibrate
from odeify.train.calibration_passes import stage_paths, with_stage_calls
from odeify.train.network_tail import network_tail

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def resnet(native: nn.Module) -> nn.Module:
    """The shipped digits ResNet (trained; stages of 4 and 3 blocks), converted, in float64."""
    return copy.deepcopy(native).double()


@pytest.fixture(scope="module")
def images(digits) -> torch.Tensor:
    return digits.train.tensors[0][:24].double()


@pytest.fixture(scope="module")
def vit() -> nn.Module:
    """A timm ViT (class-token head), random weights, converted in float64: one split stage."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, num_classes=10)
    return odeify.convert(model.double().eval(), input_size=(3, 32, 32))


def _stage_output(model: nn.Module, path: str, x: torch.Tensor) -> torch.Tensor:
    taken = []
    handle = model.get_submodule(path).register_forward_hook(lambda m, a, out: taken.append(out))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return taken[0]


@pytest.mark.parametrize("name", ["resnet", "vit"])
def test_the_tail_computes_the_output_from_the_last_stage(name: str, request, images) -> None:
    """The last stage's tail, on that stage's output, is the model's forward to the bit (the same
    operations, float64); a stage with another stage after it has no tail."""
    model = with_stage_calls(request.getfixturevalue(name)).eval()
    x = images if name == "resnet" else torch.randn(3, 3, 32, 32, dtype=torch.float64)
    paths = list(stage_paths(model).values())
    tail = network_tail(model, paths[-1])
    assert tail is not None
    with torch.no_grad():
        torch.testing.assert_close(tail(_stage_output(model, paths[-1], x)), model(x), rtol=0, atol=0)
    for earlier in paths[:-1]:
        assert network_tail(model, earlier) is None


class ScaledByStem(nn.Module):
    """Identity blocks whose head output is scaled by a value from before the stage (the stem's mean):
    the network's output depends on more than the last stage's output."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Conv2d(2, 4, 1), nn.Linear(4, 3)
        self.blocks = nn.ModuleList(nn.Conv2d(4, 4, 1) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = stem = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3))) * stem.mean()


def test_no_tail_where_a_value_from_before_the_stage_reaches_the_output() -> None:
    """The stage's output alone does not give the network's output: no tail (the stage loss is kept)."""
    torch.manual_seed(0)
    model = with_stage_calls(odeify.convert(ScaledByStem().double(), input_size=(2, 4, 4)))
    (path,) = stage_paths(model).values()
    assert network_tail(model, path) is None


def test_output_objective_fits_the_last_stage_to_the_source_output(resnet: nn.Module, images) -> None:
    """Half the steps: the stages before the last are fitted exactly as by the stage objective (bit for
    bit); the last reports an output residual that falls, and that equals the residual recomputed
    from the calibrated model's logits against the source's (float64)."""
    coarse = odeify.retarget(resnet, steps="x0.5")
    by_stage, _ = calibrate(coarse, images, iterations=20, progress=False, objective="stage")
    by_output, report = calibrate(coarse, images, iterations=20, progress=False)  # the default: "output"
    *earlier, last = report.stages
    assert all(fit.output is None for fit in earlier) and last.output is not None
    before, after = last.output
    assert after < before, str(report)
    assert "output residual" in str(report)
    first = odeify.converted_stages(by_stage)[0].state_dict()
    for key, tensor in odeify.converted_stages(by_output)[0].state_dict().items():
        assert torch.equal(tensor, first[key]), key
    with torch.no_grad():
        got, wanted = by_output(images), source_network(coarse).eval()(images)
    recomputed = float((got - wanted).norm() / wanted.norm())
    assert recomputed == pytest.approx(after, rel=1e-9)  # float64 sums in another order: ~1e-15 seen


def test_output_objective_on_a_vit_lowers_the_output_residual(vit: nn.Module) -> None:
    half = odeify.retarget(vit, steps="x0.5")
    x = torch.randn(32, 3, 32, 32, dtype=torch.float64)
    _, report = calibrate(half, x, iterations=15, progress=False, objective="output")
    (fit,) = report.stages
    assert fit.output is not None and fit.output[1] < fit.output[0], str(report)


def test_a_diverged_output_fit_is_undone(resnet: nn.Module, images) -> None:
    """What the fit minimizes (the squared residuals' sum) never ends above where it started."""
    _, report = calibrate(odeify.retarget(resnet, steps=1), images, iterations=5, lr=1e3, progress=False,
                          objective="output")  # fmt: skip
    last = report.stages[-1]
    assert last.after**2 + last.output[1] ** 2 <= (last.before**2 + last.output[0] ** 2) * (1 + 1e-9)


def test_an_unknown_objective_is_refused(resnet: nn.Module, images) -> None:
    with pytest.raises(ConfigError, match="objective must be one of output, stage"):
        calibrate(odeify.retarget(resnet, steps=1), images, progress=False, objective="logits")


def test_command_line_passes_the_objective(native: nn.Module, digits, tmp_path: Path, capsys) -> None:
    """``odeify calibrate`` writes the Python call's model (logits to the bit): by default the output
    objective's, with ``--calibrate-objective stage`` the stage objective's, and the two differ."""
    from odeify.cli.parser import main

    odeify.save(odeify.retarget(native, steps="x0.5"), tmp_path / "half.safetensors")
    half = odeify.retarget(native, steps="x0.5")
    x = digits.val.tensors[0][:8]
    logits = {}
    for objective, flags in (("output", []), ("stage", ["--calibrate-objective", "stage"])):
        assert main([
            "calibrate", str(tmp_path / "half.safetensors"), "--data", "digits",
            "-o", str(tmp_path / f"{objective}.safetensors"), "--calibrate-images", "16",
            "--calibrate-steps", "4", *flags,
        ]) == 0  # fmt: skip
        assert ("output residual" in capsys.readouterr().err) == (objective == "output")
        expected = calibrate(half, "digits", images=16, iterations=4, progress=False, objective=objective)[0]
        with torch.no_grad():
            logits[objective] = odeify.load(tmp_path / f"{objective}.safetensors")(x)
            assert torch.equal(logits[objective], expected(x)), objective
    assert not torch.equal(logits["output"], logits["stage"])


def test_finetune_starts_from_the_objective_given(native: nn.Module, digits, caplog) -> None:
    """``finetune(calibrate_objective="stage")`` starts from that calibration (epoch 0 scores what the
    Python call's model scores) and logs no output residual, which the default (``"output"``) logs;
    an unknown objective is refused first."""
    import logging
    from dataclasses import replace

    from odeify.train.datasets import make_loader
    from odeify.train.evaluate import evaluate
    from odeify.train.finetune import DEFAULT_RECIPE, finetune

    one = replace(DEFAULT_RECIPE, epochs=1, batch_size=16)
    for objective in ("stage", "output"):
        expected, _ = calibrate(odeify.retarget(native, steps=1), digits, progress=False, objective=objective)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="odeify"):
            result = finetune(
                odeify.retarget(native, steps=1), digits, one, max_batches=1, progress=False,
                **({"calibrate_objective": "stage"} if objective == "stage" else {}),
            )  # fmt: skip
        score = evaluate(expected.eval(), make_loader(digits.val, 256, train=False)).accuracy
        assert result.history[0].val_accuracy == score, objective
        assert ("output residual" in caplog.text) == (objective == "output")
        assert f"calibrate_objective={objective!r}" in caplog.text  # the Python run names its argument
    with pytest.raises(ConfigError, match="calibrate_objective must be one of"):
        finetune(odeify.retarget(native, steps=1), digits, one, progress=False, calibrate_objective="logits")
