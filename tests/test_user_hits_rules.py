"""Depth and knot rules a user trips on, and messages that mislead (issue 49, cases 8, 11, 12, 14, 15).

Oracles: the stages' own block counts (``stage.depth``, read from the converted graph) and the
documented rules (a whole-model multiplier m gives a stage of L blocks round(m * L) steps, at least
one; one named stage is refused below half a step); the models' own outputs, compared exactly where
the rule says nothing changes; and what the user asked on the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import odeify
from odeify.cli.parser import main
from odeify.compiler.conversion import converted_stages
from odeify.core.errors import ConfigError
from odeify.inspection.report import describe

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["--input-size", "3", "64", "64"]


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
