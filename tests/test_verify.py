"""``odeify.convert`` checks its native conversion against the source by default (``verify=True``).

The oracle is ``odeify.verify`` run by hand on a native conversion and the source (itself checked
against a float computation in tests/test_cli.py). A deliberately broken conversion (one knot bias
shifted after the pipeline) must raise, name its measured error, the tolerance and the way out, and
keep the finished model; ``verify=False`` skips the check; a model whose output is not one tensor
is converted with the reason recorded instead of a check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import odeify
from odeify.cli.parser import main
from odeify.compiler import conversion
from odeify.compiler.verification import VerificationError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def source() -> nn.Module:
    return load_model(DEFAULT_MODEL_PATH)


def test_convert_records_a_passing_check_of_the_native_conversion(source: nn.Module) -> None:
    native = odeify.convert(source)
    check = native.meta["odeify"]["verification"]
    assert check == odeify.verify(native, source) and check.passed
    assert native.meta["odeify"]["verification_skipped_because"] is None
    coarse = odeify.convert(source, integrator="rk4", steps=2, knots=2)  # checked before retargeting
    assert coarse.meta["odeify"]["verification"] == check
    assert not odeify.verify(coarse, source).passed  # the coarse model itself is not exact


@pytest.fixture
def broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """CONVERT, then one knot bias of layer1 shifted by 0.05: a conversion that is wrong."""
    real = conversion.CONVERT

    class Broken:
        def run(self, job):  # noqa: ANN001, ANN202
            job = real.run(job)
            with torch.no_grad():
                job.gm.get_parameter("layer1_ode.knots.conv2_bias")[1] += 0.05
            return job

    monkeypatch.setattr(conversion, "CONVERT", Broken())


@pytest.mark.usefixtures("broken")
def test_a_wrong_conversion_raises_naming_its_error(source: nn.Module) -> None:
    with pytest.raises(VerificationError) as raised:
        odeify.convert(source, steps="x2")
    failed = raised.value
    check = failed.verification
    assert not check.passed and check.relative_error > 100 * check.tolerance
    message = str(failed)
    for words in (f"{check.relative_error:.3g}", f"{check.tolerance:.0e}", "verify=False", "Please report"):
        assert words in message
    assert isinstance(failed, odeify.OdeifyError)
    # the finished model rides on the error: the requested manifestation, the measurement recorded
    assert [s.steps for s in odeify.converted_stages(failed.converted)] == [8, 6]
    assert failed.converted.meta["odeify"]["verification"] == check
    # verify=False skips the check (and says so in the record)
    unchecked = odeify.convert(source, verify=False)
    record = unchecked.meta["odeify"]
    assert record["verification"] is None and record["verification_skipped_because"] == "verify=False"
    assert not odeify.verify(unchecked, source).passed  # it is the broken one


@pytest.mark.usefixtures("broken")
def test_the_cli_still_saves_a_model_whose_check_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.safetensors"
    assert main(["convert", "-o", str(out), "--steps", "x2"]) == 1
    err = capsys.readouterr().err
    assert "): FAILED" in err and "verification failed" in err and "was still written" in err
    assert [s.steps for s in odeify.converted_stages(odeify.load(out))] == [8, 6]
    assert main(["convert", "--no-verify"]) == 0  # the flag skips the library's check
    assert "verify:" not in capsys.readouterr().err


class _TwoHeads(nn.Module):
    """A residual network whose output is a tuple (two heads), which the check cannot compare."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Tanh()) for _ in range(3))
        self.heads = nn.ModuleList(nn.Linear(8, 2) for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        x = x.mean((2, 3))
        return self.heads[0](x), self.heads[1](x)


def test_a_model_without_one_tensor_output_is_converted_unchecked() -> None:
    torch.manual_seed(0)
    model = _TwoHeads().eval()
    converted = odeify.convert(model, input_size=(3, 8, 8))
    record = converted.meta["odeify"]
    assert record["verification"] is None and record["verification_skipped_because"] == (
        "the model returns a tuple, not one tensor"
    )
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for got, expected in zip(converted(x), model(x), strict=True):
            torch.testing.assert_close(got, expected)
