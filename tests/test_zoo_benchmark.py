"""benchmarks/zoo.py's machinery (not the sweep): a child's row, phase by phase; the parent's watch
over children that time out, die or grow past the memory limit; the CSV and Markdown it writes.

Oracles: resnet18's own structure (runs 2, 1, 1, 1 of its 8 blocks, whose 8 joins are all residual
adds), the source's float64 copy (the fp32 difference is judged against the source's own fp32
round-off measured in the same run), odeify's refusal of a network without residual blocks, and
children whose end the test decides (a sleep, an exit, an allocation).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import zoo  # noqa: E402


def python(code: str) -> list[str]:
    """A stand-in child: a Python that runs ``code``."""
    return [sys.executable, "-c", code]


def report(row: dict) -> str:
    """Code with which a stand-in child reports ``row`` as a real child does."""
    return f"print({json.dumps(json.dumps(row))}, flush=True)"


def plain_cnn(name: str, img_size: int | None) -> nn.Module:
    """A network without a residual block, which odeify refuses (in place of ``zoo.build``)."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()


def test_a_refusal_is_the_outcome_and_a_failing_phase_leaves_the_others_measured(monkeypatch) -> None:
    monkeypatch.setattr(zoo, "build", plain_cnn)
    row = zoo.Child(lambda row: None).run("plain", img_size=16)
    assert row["outcome"] == "refused"
    assert row["error"].startswith("NoResidualBlocksError: ")
    assert row["residual_adds"] == 0 and row["input_size"] == "3x16x16"
    assert "fp32_rel" not in row and row["phase"] == ""  # nothing converted to compare

    def broken(*args: object) -> int:
        raise RuntimeError("trace broke\nsecond line")

    monkeypatch.setattr(zoo, "residual_adds", broken)
    reports: list[dict] = []
    row = zoo.Child(lambda row: reports.append(dict(row))).run("plain", img_size=16)
    assert row["phase_errors"].startswith("trace: RuntimeError: trace broke [")  # first line, and where
    assert row["outcome"] == "refused" and "t_analyze" in row  # the phases after it still ran
    assert [r["phase"] for r in reports] == ["build", "trace", "analyze", "convert", ""]


def test_a_child_past_its_time_or_memory_or_that_dies_is_one_row() -> None:
    sleeper = python(report({"phase": "fp64", "outcome": "converted"}) + "; import time; time.sleep(60)")
    row = zoo.run_model(sleeper, timeout=1, memory_gib=4)
    assert row["outcome"] == "timeout" and row["error"] == "past 1 s in fp64"
    assert 1 <= row["seconds"] < 10

    grower = python("import time; x = b'1' * (400 * 2**20); time.sleep(60)")
    row = zoo.run_model(grower, timeout=60, memory_gib=0.2)
    assert row["outcome"] == "memory" and row["error"] == "past 0.2 GiB resident in start"
    assert row["peak_rss_mib"] > 0.2 * 1024

    huge = python("x = bytearray(20 * 2**30)")  # past the address-space limit: refused at once
    row = zoo.run_model(huge, timeout=60, memory_gib=1)
    assert row["outcome"] == "memory" and "MemoryError" in row["error"]

    dies = python(report({"phase": "save", "outcome": "converted", "fp32_rel": 1e-7}) + "; exit('boom')")
    row = zoo.run_model(dies, timeout=60, memory_gib=4)
    assert row["outcome"] == "died" and row["error"] == "exit 1 in save: boom"
    assert row["fp32_rel"] == 1e-7  # what it measured before it died is kept

    silent = python("pass")  # exits 0 without a word
    assert zoo.run_model(silent, timeout=60, memory_gib=4)["outcome"] == "died"


def test_a_sweep_writes_a_row_per_model_and_resumes(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "zoo"
    real = zoo.child_command

    def command(name: str, args) -> list[str]:  # resnet18 in a real child, the other dies at once
        return real(name, args) if name == "resnet18" else python("import os; os.abort()")

    monkeypatch.setattr(zoo, "child_command", command)
    arguments = ["--models", "resnet18,vit_tiny_patch16_224", "--img-size", "32", "--out", str(out)]
    assert zoo.main([*arguments, "--threads", "1", "--timeout", "300"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[1/2] resnet18 (resnet): converted, stages 2,1,1,1, adds 5/8, fp32 ")
    assert lines[1].startswith("[2/2] vit_tiny_patch16_224 (vision_transformer): died, exit -6 in start")
    with (tmp_path / "zoo.csv").open() as f:
        rows = list(csv.DictReader(f))
    resnet, vit = rows
    assert resnet["outcome"] == "converted" and resnet["stage_depths"] == "2,1,1,1"
    assert (resnet["deepest"], resnet["adds_in_stages"], resnet["residual_adds"]) == ("2", "5", "8")
    assert resnet["verify"] == "passed" and resnet["retarget"] == "ok" and resnet["save_load"] == "ok"
    assert float(resnet["fp64_rel"]) < 1e-12
    assert float(resnet["fp32_vs_roundoff"]) < 20  # a small multiple of the source's own round-off
    assert vit["outcome"] == "died" and vit["family"] == "vision_transformer"
    text = (tmp_path / "zoo.md").read_text()
    assert "- models: 2; converted 1, refused 0, traceback 0, timeout 0, memory 0, died 1" in text
    assert "- residual adds inside stages, in the converted models: 5 of the 8 residual adds" in text
    assert "| resnet18 | resnet | converted | 2,1,1,1 | 5 / 8 / 8 | passed | ok | ok |  |" in text
    assert "Command: `python benchmarks/zoo.py --models resnet18,vit_tiny_patch16_224" in text

    assert zoo.main([*arguments, "--resume"]) == 0  # both measured: nothing runs, the CSV stays
    assert capsys.readouterr().out == ""
    assert len((tmp_path / "zoo.csv").read_text().splitlines()) == 3
    assert zoo.main(["--out", str(out), "--readme-table"]) == 0
    deep_row = "| a stage deeper than one block (its depth): 1 | resnet (2) |"
    assert capsys.readouterr().out.splitlines()[2] == deep_row


@pytest.mark.parametrize("value", [float("nan"), None, 1.5e-7])
def test_csv_values_read_back(value) -> None:
    text = zoo.csv_value(value)
    assert zoo.number({"x": text}, "x") == (
        None if value is None else pytest.approx(value, nan_ok=True, rel=1e-3)
    )


def test_the_list_flag_with_models_names_them_with_their_family_and_size(capsys) -> None:
    assert zoo.main(["--models", "resnet18,convnext_atto,no_such_model", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["resnet18\tresnet\t11.69M", "convnext_atto\tconvnext\t3.70M", "no_such_model\t?\t"]


@pytest.mark.parametrize("flags", [["--img-size", "0"], ["--timeout", "0"], ["--memory-gib", "-1"]])
def test_limits_that_measure_nothing_are_refused(flags, capsys) -> None:
    with pytest.raises(SystemExit):
        zoo.parse_args(flags)
    assert "must be" in capsys.readouterr().err


def test_totals_and_the_readme_table_read_the_rows() -> None:
    def row(model: str, family: str, outcome: str = "converted", **values: str) -> dict:
        return {"model": model, "family": family, "outcome": outcome, **values}

    rows = [
        row("a", "f1", stages="2", deepest="3", blocks="4", residual_adds="6", adds_in_stages="4",
            verify="raised", fp64_rel="1e-12", save_load="ok", retarget="ok"),  # a false alarm
        row("b", "f1", stages="1", deepest="1", verify="raised", fp64_rel="1e-3", save_load="2.0e-03",
            retarget="ok"),  # a true one
        row("c", "f2", stages="0", deepest="0", save_load="ModelLoadError: no | stage", retarget="Error"),
        row("d", "f3", "refused", error="NoResidualBlocksError: none",
            phase_errors="analyze: NoResidualBlocksError: none"),
    ]  # fmt: skip
    text = "\n".join(zoo.totals(rows))
    assert "converted 3, refused 1" in text and "no ODE stage (no run lifted): 1 (c)" in text
    assert "VerificationErrors: 2 (a, b); false (the fp64 conversion agrees to 1e-09): 1 (a)" in text
    assert "round trips failed (models with stages): 1 of 2: b (2.0e-03)" in text  # c has no stage to save
    assert "retarget x0.5 failed (models with a stage deeper than one block): 0 of 1" in text
    assert zoo.readme_table(rows).splitlines()[2:] == [
        "| a stage deeper than one block (its depth): 1 | f1 (3) |",
        "| no stage: refused, or failed in this sweep: 2 | f2, f3 |",  # f2 converted with no stage
    ]
    table = zoo.model_rows(rows)
    assert table[2][7] == "ModelLoadError: no \\| stage"  # a pipe would end the cell
    assert table[3][4] == "- / - / -" and table[3][8] == "NoResidualBlocksError: none"  # not repeated


def test_a_failing_save_is_its_column_and_names_no_temporary_folder(monkeypatch) -> None:
    def refuse(model: nn.Module, path: Path) -> None:
        raise zoo.OdeifyError(f"{path} cannot be written")

    monkeypatch.setattr(zoo.odeify, "save", refuse)
    row = zoo.Child(lambda row: None).run("resnet18", img_size=32)
    assert row["save_load"] == "OdeifyError: <folder>/model.safetensors cannot be written"
    assert row["outcome"] == "converted" and row["retarget"] == "ok" and row["phase_errors"] == ""


def test_adds_inside_a_stages_blocks_count_as_in_stages() -> None:
    """DINOv3's rotary embedding adds ``q * cos + rotate(q) * sin`` inside every attention half: adds of
    two batch-computed tensors of one shape, which its stage integrates with the block's join."""
    import odeify
    from odeify.models._testing import make_test_model

    model = make_test_model("vit_tiny_patch16_dinov3_qkvb", img_size=32, depth=2)
    adds = zoo.residual_adds(model, (1, 3, 32, 32))
    plan = odeify.analyze(model, input_size=(1, 3, 32, 32))
    joins = {block.join for block in plan.blocks}
    assert len(joins) == 4 and joins < adds, "4 halves' joins, and the rotary adds besides"
    assert zoo.adds_inside(adds, plan.runs) == len(adds)
    assert zoo.adds_inside(adds, []) == 0
