"""The flow a user walks from the docs with one file for every depth (issue 57's eight cases).

Oracles: the same command or call with the merged depth written once (bit for bit), an argmax loop
at each depth, the file's own tensors, the command a message proposes (run, it must work), the
report's own numbers, and the docs' sentence against what the code does.
"""

from __future__ import annotations

import copy
import logging
import re
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import odeify
from odeify.cli.parser import _interrupted, main
from odeify.train import finetune as finetune_module
from odeify.train.datasets import LabelledData
from odeify.train.finetune import DEFAULT_RECIPE, STATE_FILE, finetune
from odeify.train.manifestations import StepProbe, for_training

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = Path(__file__).resolve().parents[1] / "docs"
QUICK = replace(DEFAULT_RECIPE, epochs=1, batch_size=16)
CALIBRATE = ["--calibrate-images", "16", "--calibrate-steps", "3"]


class Called(Exception):
    """Raised by a stand-in for calibration: the run reached it."""


def _accuracy(model: torch.nn.Module, data: LabelledData) -> float:
    """A plain argmax loop over the validation split."""
    loader = torch.utils.data.DataLoader(data.val, batch_size=256)
    with torch.no_grad():
        right = sum(int((model.eval()(x).argmax(1) == y).sum()) for x, y in loader)
    return right / len(data.val)


def _log(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(record.getMessage() for record in caplog.records)


@pytest.fixture(scope="module")
def half_file(native: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("flow") / "half.safetensors"
    odeify.save(odeify.retarget(native, steps="x0.5", backward="checkpoint"), path)
    return path


# -- case 1: depths that give the same steps are merged, not refused ---------------------------------
def test_case1_the_command_line_merges_depths_with_the_same_steps(
    half_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """x0.25 and x0.2 give stages of 4 and 3 blocks one step each: calibrate and sweep take the list,
    say so once, and fit or measure that depth once (the Python call's merge is checked bit for bit
    in test_calibrate_depths.py)."""
    head = [
        "calibrate",
        str(half_file),
        "--data",
        "digits",
        *CALIBRATE,
        "-o",
        str(tmp_path / "m.safetensors"),
    ]
    assert main([*head, "--calibrate-steps-set", "native,x0.25,x0.2"]) == 0
    said = capsys.readouterr()
    assert (said.out + said.err).count("depths x0.25 and x0.2 give this model the same steps") == 1
    fitted = odeify.converted_stages(odeify.load(tmp_path / "m.safetensors"))
    assert [s.fitted_steps for s in fitted] == [(1, 4), (1, 3)]  # native and the one merged depth
    sweep = ["sweep", str(half_file), "--data", "digits", "--integrators", "euler", "--max-batches", "1"]
    assert main([*sweep, "--steps", "x0.25,x0.2,native", "--plot", str(tmp_path / "s.png")]) == 0
    said = capsys.readouterr()
    rows = [line for line in said.out.splitlines() if line.startswith("| euler")]
    assert [row.split("|")[2].strip() for row in rows] == ["x0.25", "native"]
    assert "depths x0.25 and x0.2" in said.err


# -- case 2: one rule for a multiplier below half a step ---------------------------------------------
def test_case2_the_docs_say_what_the_code_does_below_half_a_step(native: torch.nn.Module) -> None:
    """x0.1 of stages of 4 and 3 blocks is 0.4 and 0.3 steps: the code clamps each to one step and
    records it; cli.md and robustness.md say the same, and neither says such a multiplier is refused."""
    model = odeify.retarget(native, steps="x0.1")
    assert [s.steps for s in odeify.converted_stages(model)] == [1, 1]
    for doc in ("cli.md", "robustness.md"):
        text = " ".join((DOCS / doc).read_text().split())
        said = [text[m.end() : m.end() + 60] for m in re.finditer("half a step", text)]
        assert said and all("clamps it to one step" in after for after in said), (doc, said)


# -- case 3: a file fitted for the run's depths is not calibrated again ------------------------------
def test_case3_finetune_starts_from_the_files_fit(
    native: torch.nn.Module, digits: LabelledData, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """A file calibrated for native and x0.5 starts its --depths run from its own tensors (epoch 0 is
    the file's accuracy); the same file without its record of fitted depths calibrates (the stand-in
    is reached), so the record is what decides."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise Called

    monkeypatch.setattr(finetune_module, "calibrate", refuse)
    fitted = odeify.calibrate(
        odeify.retarget(native, backward="checkpoint"), digits, steps=["native", "x0.5"], images=16,
        iterations=2, progress=False,
    )[0]  # fmt: skip
    depths = replace(QUICK, depths="native,x0.5")
    with caplog.at_level(logging.INFO, logger="odeify"):
        result = finetune(copy.deepcopy(fitted), digits, depths, max_batches=1, progress=False)
    assert "starts from the file's fit" in _log(caplog)
    assert result.history[0].depth_accuracy["native"] == _accuracy(odeify.set_steps(fitted, "native"), digits)
    for stage in odeify.converted_stages(fitted):
        stage.fitted_steps = None
    with pytest.raises(Called):
        finetune(fitted, digits, depths, max_batches=1, progress=False)


# -- case 4: the starting accuracy of each depth, labelled -------------------------------------------
def test_case4_the_log_gives_each_depths_starting_accuracy(
    native: torch.nn.Module, digits: LabelledData, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """Before calibration the log gives the file's accuracy at each depth (an argmax loop's), not the
    worst depth's as the model's; epoch 0's single number is labelled the worst depth's."""
    monkeypatch.setattr(
        finetune_module, "calibrate", lambda model, *a, **k: (copy.deepcopy(model), "calibrated")
    )
    model = odeify.retarget(native, backward="checkpoint")
    expected = {d: _accuracy(odeify.set_steps(copy.deepcopy(model), d), digits) for d in ("native", "x0.25")}
    with caplog.at_level(logging.INFO, logger="odeify"):
        finetune(model, digits, replace(QUICK, depths="native,x0.25"), max_batches=1, progress=False)
    log = _log(caplog)
    given = ", ".join(f"{d} {a:.2%}" for d, a in expected.items())
    assert f"the model as given (before calibration): val accuracy at {given}" in log
    assert f"val accuracy {min(expected.values()):.2%} (the worst depth's)" in log


# -- case 5: the backward mode and why -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "why"),
    [({"depths": "native,x0.5"}, "--depths keeps"), ({"steps": 1}, "--steps set the manifestation")],
)
def test_case5_the_log_says_why_the_backward_mode_was_not_measured(
    native: torch.nn.Module, caplog: pytest.LogCaptureFixture, settings: dict, why: str
) -> None:
    """A run whose default mode is not measured against ALF says which mode each stage got and why."""
    probe = StepProbe((2, 1, 32, 32), torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="odeify"):
        model = for_training(native, probe=probe, **settings)
    modes = {s.backward for s in odeify.converted_stages(model)}
    (line,) = [m for m in _log(caplog).splitlines() if m.startswith("default backward mode")]
    assert len(modes) == 1 and f"default backward mode: {modes.pop()}, not measured" in line
    assert why in line


# -- case 6: a resume hint only where there is something to resume ------------------------------------
def test_case6_ctrl_c_before_the_first_epoch_proposes_no_resume(
    native: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Ctrl-C in the opening calibration leaves no run: no --resume is proposed, and the command it
    would have proposed fails; with a saved state the hint is there."""

    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(finetune_module, "calibrate", interrupt)
    odeify.save(native, tmp_path / "native.safetensors")
    out = tmp_path / "run"
    argv = ["finetune", str(tmp_path / "native.safetensors"), "--data", "digits", "--steps", "1",
            "--max-batches", "1", "--batch-size", "16", "--epochs", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 130
    said = capsys.readouterr().err
    assert "--resume" not in said and "no run to resume" in said
    assert main(["finetune", "--data", "digits", "--resume", "--out", str(out)]) == 2
    capsys.readouterr()
    (out / STATE_FILE).write_bytes(b"")
    assert f"odeify finetune --resume --out {out}" in _interrupted(
        Namespace(command="finetune", out=str(out))
    )


# -- case 7: calibration's progress, with the time left -----------------------------------------------
def test_case7_calibration_shows_progress_per_stage_and_depth(
    native: torch.nn.Module, digits: LabelledData, caplog, monkeypatch, capsys
) -> None:
    """In a log: a line every tenth of a stage's steps naming each depth's error and the time left,
    its last at the steps the report gives; on a terminal, a bar per stage instead of the lines."""
    half = odeify.retarget(native, steps="x0.5")
    with caplog.at_level(logging.INFO, logger="odeify"):
        report = odeify.calibrate(half, digits, steps=["x0.5", "x0.25"], images=16, iterations=20)[1]
    log = _log(caplog)
    for fit in report.stages:
        for depth in ("x0.5", "x0.25"):
            at = f"calibration of {fit.stage} ("
            steps = [
                m for m in log.splitlines() if m.startswith(at) and ": step " in m and f"at {depth} " in m
            ]
            assert len(steps) == 10 and "step 20/20" in steps[-1], (fit.stage, depth, steps)
            assert all(re.search(r"about \d+ s left in this stage", line) for line in steps)
    monkeypatch.setattr("odeify.train.calibration_progress.bar_wanted", lambda: True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="odeify"):
        odeify.calibrate(half, digits, images=16, iterations=4)
    assert ": step " not in _log(caplog)
    assert re.search(r"calibration of layer1 \(1/2\): +\d+%\|", capsys.readouterr().err)  # tqdm's bar


# -- case 8: the command line's names -----------------------------------------------------------------
def test_case8_the_command_line_names_its_flags(
    native: torch.nn.Module, half_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The memory line names --calibrate-memory, which sets what the report says was used; the
    warning for a depth the file was not fitted for names --calibrate-steps-set, not Python."""
    out = tmp_path / "fitted.safetensors"
    assert main(["calibrate", str(half_file), "--data", "digits", *CALIBRATE, "--calibrate-memory", "3",
                 "-o", str(out)]) == 0  # fmt: skip
    said = capsys.readouterr()
    text = said.out + said.err
    assert "(--calibrate-memory)" in text and "memory=" not in text
    assert "holds at most 3 MiB" in text and "activations within 3 MiB of memory" in text
    assert main(["eval", str(out), "--data", "digits", "--steps", "native", "--max-batches", "1"]) == 0
    warned = " ".join(capsys.readouterr().err.split())
    assert "--calibrate-steps-set" in warned and "odeify.calibrate(" not in warned
