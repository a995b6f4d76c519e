"""Tests for the ``odeify`` command, run in-process through ``odeify.cli.main``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from odeify.cli import main

SMALL = ["--input-size", "3", "64", "64"]
RESNET18_RUNS = {"layer1": 2, "layer2": 1, "layer3": 1, "layer4": 1}


def _rows(text: str) -> list[list[str]]:
    """The body rows of rich tables in ``text``, as lists of stripped cells."""
    return [
        [c.strip() for c in line.strip().strip("│").split("│")] for line in text.splitlines() if "│" in line
    ]


def test_help_exits_zero_and_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "odeify inspect" in out and "odeify convert" in out
    assert main(["convert", "--help"]) == 0
    assert "--check" in capsys.readouterr().out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().err


def test_inspect_resnet18_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "resnet18", *SMALL]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    runs = {r[0]: int(r[2]) for r in rows if r[0] in RESNET18_RUNS and len(r) == 8}
    assert runs == RESNET18_RUNS
    layer1 = next(r for r in rows if r[0] == "layer1")
    assert layer1[3:7] == ["identity", "post-activation", "ReLU", "64x16x16"]
    assert "blocks that stay discrete" in out
    discrete = [r for r in rows if r[1:2] == ["projection"]]
    assert [r[0] for r in discrete] == ["layer2.0", "layer3.0", "layer4.0"]


def test_inspect_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "resnet18", *SMALL, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # nothing but JSON on stdout
    assert {run["name"]: run["length"] for run in data["runs"]} == RESNET18_RUNS
    assert data["input_shape"] == [1, 3, 64, 64]
    assert len(data["discrete"]) == 3


def test_inspect_dot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "resnet18.dot"
    assert main(["inspect", "resnet18", *SMALL, "--dot", str(path), "--json"]) == 0
    json.loads(capsys.readouterr().out)  # the DOT notice goes to stderr
    assert [p.name for p in tmp_path.iterdir()] == ["resnet18.dot"]  # no temporary file left behind
    dot = path.read_text()
    assert dot.startswith('digraph "resnet18" {') and dot.rstrip().endswith("}")
    assert len(re.findall(r"subgraph cluster_\w+ \{", dot)) == 4
    assert 'label="layer1 (2 blocks)"' in dot and 'label="layer4 (1 block)"' in dot
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', dot)
    assert unquoted.count("{") == unquoted.count("}")
    declared = set(re.findall(r'^\s*"(\w+)" \[label=', dot, re.M))
    edges = re.findall(r'^\s*"(\w+)" -> "(\w+)"', dot, re.M)
    assert edges and all(a in declared and b in declared for a, b in edges)
    assert {"x", "output"} <= declared
    assert dot.count("style=dashed") == sum(RESNET18_RUNS.values())  # one skip edge per identity block


def test_convert_digits_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "--check"]) == 0
    out = capsys.readouterr().out
    rows = {r[0]: r for r in _rows(out)}
    assert rows["layer1"][2] == rows["layer1"][6] == rows["layer1"][7] == "4"  # depth, steps, NFE
    assert rows["layer2"][7] == "3"
    match = re.search(r"max \|diff\| (\S+), relative (\S+)", out)
    assert match, out
    assert float(match.group(2)) < 1e-5  # exact at native depth, to fp32 round-off


def test_convert_json_rk4_with_check_and_code(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["convert", "--integrator", "rk4", "--steps", "2", "--knots", "2", "--json", "--check", "--code"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(s["steps"], s["nfe"], s["knots"]) for s in data["stages"]] == [(2, 8, 2), (2, 8, 2)]
    assert data["nfe"] == 16
    assert data["check"]["max_abs_diff"] > 0
    assert "def forward" in data["code"]


def test_convert_steps_multiplier(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "--steps", "x2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["steps"] for s in data["stages"]] == [8, 6]


def test_list_integrators_and_bases(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    rows = {r[0]: r for r in _rows(capsys.readouterr().out)}
    assert rows["rk4"][1:3] == ["4", "4"]
    assert "reversible" in rows["reversible_heun"][3]
    assert {"constant", "linear", "cubic"} <= rows.keys()
    assert main(["integrators", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {i["name"] for i in data["integrators"]} >= {"euler", "rk4", "reversible_heun"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "resnet5O"], "resnet50"),  # a typo: the message suggests close names
        (["inspect", "vgg11", "--input-size", "3", "32", "32"], "no residual block"),
        (["inspect", "resnet18", "--input-size", "3", "64"], "--input-size takes C H W"),
        (["inspect", "resnet18", "--input-size", "0", "64", "64"], "positive"),
        (["inspect", "resnet18", "--input-size", "1", "64", "64"], "channels"),
        (["inspect", "no/such/model.safetensors"], "not found"),
        (["convert", "--integrator", "rk5"], "unknown integrator"),
        (["convert", "--backward", "reversible"], "reversible"),
    ],
)
def test_errors_exit_2_with_one_paragraph(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("odeify: error: ") and captured.err.count("\n") == 1
    assert message in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "resnet18", "--input-size", "3", "a", "64"],
        ["convert", "--steps", "x-1"],
        ["convert", "--steps", "0"],
        ["convert", "--knots", "two"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_help_and_list_do_not_import_torch() -> None:
    """`odeify --help` and `odeify list` answer without importing torch or timm (seconds each)."""
    code = (
        "import sys, contextlib, io\n"
        "from odeify.cli import main\n"
        "for argv in (['--help'], ['list']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "print(sorted(m for m in ('torch', 'timm') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_public_names_resolve_lazily() -> None:
    import odeify
    import odeify.conversion

    assert odeify.convert is odeify.conversion.convert  # a function, not the module of the same stem
    assert set(odeify.__all__) <= set(dir(odeify))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        odeify.nope  # noqa: B018
