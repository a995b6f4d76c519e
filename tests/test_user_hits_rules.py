"""Depth and knot rules a user trips on, and messages that mislead (issue 49, cases 8, 11, 12, 14, 15).

Oracles: the stages' own block counts (``stage.depth``, read from the converted graph) and the
documented rules (a whole-model multiplier m gives a stage of L blocks round(m * L) steps, at least
one; one named stage is refused below half a step); the models' own outputs, compared exactly where
the rule says nothing changes; and what the user asked on the command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_files import train_checkpoint

import odeify
from odeify.cli.parser import main
from odeify.compiler.conversion import converted_stages
from odeify.compiler.knot_refinement import KnotRefinementWarning
from odeify.core.errors import ConfigError
from odeify.inspection.report import describe
from odeify.models._testing import make_test_model
from odeify.models.digits import load_digits

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["--input-size", "3", "64", "64"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# -- case 8: a depth multiplier for the whole model clamps, says so, and refuses a no-op -------------
def test_case8_whole_model_multiplier_clamps_each_stage_to_one_step(native) -> None:  # noqa: ANN001
    depths = {s.stage_name: s.depth for s in converted_stages(native)}
    assert all(d * 0.1 < 0.5 for d in depths.values())  # every stage below half a step: all clamped
    model = odeify.retarget(native, steps="x0.1")
    assert {s.stage_name: s.steps for s in converted_stages(model)} == dict.fromkeys(depths, 1)
    record = model.meta["odeify"]["steps_multiplier"]
    assert record["asked"] == "x0.1" and record["clamped"] == list(depths)
    assert record["steps"] == dict.fromkeys(depths, 1) and record["depths"] == depths
    report = describe(model).to_dict()["steps_multiplier"]
    assert report["clamped"] == list(depths)
    # one named stage asked for less than half a step is still refused
    first = next(iter(depths))
    with pytest.raises(ConfigError, match=f"gives stage '{first}'.*fewer than one"):
        odeify.retarget(native, steps={first: "x0.1"})
    # another steps request drops the record: it would describe steps the model no longer runs
    assert "steps_multiplier" not in odeify.retarget(model, steps=2).meta["odeify"]


def test_case8_cli_refuses_a_multiplier_that_changes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """resnet26t has one identity block per stage: x0.5 and x0.33 would both write the input again."""
    for multiplier in ("x0.5", "x0.33"):
        assert main(["convert", "resnet26t", *SMALL, "--steps", multiplier]) == 2
        err = capsys.readouterr().err
        assert f"steps='{multiplier}' changes nothing" in err and "every stage has one block" in err


def test_case8_cli_says_what_a_multiplier_became(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """convnext_atto's 2-block stages at x0.33: 1 step each (0.66 rounds up); the log, the report (JSON
    and the table of `inspect`) and the saved file say so, in steps per stage and in all."""
    out = tmp_path / "cnx.safetensors"
    assert main(["convert", "convnext_atto", *SMALL, "--steps", "x0.33", "-o", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    model = odeify.load(out)
    depths = {s.stage_name: s.depth for s in converted_stages(model)}
    expected = {name: max(1, round(0.33 * d)) for name, d in depths.items()}
    assert {s.stage_name: s.steps for s in converted_stages(model)} == expected
    assert 2 in depths.values() and expected != depths  # the 2-block stages took 1 step
    line = (
        f"steps x0.33: {sum(depths.values())} blocks -> {sum(expected.values())} steps in all "
        f"({', '.join(f'{n} {depths[n]} -> {s}' for n, s in expected.items())})"
    )
    assert line in captured.err
    assert json.loads(captured.out)["steps_multiplier"]["steps"] == expected
    assert model.meta["odeify"]["steps_multiplier"]["steps"] == expected  # the file kept it
    assert main(["inspect", str(out)]) == 0
    assert "steps x0.33:" in " ".join(capsys.readouterr().out.split())


# -- case 11: retarget reports the error of the weights the model reads, and the stages left alone ---
def test_case11_retarget_reports_what_each_stage_reads(
    tmp_path: Path,
    image,
    capsys: pytest.CaptureFixture[str],  # noqa: ANN001
) -> None:
    """2 linear knots of a 2-block stage are its blocks at its 2 Euler steps: it computes as before;
    the 6-block stage's error is that of its 6 reads, t = k / 6, of the 2 linear knots (at 0 and 1/2,
    held after the last) against block k, computed here from the saved knots."""
    source = make_test_model("convnext_atto")
    path, out = tmp_path / "cnx.safetensors", tmp_path / "cnx2.safetensors"
    odeify.save(odeify.convert(source, input_size=(3, 64, 64)), path)
    assert main(["retarget", str(path), "-o", str(out), "--knots", "2", "--basis", "linear", "--json"]) == 0
    captured = capsys.readouterr()
    changes = {c["stage"]: c for c in json.loads(captured.out)["changes"]}
    inputs: dict[str, torch.Tensor] = {}  # each stage's input, from the source network
    for name in changes:
        source.get_submodule(name).register_forward_pre_hook(lambda m, a, n=name: inputs.setdefault(n, a[0]))
    old = {s.stage_name: s for s in converted_stages(odeify.load(path))}
    new = {s.stage_name: s for s in converted_stages(odeify.load(out))}
    with torch.no_grad():
        source(image((2, 3, 64, 64)))
        computes_as_before = {n: torch.equal(old[n](x), new[n](x)) for n, x in inputs.items()}
    assert sorted(computes_as_before.values()) == [False, True, True, True]  # convnext_atto: 2, 2, 6, 2
    for name, change in changes.items():
        assert change["left_as_it_is"] is computes_as_before[name], name
        if computes_as_before[name]:
            assert (
                change["fit_error"] == 0
                and f"{name}: basis constant -> linear; left as it is" in captured.err
            )
            continue
        depth = old[name].depth
        error = total = 0.0
        for k in range(depth):
            t = k / depth
            for before, after in zip(old[name].knot_tensors(), new[name].knot_tensors(), strict=True):
                read = after[1] if t >= 0.5 else (1 - 2 * t) * after[0] + 2 * t * after[1]
                error += float((read.double() - before[k].double()).pow(2).sum())
                total += float(before[k].double().pow(2).sum())
        assert change["fit_error"] == pytest.approx((error / total) ** 0.5, rel=1e-6)
        assert change["evaluation_times"] == depth


# -- case 12: more knots than blocks warns in Python, once, and the CLI says it once ----------------
def test_case12_more_knots_than_blocks_warns_once(native, tmp_path: Path) -> None:  # noqa: ANN001
    x = load_digits("test")[0][:64]
    with pytest.warns(KnotRefinementWarning) as said:
        moved = odeify.retarget(native, knots=5)  # layer1 has 4 blocks, layer2 3: neither divides 5
    assert len([w for w in said if w.category is KnotRefinementWarning]) == 1
    assert "computes something else" in str(said[0].message)
    with torch.no_grad():
        assert not torch.equal(moved(x), native(x))  # what the warning says: the model changed
    with pytest.warns(KnotRefinementWarning) as said:
        doubled = odeify.retarget(native, knots={"layer1": 8})  # a multiple: only more parameters
    assert "computes something else" not in str(said[0].message)
    with torch.no_grad():
        assert torch.equal(doubled(x), native(x))
    # the command line prints the library's warning, once, and none of its own beside it
    path = tmp_path / "digits.safetensors"
    odeify.save(native, path)
    argv = ["retarget", str(path), "-o", str(tmp_path / "five.safetensors"), "--knots", "5"]
    done = subprocess.run([sys.executable, "-m", "odeify", *argv], capture_output=True, text=True, env=ENV)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("knots for") == 2 and done.stderr.count("odeify: warning:") == 1


# -- case 15: convert --ema says once which weights it took -----------------------------------------
def test_case15_convert_ema_names_the_weights_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = train_checkpoint(make_test_model("resnet18", num_classes=7), tmp_path, "resnet18", 7)
    assert main(["convert", str(path), "--ema", "--input-size", "3", "32", "32"]) == 0
    captured = capsys.readouterr()
    assert (captured.out + captured.err).count(f"using the EMA weights ('state_dict_ema') of {path}") == 1


# -- case 14: what finetune's log and files say ------------------------------------------------------
def _val_accuracy(model: torch.nn.Module, data) -> float:  # noqa: ANN001
    """A plain argmax loop over the validation split (not odeify.train.evaluate)."""
    loader = torch.utils.data.DataLoader(data.val, batch_size=256)
    with torch.no_grad():
        right = sum(int((model.eval()(x).argmax(1) == y).sum()) for x, y in loader)
    return right / len(data.val)


def test_case14_finetune_says_what_each_accuracy_is(native, digits, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """At one step per stage the run calibrates first: the log gives the file's own accuracy before
    calibration, labels epoch 0 as after it, the teacher's score as the teacher's, names the command
    line's flags and no Python argument; summary.csv holds no float noise; --help says a flag left out
    takes the file's recorded augmentation."""
    path, run = tmp_path / "digits.safetensors", tmp_path / "run"
    odeify.save(native, path)
    argv = ["finetune", str(path), "--data", "digits", "--steps", "1", "--max-batches", "2", "--batch-size",
            "16", "--epochs", "1", "--out", str(run)]  # fmt: skip
    assert main(argv) == 0
    log = " ".join(capsys.readouterr().out.split())
    given = _val_accuracy(odeify.retarget(native, steps=1), digits)
    assert f"the model as given (before calibration): val accuracy {given:.2%}" in log
    start = json.loads((run / "history.json").read_text())[0]["val_accuracy"]
    assert f"epoch 0 (after calibration, before fine-tuning): val accuracy {start:.2%}" in log
    assert f"from the teacher; the teacher's own val accuracy {_val_accuracy(native, digits):.2%}" in log
    assert "--no-calibrate" in log and "calibrate_first" not in log and "calibrate_objective" not in log
    for row in (run / "summary.csv").read_text().splitlines()[1:]:
        for cell in row.split(",")[1:]:
            assert len(cell.lstrip("-0.").replace(".", "").split("e")[0]) <= 8, row  # 8 significant digits
    assert main(["finetune", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "A flag left out takes the value the model's file recorded for its source's training" in help_text
