"""Calibration for several depths at once: native reads the knots as they are, every other listed
depth a correction fitted for it alone; and the one rule by which calibration refuses a model.

The oracles: the single-depth calibration (bit for bit, or to the rounding of knots + correction),
the converted model at native depth (bit for bit), a second run (determinism) and
``odeify.retarget``'s own step counts.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import odeify
from odeify.compiler.conversion import steps_at
from odeify.core.errors import ConfigError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models.digits import digits_resnet
from odeify.train.calibration import calibrate
from odeify.train.datasets import open_data

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def native() -> nn.Module:
    """The shipped digits ResNet (trained; stages of 4 and 3 blocks), converted."""
    return odeify.convert(odeify.load_model(DEFAULT_MODEL_PATH))


@pytest.fixture(scope="module")
def images(native: nn.Module) -> torch.Tensor:
    """32 digits of the training split to fit on."""
    return open_data("digits", native).train.tensors[0][:32]


@pytest.fixture(scope="module")
def held_out(native: nn.Module) -> torch.Tensor:
    """64 digits of the validation split, never fitted on."""
    return open_data("digits", native).val.tensors[0][:64]


def _output_error(model: nn.Module, source: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        exact = source(x).double()
        return float((model(x).double() - exact).norm() / exact.norm())


def _steps(model: nn.Module) -> list[int]:
    return [s.steps for s in odeify.converted_stages(model)]


def test_one_depth_list_is_todays_calibration_bit_for_bit(native: nn.Module, images: torch.Tensor) -> None:
    """steps=[the depth the model runs at], written as a multiplier or as a per-stage dict, gives the
    same tensors and the same residuals as a calibration without steps."""
    coarse = odeify.retarget(native, steps="x0.5")
    today, report = calibrate(coarse, images, iterations=6, progress=False)
    names = [s.stage_name for s in odeify.converted_stages(coarse)]
    for steps in (["x0.5"], [dict(zip(names, _steps(coarse), strict=True))]):
        listed, listed_report = calibrate(coarse, images, steps=steps, iterations=6, progress=False)
        mine, theirs = today.state_dict(), listed.state_dict()
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[key], theirs[key]) for key in mine), steps
        for a, b in zip(report.stages, listed_report.stages, strict=True):
            assert (a.before, a.after, a.output) == (b.before, b.after, b.output)
            assert [(d.before, d.after, d.output) for d in b.depths] == [(a.before, a.after, a.output)]


def test_two_depths_keep_native_and_fit_the_other_as_alone(
    native: nn.Module, images: torch.Tensor, held_out: torch.Tensor
) -> None:
    """Issue 57: calibrated for native and x0.5 at once, native computes what the converted model
    computes (bit for bit: it reads the blocks), and x0.5 reads what a file calibrated for x0.5
    alone holds, up to the rounding of knots + (fitted - knots) (at most one float32 rounding of
    each of the two operations, ``eps * (|fitted - knots| + |fitted|)``); the report gives x0.5's
    residual before and after, and each stage the step counts it was fitted for."""
    coarse = odeify.retarget(native, steps="x0.5")
    alone, _ = calibrate(coarse, images, iterations=30, progress=False)
    both, report = calibrate(coarse, images, steps=["native", "x0.5"], iterations=30, progress=False)
    assert _steps(both) == _steps(coarse)  # the model keeps the depth it runs at
    assert report.depths == ["native", "x0.5"]
    for fit in report.stages:
        assert [d.depth for d in fit.depths] == ["x0.5"]
        assert fit.depths[0].after < fit.depths[0].before, str(report)
    eps = torch.finfo(torch.float32).eps
    for stage, own in zip(odeify.converted_stages(both), odeify.converted_stages(alone), strict=True):
        correction = stage.correction()
        for name, fitted in own.knots.items():
            read = stage.knots[name].detach() + correction[name].detach()
            bound = eps * ((fitted - stage.knots[name]).abs() + fitted.abs()).detach()
            assert bool(((read - fitted.detach()).abs() <= bound).all()), name
    with torch.no_grad():
        odeify.set_steps(both, "native")
        assert torch.equal(both.eval()(held_out), native.eval()(held_out))
    for stage, source in zip(odeify.converted_stages(both), odeify.converted_stages(native), strict=True):
        assert stage.fitted_steps == tuple(sorted({source.depth, round(source.depth / 2)}))
        assert stage.corrected_steps == (round(source.depth / 2),)


def test_deterministic_for_a_seed(native: nn.Module, images: torch.Tensor) -> None:
    steps = ["native", "x0.5", "x0.25"]
    runs = [
        calibrate(native, images, steps=steps, iterations=4, seed=s, progress=False)[0] for s in (3, 3, 4)
    ]
    first, same, other = (dict(run.named_parameters()) for run in runs)
    assert all(torch.equal(first[n], same[n]) for n in first)
    assert any(not torch.equal(first[n], other[n]) for n in first)


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([], "must list depths"),
        (2.5, "must list depths"),
        (["x0.5", "y2"], "multiplier"),
        ([{"nope": 1}], "do not exist"),
    ],
)
def test_bad_depth_lists_are_refused(
    native: nn.Module, images: torch.Tensor, steps: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        calibrate(native, images, steps=steps, progress=False)


def test_depths_with_the_same_steps_are_merged(
    native: nn.Module, images: torch.Tensor, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 57: x0.25 and x0.2 both give stages of 4 and 3 blocks one step each, so the list is
    fitted as if written without x0.2 (the oracle: that calibration, bit for bit), saying so once."""
    counts = [steps_at(native, depth) for depth in ("x0.25", "x0.2")]
    assert counts[0] == counts[1]  # what makes them one depth, by retarget's own rounding
    with caplog.at_level("INFO", logger="odeify"):
        merged, report = calibrate(native, images, steps=["native", "x0.25", "x0.2"], iterations=3)
    alone, expected = calibrate(native, images, steps=["native", "x0.25"], iterations=3, progress=False)
    assert report.depths == expected.depths == ["native", "x0.25"]
    mine, theirs = merged.state_dict(), alone.state_dict()
    assert all(torch.equal(mine[key], theirs[key]) for key in theirs)
    said = [r.getMessage() for r in caplog.records if "merged" in r.getMessage()]
    assert len(said) == 1 and "x0.25 and x0.2" in said[0], said


def test_native_depth_alone_has_nothing_to_fit(native: nn.Module, images: torch.Tensor) -> None:
    """A coarse file asked to fit only native, where it computes its source, is refused as a native
    file is; the message names a depth to ask for."""
    coarse = odeify.retarget(native, steps="x0.5")
    with pytest.raises(ConfigError, match=r"nothing to fit: at depth native .*steps=\['x0.5'\]"):
        calibrate(coarse, images, steps=["native"], progress=False)


# --- issue 49: one rule for what calibration refuses ---------------------------------------------


@pytest.fixture(scope="module")
def one_block() -> nn.Module:
    """A digits ResNet whose two stages have one block each (random weights), converted."""
    torch.manual_seed(0)
    return odeify.convert(digits_resnet(layers=(1, 2)).eval())


def test_case_10_a_file_that_computes_its_source_is_refused_whatever_its_knots(
    one_block: nn.Module, images: torch.Tensor
) -> None:
    """Native steps and knots, or two knots of one-block stages (which read as the block): both
    compute the source exactly, so both are refused for the same reason; nothing is written."""
    assert [s.depth for s in odeify.converted_stages(one_block)] == [1, 1]
    with warnings.catch_warnings():  # more knots than blocks: said, and what this case is about
        warnings.simplefilter("ignore")
        two_knots = odeify.retarget(one_block, knots=2)
    with torch.no_grad():
        assert torch.equal(two_knots(images), one_block(images))
    for model in (two_knots, one_block):
        with pytest.raises(ConfigError, match="nothing to fit.*Every stage has one block"):
            calibrate(model, images, progress=False)


def test_case_9_retarget_calibrate_of_one_block_stages_says_why(
    one_block: nn.Module, tmp_path: Path, capsys
) -> None:
    """``odeify retarget FILE --steps x0.5 --calibrate DIR`` on one-block stages: refused (exit 2)
    with the reason, not with a suggestion to run the command just run; nothing written."""
    from odeify.cli.parser import main

    odeify.save(one_block, tmp_path / "one.safetensors")
    out = tmp_path / "half.safetensors"
    args = ["retarget", str(tmp_path / "one.safetensors"), "-o", str(out), "--steps", "x0.5"]
    assert main([*args, "--calibrate", "digits", "--calibrate-images", "8"]) == 2
    err = capsys.readouterr().err
    assert "one block" in err, err
    assert "--steps x0.5 --calibrate" not in err, err
    assert not out.exists()


# --- the command line --------------------------------------------------------------------------


def test_command_line_takes_a_set_of_depths(native: nn.Module, tmp_path: Path, capsys) -> None:
    """--calibrate-steps-set, comma-separated and repeated, on both commands that calibrate: the
    file written is the Python call's for the same depths, and the report names each depth."""
    from odeify.cli.parser import main

    odeify.save(native, tmp_path / "native.safetensors")
    odeify.save(odeify.retarget(native, steps="x0.5"), tmp_path / "half.safetensors")
    flags = ["--calibrate-images", "16", "--calibrate-steps", "3", "--calibrate-steps-set", "native,x0.5"]
    a = [
        "calibrate",
        str(tmp_path / "half.safetensors"),
        "--data",
        "digits",
        "-o",
        str(tmp_path / "a.safetensors"),
    ]
    assert main([*a, *flags, "--calibrate-steps-set", "x0.25"]) == 0
    assert "at x0.25 (1 step)" in capsys.readouterr().err
    assert main(["retarget", str(tmp_path / "native.safetensors"), "-o", str(tmp_path / "b.safetensors"),
                 "--steps", "x0.5", "--calibrate", "digits", *flags]) == 0  # fmt: skip
    half = odeify.retarget(native, steps="x0.5")
    expected = {
        name: calibrate(half, "digits", steps=steps, images=16, iterations=3, progress=False)[0]
        for name, steps in (("a", ["native", "x0.5", "x0.25"]), ("b", ["native", "x0.5"]))
    }
    x = open_data("digits", native).val.tensors[0][:8]
    with torch.no_grad():
        for name, model in expected.items():
            assert torch.equal(odeify.load(tmp_path / f"{name}.safetensors")(x), model(x)), name
    assert main(["calibrate", "--help"]) == 0
    assert "--calibrate-steps-set" in capsys.readouterr().out


def _student(source: nn.Module) -> nn.Module:
    """The digits ResNet with blocks dropped (stages of 2 and 2 blocks of its 4 and 3), the kept
    blocks' weights the source's: the comparison a user makes, as the compression benchmark's
    layer-drop row builds it."""
    keep = {"layer1": [0, 2], "layer2": [0, 1, 3]}
    student = digits_resnet(layers=(2, 3)).eval()
    state = source.state_dict()
    mine = {}
    for key in student.state_dict():
        parts = key.split(".")
        if parts[0] in keep:
            parts[1] = str(keep[parts[0]][int(parts[1])])
        mine[key] = state[".".join(parts)]
    student.load_state_dict(mine)
    return odeify.convert(student)


def test_case_13_command_line_calibrates_a_student_against_its_source(
    native: nn.Module, tmp_path: Path, capsys
) -> None:
    """``odeify calibrate STUDENT --source FILE``: the file is the Python call's with source=; the
    student alone is refused as a native file, with a message that names --source."""
    from odeify.cli.parser import main

    student = _student(odeify.load_model(DEFAULT_MODEL_PATH))
    odeify.save(student, tmp_path / "student.safetensors")
    odeify.save(odeify.retarget(native, steps="x0.5"), tmp_path / "half.safetensors")  # keeps the source
    common = ["--data", "digits", "--calibrate-images", "16", "--calibrate-steps", "4"]
    out = tmp_path / "fitted.safetensors"
    assert main(["calibrate", str(tmp_path / "student.safetensors"), "-o", str(out), *common,
                 "--source", str(tmp_path / "half.safetensors")]) == 0  # fmt: skip
    expected, report = calibrate(student, "digits", images=16, iterations=4, source=native, progress=False)
    assert all(fit.fitted and fit.after < fit.before for fit in report.stages), str(report)
    x = open_data("digits", native).val.tensors[0][:8]
    with torch.no_grad():
        assert torch.equal(odeify.load(out)(x), expected(x))
    capsys.readouterr()
    assert main(["calibrate", str(tmp_path / "student.safetensors"), "-o", str(tmp_path / "no.safetensors"),
                 *common]) == 2  # fmt: skip
    assert "--source FILE" in capsys.readouterr().err


# --- issue 49 case 16: calibration's memory is bounded ---------------------------------------------


def test_case_16_a_small_memory_budget_spills_and_fits_the_same(
    native: nn.Module, images: torch.Tensor
) -> None:
    """memory=1 byte: every activation goes to the temporary file, passes and fit micro-batches take
    one image; the knots are those of the calibration held in memory (float64: to round-off, the
    micro-batches' gradients summed in another order), and the report says what was spilled and the
    peak."""
    coarse = odeify.retarget(native.double(), steps="x0.5")
    x = images.double()
    held, report = calibrate(coarse, x, iterations=5, progress=False)
    spilled, small = calibrate(coarse, x, iterations=5, memory=1, progress=False)
    assert report.memory[1] == 0 and small.memory[1] > 0
    assert small.memory[2] is None or small.memory[2] > 0
    assert "in a temporary file" in str(small) and "peak memory" in str(small)
    mine, theirs = held.state_dict(), spilled.state_dict()
    for key in mine:
        scale = float(mine[key].double().norm()) or 1.0
        assert float((mine[key].double() - theirs[key].double()).norm()) <= 1e-10 * scale, key
    with pytest.raises(ConfigError, match="memory must be a positive integer"):
        calibrate(coarse, x, memory=0, progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_case_16_spilled_rows_read_back_bit_for_bit(dtype: torch.dtype) -> None:
    from odeify.train.calibration_store import Budget

    x = torch.randn(10, 3, 5, 4).to(dtype)
    budget = Budget(x.numel() * x.element_size() - 1)  # one byte short: to the file
    rows = budget.rows(10, x)
    for batch in x.split(3):
        rows.append(batch)
    assert budget.spilled > 0 and rows.data is None
    pick = torch.tensor([7, 0, 9, 3])
    assert torch.equal(rows.take(pick), x[pick])
    assert torch.equal(torch.cat(list(rows.batches(4))), x)
    rows.close()
    kept = Budget(x.numel() * x.element_size()).rows(10, x)
    kept.append(x)
    assert kept.data is not None and torch.equal(kept.take(pick), x[pick])
    kept.close()
    assert kept.budget.left == kept.budget.nbytes
