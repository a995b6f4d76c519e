"""The ``odeify`` command: every command on the shipped model, in-process and in a subprocess.

The oracles are independent of the CLI: the source model's own outputs and accuracy computed
here, the integrators' evaluation counts (stages x steps), the block counts of the timm model,
and the Python API where the CLI only fronts it. Bad input must end with exit code 2 and one
paragraph, never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from precision import as_float64, assert_as_accurate_as

import odeify
from odeify.cli.parser import main
from odeify.core.errors import ConfigError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models.digits import load_digits

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["--input-size", "3", "64", "64"]
RESNET18_RUNS = {"layer1": 2, "layer2": 1, "layer3": 1, "layer4": 1}
COMMANDS = ["inspect", "convert", "retarget", "finetune", "eval", "sweep", "plot", "demo", "list"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
PNG = b"\x89PNG\r\n\x1a\n"


def _rows(text: str) -> list[list[str]]:
    """The body rows of rich tables in ``text``, as lists of stripped cells."""
    return [
        [c.strip() for c in line.strip().strip("│").split("│")] for line in text.splitlines() if "│" in line
    ]


@pytest.fixture(scope="module")
def source() -> torch.nn.Module:
    return odeify.load_model(DEFAULT_MODEL_PATH)


@pytest.fixture(scope="module")
def converted_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "digits_ode.safetensors"
    assert main(["convert", "-o", str(path)]) == 0
    return path


def digits_accuracy(model: torch.nn.Module) -> float:
    """The digits test accuracy by a plain argmax loop (not odeify.train.evaluate)."""
    x, y = load_digits("test")
    with torch.no_grad():
        return (model.eval()(x).argmax(1) == y).double().mean().item()


# -- help, version -----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"usage: odeify {command}" in out
    if command != "list":
        assert "examples:" in out and f"odeify {command}" in out.split("examples:")[1]


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(command in out for command in COMMANDS) and "examples:" in out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().err


def test_help_version_and_list_do_not_import_torch() -> None:
    """`odeify --help`, `--version` and `list` answer without importing torch or timm."""
    code = (
        "import sys, contextlib, io\n"
        "from odeify.cli.parser import main\n"
        "out = io.StringIO()\n"
        "for argv in (['--help'], ['list'], ['--version']):\n"
        "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "print(sorted(m for m in ('torch', 'timm') if m in sys.modules))\n"
        "print(out.getvalue().splitlines()[-1])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported, version = done.stdout.strip().splitlines()
    assert imported == "[]"
    assert version.startswith(f"odeify {odeify.__version__} (torch {torch.__version__.split('+')[0]}")


# -- inspect a source model --------------------------------------------------------------------------
def test_inspect_resnet18_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "resnet18", *SMALL]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    runs = {r[0]: int(r[2]) for r in rows if r[0] in RESNET18_RUNS and len(r) == 9}
    assert runs == RESNET18_RUNS
    layer1 = next(r for r in rows if r[0] == "layer1")
    assert layer1[3:8] == ["1", "identity", "post-activation", "ReLU", "64x16x16"]  # period 1
    discrete = [r for r in rows if r[1:2] == ["projection"]]
    assert [r[0] for r in discrete] == ["layer2.0", "layer3.0", "layer4.0"]


def test_inspect_vit_code_shows_the_split_steps(capsys: pytest.CaptureFixture[str]) -> None:
    """The acceptance line: vit_tiny (random weights, 224x224) is one split stage; --code names each
    sub-step's state: step n, sub-step k, sub-field F_i (attention F1, MLP F2)."""
    assert main(["inspect", "vit_tiny_patch16_224", "--code"]) == 0
    captured = capsys.readouterr()
    caption = " ".join(captured.err.split())  # the table wraps its caption to the console's width
    assert "1 runs (1 of them split stages), 24 identity blocks become ODE stages" in caption
    for state in ("blocks_add_s0_1_F1 =", "blocks_add_s0_2_F2 =", "blocks_add_s11_2_F2 ="):
        assert state in captured.out, state


def test_convert_a_timm_name_without_weights_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    """Verify's source and the converted model are built from one seed: they were two random draws
    (resnet18 at 64x64: relative error 1.46, exit 1); now round-off (measured 3.9e-7)."""
    assert main(["convert", "resnet18", *SMALL, "--json"]) == 0
    check = json.loads(capsys.readouterr().out)["verify"]
    assert check["passed"] and check["relative_error"] <= 1e-5, check


def test_inspect_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "resnet18", *SMALL, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # nothing but JSON on stdout
    assert {run["name"]: run["length"] for run in data["runs"]} == RESNET18_RUNS
    assert data["input_shape"] == [1, 3, 64, 64]
    assert len(data["discrete"]) == 3


def _check_dot(dot: str, clusters: int) -> set[str]:
    """Balanced braces, the expected clusters, and edges between declared nodes; returns the nodes."""
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', dot)
    assert unquoted.count("{") == unquoted.count("}")
    assert len(re.findall(r"subgraph cluster_\w+ \{", dot)) == clusters
    declared = set(re.findall(r'^\s*"(\w+)" \[label=', dot, re.M))
    edges = re.findall(r'^\s*"(\w+)" -> "(\w+)"', dot, re.M)
    assert edges and all(a in declared and b in declared for a, b in edges)
    return declared


def test_inspect_dot_draws_traced_and_converted_graphs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "resnet18.dot"
    assert main(["inspect", "resnet18", *SMALL, "--dot", str(path), "--json"]) == 0
    json.loads(capsys.readouterr().out)  # the DOT notice goes to stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resnet18.converted.dot", "resnet18.dot"]
    dot = path.read_text()
    assert dot.startswith('digraph "resnet18" {')
    assert {"x", "output"} <= _check_dot(dot, clusters=4)
    assert 'label="layer1 (2 blocks)"' in dot and 'label="layer4 (1 block)"' in dot
    assert dot.count("style=dashed") == sum(RESNET18_RUNS.values())  # one skip edge per identity block
    converted = (tmp_path / "resnet18.converted.dot").read_text()
    _check_dot(converted, clusters=4)
    assert "layer1: euler, 2 steps, 2 constant knots, backward backprop" in converted


def test_leaf_keeps_a_class_opaque(capsys: pytest.CaptureFixture[str]) -> None:
    """With every BasicBlock a leaf the tracer sees no residual add: nothing to convert."""
    assert main(["inspect", "resnet18", *SMALL, "--leaf", "BasicBlock"]) == 2
    assert "no residual block" in capsys.readouterr().err


# -- convert -----------------------------------------------------------------------------------------
def test_convert_writes_a_verified_file(
    converted_file: Path, source: torch.nn.Module, capsys: pytest.CaptureFixture[str]
) -> None:
    path = converted_file.with_name("again.safetensors")
    assert main(["convert", "-o", str(path)]) == 0
    err = capsys.readouterr().err
    printed = float(re.search(r"max relative error (\S+) ", err).group(1))
    x = torch.randn((1, 1, 32, 32), generator=torch.Generator().manual_seed(0))
    loaded = odeify.load(path)
    with torch.no_grad():
        expected, got = source(x), loaded(x)
    relative = ((got - expected).abs().max() / expected.abs().max()).item()
    assert printed == pytest.approx(relative, rel=1e-2, abs=1e-12)  # what it prints is what the file does
    assert "): ok" in err
    check = odeify.convert(source, input_size=(1, 32, 32)).meta["odeify"]["verification"]
    allowance = check["tolerance"] if isinstance(check, dict) else check.tolerance
    assert f"allowance {allowance:.3g}," in err  # the figure judged by, not rounded to one digit
    with torch.no_grad():
        exact = as_float64(source)(x.double())
    assert_as_accurate_as({"y": got}, {"y": expected}, {"y": exact}, 2.0)  # measured 0.18x of the 8-ulp floor
    assert digits_accuracy(loaded) == digits_accuracy(source)


@pytest.mark.parametrize(
    ("argv", "inert"),
    [
        (["resnet18", *SMALL], 8),  # timm zero-initialises every BasicBlock's bn2 weight
        (["convnext_atto", *SMALL], 12),  # LayerScale gammas start at 1e-6
        (["vit_tiny_patch16_224", "--model-kwargs", "img_size=32", "depth=2", "--img-size", "32"], 0),
        ([], 0),  # the shipped, trained digits model
    ],
)
def test_convert_names_the_scales_that_silence_branches(
    argv: list[str], inert: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The note beside the check is measured on the source, not assumed of every random-weight model
    (a random ViT's or MobileNetV2's branches are not silent)."""
    assert main(["convert", *argv]) == 0
    note = re.search(r"note: (\d+) scale parameters of the source are zero", capsys.readouterr().err)
    assert (int(note.group(1)) if note else 0) == inert


def test_verify_fails_on_a_wrong_conversion(source: torch.nn.Module) -> None:
    native = odeify.convert(str(DEFAULT_MODEL_PATH))
    with torch.no_grad():
        native.get_parameter("layer1_ode.knots.conv2_bias")[1] += 0.05
    check = odeify.verify(native, source, (1, 1, 32, 32))
    x = torch.randn((1, 1, 32, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = source(x)
        relative = ((native(x) - expected).abs().max() / expected.abs().max()).item()
    assert not check.passed and check.relative_error == pytest.approx(relative)
    assert relative > 100 * check.tolerance
    assert odeify.verify(odeify.convert(str(DEFAULT_MODEL_PATH)), source).passed  # at the traced size


def test_convert_manifestation_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rk4.safetensors"
    argv = [
        "convert",
        "-o",
        str(out),
        "--integrator",
        "rk4",
        "--steps",
        "2",
        "--knots",
        "2",
        "--json",
        "--code",
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(s["steps"], s["nfe"], s["knots"]) for s in data["stages"]] == [
        (2, 8, 2),
        (2, 8, 2),
    ]  # rk4: 4/step
    assert data["verify"]["passed"] and "def forward" in data["code"]
    expected = odeify.retarget(odeify.convert(str(DEFAULT_MODEL_PATH)), integrator="rk4", steps=2, knots=2)
    x = load_digits("test")[0][:16]
    with torch.no_grad():
        torch.testing.assert_close(odeify.load(out)(x), expected(x), rtol=0, atol=0)


def test_convert_steps_multiplier(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "--steps", "x2", "--json", "--no-verify"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["steps"] for s in data["stages"]] == [8, 6] and "verify" not in data


def test_convert_a_timm_training_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from checkpoint_files import train_checkpoint

    from odeify.models._testing import make_test_model

    path = train_checkpoint(make_test_model("resnet18", num_classes=7), tmp_path, "resnet18", 7)
    argv = [
        "convert",
        str(path),
        "--arch",
        "resnet18",
        "--num-classes",
        "7",
        "--ema",
        *SMALL,
        "-o",
        str(tmp_path / "o.safetensors"),
    ]
    assert main(argv) == 0
    assert "): ok" in capsys.readouterr().err
    assert odeify.load(tmp_path / "o.safetensors").num_classes == 7


# -- converted files: inspect, retarget, eval, sweep, plot -------------------------------------------
def test_inspect_a_converted_file(
    converted_file: Path, source: torch.nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(converted_file)]) == 0
    rows = {r[0]: r for r in _rows(capsys.readouterr().out)}
    depths = {"layer1": len(source.layer1), "layer2": len(source.layer2) - 1}  # layer2.0 projects
    assert {name: int(rows[name][2]) for name in depths} == depths
    assert rows["layer1"][4:7] == ["constant", "euler", "4"]

    dot, png = tmp_path / "g.dot", tmp_path / "path.png"
    assert main(["inspect", str(converted_file), "--json", "--dot", str(dot), "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["nfe"] == sum(depths.values())
    _check_dot(dot.read_text(), clusters=2)
    assert png.read_bytes().startswith(PNG)


def test_inspect_code_shows_every_integrator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "heun.safetensors"
    assert (
        main(["convert", "-o", str(path), "--integrator", "heun", "--backward", "checkpoint", "--no-verify"])
        == 0
    )
    capsys.readouterr()
    assert main(["inspect", str(path), "--code"]) == 0
    captured = capsys.readouterr()
    assert "def forward" in captured.out and "layer1_ode" in captured.out
    assert "stage 'layer1'" in captured.out and "stage 'layer2'" in captured.out  # memory-free: appended
    assert "ODE stages" in captured.err and "┃" not in captured.out  # the table went to stderr


def test_inspect_code_shows_what_its_help_says(capsys: pytest.CaptureFixture[str]) -> None:
    """--code's help: a backprop stage's steps are inlined in the model's code, nothing is listed after
    it; a memory-free stage is listed after it (above). It once promised "every backward mode"."""
    assert main(["inspect", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "in backward='backprop' is inlined" in help_text and "every backward mode" not in help_text
    assert main(["inspect", "resnet18", *SMALL, "--code"]) == 0  # converted at native depth: backprop
    out = capsys.readouterr().out
    assert "self.layer1_ode.knots.conv1_weight" in out  # the stage's steps, in the model's forward
    assert "# stage" not in out and "# segment" not in out


def test_retarget_a_converted_file(
    converted_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "e1.safetensors"
    assert (
        main(["retarget", str(converted_file), "-o", str(out), "--steps", "1", "--backward", "checkpoint"])
        == 0
    )
    stages = odeify.converted_stages(odeify.load(out))
    assert [(s.steps, s.backward, s.num_knots) for s in stages] == [
        (1, "checkpoint", 4),
        (1, "checkpoint", 3),
    ]


def test_eval_matches_an_independent_accuracy(
    converted_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", str(converted_file), "--data", "digits", "--steps", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    model = odeify.retarget(odeify.load(converted_file), steps=1)
    assert data["accuracy"] == pytest.approx(digits_accuracy(model))
    assert data["nfe"] == 2 and data["samples"] == len(load_digits("test")[1])
    assert data["seconds_per_batch"] > 0


def test_eval_says_what_a_depth_multiplier_became(
    converted_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """x0.1 of stages of 4 and 3 blocks rounds to 0 steps each: eval clamps both to one step and says
    so, as convert and retarget do, beside the per-stage steps it ran; a step count says nothing more."""
    depths = [s.depth for s in odeify.converted_stages(odeify.load(converted_file))]
    assert depths == [4, 3]
    assert main(["eval", str(converted_file), "--data", "digits", "--steps", "x0.1", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["nfe"] == 2
    assert "steps x0.1: 7 blocks -> 2 steps in all" in captured.err
    assert "clamped to one step" in captured.err and "4 -> 1" in captured.err and "3 -> 1" in captured.err
    assert main(["eval", str(converted_file), "--data", "digits", "--steps", "2", "--json"]) == 0
    assert "steps x" not in capsys.readouterr().err


def test_sweep_table_and_plot(
    converted_file: Path, source: torch.nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png, md = tmp_path / "sweep.png", tmp_path / "sweep.md"
    argv = [
        "sweep",
        str(converted_file),
        "--data",
        "digits",
        "--integrators",
        "euler,rk4",
        "--steps",
        "1,native",
    ]
    assert main([*argv, "--plot", str(png), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    rows = {(r[0], r[1]): r for r in (line.strip("| ").split(" | ") for line in out.splitlines()[2:])}
    assert {k: int(r[4]) for k, r in rows.items()} == {  # NFE: evaluations per step x steps, both stages
        ("euler", "1"): 2, ("euler", "native"): 7, ("rk4", "1"): 8, ("rk4", "native"): 28,
    }  # fmt: skip
    assert float(rows["euler", "native"][5]) == pytest.approx(100 * digits_accuracy(source), abs=0.005)
    assert md.read_text().strip() == out.strip() and png.read_bytes().startswith(PNG)
    assert {r[3] for r in rows.values()} == {odeify.load(converted_file).layer1_ode.basis}  # the model's
    linear_argv = [*argv[:4], "--integrators", "euler", "--steps", "1", "--knots", "2", "--basis", "linear"]
    assert main([*linear_argv, "--plot", str(png)]) == 0
    [row] = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    linear = odeify.retarget(odeify.load(converted_file), steps=1, knots=2, basis="linear")
    assert row[:4] == ["euler", "1", "2", "linear"]
    assert float(row[5]) == pytest.approx(100 * digits_accuracy(linear), abs=0.005)


def test_plot_weight_path(converted_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "path.png"
    assert main(["plot", str(converted_file), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(PNG)


@pytest.mark.parametrize("ema", [[], ["--ema-decay", "0.9"]], ids=["recipe", "ema"])
def test_finetune_then_eval(
    converted_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], ema: list[str]
) -> None:
    run = tmp_path / "run"
    argv = ["finetune", str(converted_file), "--data", "digits", "--steps", "1", "--epochs", "1",
            "--max-batches", "2", "--batch-size", "16", "--out", str(run), *ema]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "backward checkpoint" in captured.out and "distilling" in captured.out
    last = json.loads((run / "history.json").read_text())[-1]
    if ema:  # the saved model is the weight average; the last step's weights are validated too
        assert last["val_accuracy_raw"] is not None and "weight average" in captured.out
    assert main(["eval", str(run / "last.safetensors"), "--data", "digits", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == pytest.approx(last["val_accuracy"])
    assert main(argv) == 2  # the folder holds a run: continue it with --resume or pick another
    assert "--resume" in capsys.readouterr().err


# -- bad input ---------------------------------------------------------------------------------------
def _bad_inputs(tmp: Path, converted: Path) -> list[tuple[list[str], str]]:
    (tmp / "folder").mkdir(exist_ok=True)
    (tmp / "text.txt").write_text("not a model")
    if not (tmp / "fifo").exists():
        os.mkfifo(tmp / "fifo")
    (tmp / "no_val" / "train" / "a").mkdir(parents=True, exist_ok=True)
    out = str(tmp / "out.safetensors")
    tune = ["finetune", str(converted), "--data", "digits"]
    weights = tmp / "w.pth"
    if not weights.exists():
        torch.save(odeify.load_model(DEFAULT_MODEL_PATH).state_dict(), weights)
    from_weights = ["convert", str(weights), "--arch", "odeify.digits_resnet", "-o"]
    png, sweep = str(tmp / "g.png"), ["sweep", str(converted), "--data", "digits"]
    eval_digits = ["eval", str(converted), "--data", "digits"]
    return [
        # issue 18, part 2: what writing would destroy
        (["convert", "-o", str(tmp / "fifo")], "is a named pipe (FIFO), not a regular file"),
        ([*from_weights, str(weights)], "is also the input (MODEL)"),
        ([*from_weights, str(tmp / "m.pt")], "use "),
        (["retarget", str(converted), "-o", str(converted), "--steps", "1"], "is also the input (MODEL)"),
        (["inspect", str(converted), "--dot", str(converted)], "is also the input (MODEL)"),
        (["inspect", str(converted), "--dot", png, "--plot", png], "name the same file"),
        ([*sweep, "--plot", out, "--markdown", out], "name the same file"),
        # part 5: sizes from arguments, against a budget before anything is allocated
        (["inspect", "resnet18", "--input-size", "1", "9" * 11, "9" * 11], "ODEIFY_MAX_INPUT_BYTES"),
        (["convert", "resnet18", "--num-classes", "50000000", *SMALL], "ODEIFY_MAX_MODEL_BYTES"),
        # part 7: what was silently accepted
        (["convert", "-o", out, "-o", str(tmp / "other.safetensors")], "-o/--output is given twice"),
        (["convert", "--steps", "1", "--steps=2"], "--steps is given twice"),
        ([*eval_digits, "--data", "digits"], "--data/--data-dir is given twice"),
        ([*eval_digits, "--integ", "rk4", "--integrator", "heun"], "given twice"),
        (["convert", "", "-o", out], "MODEL is empty"),
        ([*tune, "--out", ""], "--out/--output is empty"),
        (["inspect", str(converted), "--dot", ""], "--dot is empty"),
        (["inspect", "resnet5O"], "resnet50"),  # a typo: the message suggests close names
        (["inspect", "vgg11", "--input-size", "3", "32", "32"], "no residual block"),
        # a ViT built at 32x32 is traced at its pretrained_cfg's 224 unless told: the fix, not 224 again
        (["inspect", "vit_tiny_patch16_224", "--model-kwargs", "img_size=32", "depth=1"], "`--img-size N`"),
        (["inspect", "resnet18", "--input-size", "3", "64"], "--input-size takes C H W"),
        (["inspect", "resnet18", "--input-size", "0", "64", "64"], "positive"),
        (["inspect", "resnet18", "--input-size", "1", "64", "64"], "channels"),
        (["inspect", "no/such/model.safetensors"], "not found"),
        (["inspect", str(tmp / "folder")], "folder"),
        (["inspect", str(tmp / "fifo")], "FIFO"),  # refused without opening it (which would block)
        (["inspect", "resnet18", *SMALL, "--leaf", "NoSuchBlock"], "--leaf NoSuchBlock"),
        (["convert", "--backward", "reversible", "-o", out], "reversible"),
        (["convert", "-o", str(tmp / "folder")], "is a folder"),
        (["convert", "-o", str(tmp / "text.txt" / "x.safetensors")], "is a file, not a folder"),
        (["convert", "-o", ""], "empty"),
        (["convert", str(converted), "-o", out], "already a converted model"),
        (["retarget", str(DEFAULT_MODEL_PATH), "-o", out, "--steps", "1"], "not a converted model"),
        (["retarget", str(converted), "-o", out], "at least one of"),
        (["retarget", str(tmp / "missing.safetensors"), "-o", out, "--steps", "1"], "does not exist"),
        (["eval", str(converted)], "--data is required"),
        (["eval", str(converted), "--data", str(tmp / "missing")], "does not exist"),
        (["eval", str(converted), "--data", str(tmp / "no_val")], "no val/ subfolder"),
        (["eval", "resnet18", *SMALL, "--data", "digits"], "1-channel"),
        (["plot", str(tmp / "text.txt")], "text.txt"),
        (["finetune", str(converted), "--out", str(tmp / "ft")], "--data is required"),
        ([*tune, "--resume", "--out", str(tmp / "none")], "cannot resume"),
        ([*tune, "--refine-at", "1", "--out", str(tmp / "r")], "refine_at"),
        ([*tune, "--out", str(tmp / "text.txt")], "is a file"),
        ([*tune, "--integrator", "rk4", "--backward", "reversible", "--out", str(tmp / "rv")], "reversible"),
    ]  # fmt: skip


def test_bad_input_exits_2_with_one_paragraph(
    converted_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failures = []
    before = converted_file.read_bytes()
    for argv, message in _bad_inputs(tmp_path, converted_file):
        code = main(argv)
        captured = capsys.readouterr()
        one_paragraph = captured.err.startswith("odeify: error: ") and captured.err.count("\n") == 1
        if code != 2 or not one_paragraph or message not in captured.err or captured.out:
            failures.append((argv, code, captured.err[-500:]))
    assert not failures, failures
    assert converted_file.read_bytes() == before and (tmp_path / "fifo").is_fifo()  # nothing replaced
    assert not (tmp_path / "w.pth").read_bytes().startswith(b"{")  # the input is still a torch file


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "resnet18", "--input-size", "3", "a", "64"],
        ["convert", "--steps", "x-1"],
        ["convert", "--steps", "0"],
        ["convert", "--knots", "two"],
        ["convert", "--integrator", "rk5"],
        ["finetune", "--data", "digits", "--lr", "nan"],
        ["finetune", "--data", "digits", "--epochs", "0"],
        ["finetune", "--data", "digits", "--refine-at", "two"],
        ["finetune", "--data", "digits", "--distill", "2"],
        ["finetune", "--data", "digits", "--ema-decay", "1"],
        ["sweep", "--data", "digits", "--integrators", "euler,nope"],
        ["sweep", "--data", "digits", "--steps", "1,,x0"],
        ["eval", "--data", "digits", "--batch-size", "-3"],
        ["eval", "--data", "digits", "--batch-size", str(2**63)],  # islice overflowed
        ["finetune", "--data", "digits", "--seed", "1e23"],
        ["finetune", "--data", "digits", "--seed", str(2**64)],  # torch.manual_seed overflowed
        ["convert", "--knots", "9" * 30],
        ["convert", "--steps", "9" * 30],
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "error:" in err and "Traceback" not in err


def test_names_print_as_text_never_as_markup(converted_file: Path, tmp_path: Path, capsys) -> None:
    """A file name with rich markup appears as typed in the table title (it used to be eaten)."""
    named = tmp_path / "[b]m.safetensors"
    named.write_bytes(converted_file.read_bytes())
    assert main(["inspect", str(named)]) == 0
    assert "[b]m.safetensors: ODE stages" in capsys.readouterr().out
    dollars = tmp_path / "a$b.safetensors"  # matplotlib reads $...$ as math
    dollars.write_bytes(converted_file.read_bytes())
    assert main(["plot", str(dollars), "-o", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes().startswith(PNG)


@pytest.mark.slow
def test_a_file_size_limit_names_the_file_it_stopped(converted_file: Path, tmp_path: Path) -> None:
    """Under `ulimit -f` 700 kB the first file past the limit is named: the best model (it keeps its
    source tensors beside the trained ones since issue 20) or the training state."""
    import resource

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (700_000, 700_000))

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "odeify", "finetune", str(converted_file), "--data", "digits",
            "--steps", "1", "--epochs", "1", "--max-batches", "1", "--out", str(out)]  # fmt: skip
    done = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=600, preexec_fn=limited)
    assert done.returncode == 2, done.stderr[-2000:]
    named = re.search(rf"cannot (write|access) {re.escape(str(out))}/(\S+): File too large", done.stderr)
    assert named and named[2] in ("best.safetensors", "train_state.safetensors"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_diverging_finetune_stops_with_the_step(converted_file: Path, tmp_path: Path, capsys) -> None:
    argv = ["finetune", str(converted_file), "--data", "digits", "--steps", "1", "--lr", "1e6",
            "--distill", "0", "--epochs", "1", "--max-batches", "20", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(r"fine-tuning stopped at epoch 1, batch \d+/20 \(optimizer step \d+\)", err), err
    assert err.count("\n") == 1 and not (tmp_path / "last.safetensors").exists()


# -- each command in a subprocess, as a user runs it -------------------------------------------------
def test_each_command_end_to_end_in_a_subprocess(tmp_path: Path) -> None:
    def odeify_cli(*argv: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "odeify", *argv], env=ENV, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, (argv, done.stderr[-3000:])
        assert "Traceback" not in done.stderr
        return done

    ode, coarse, run = tmp_path / "ode.safetensors", tmp_path / "e1.safetensors", tmp_path / "run"
    assert "): ok" in odeify_cli("convert", "-o", str(ode)).stderr
    odeify_cli("retarget", str(ode), "-o", str(coarse), "--steps", "1")
    assert json.loads(odeify_cli("inspect", str(coarse), "--json").stdout)["nfe"] == 2
    odeify_cli("plot", str(coarse), "-o", str(tmp_path / "path.png"))
    sweep = odeify_cli("sweep", str(ode), "--data", "digits", "--integrators", "heun", "--steps", "1",
                       "--plot", str(tmp_path / "sweep.png"))  # fmt: skip
    assert "| heun | 1 | native | constant | 4 |" in sweep.stdout
    tuned = odeify_cli("finetune", str(coarse), "--data", "digits", "--epochs", "1", "--max-batches", "2",
                       "--out", str(run))  # fmt: skip
    assert "epoch 1/1" in tuned.stdout and "backward checkpoint" in tuned.stdout
    result = json.loads(
        odeify_cli("eval", str(run / "best.safetensors"), "--data", "digits", "--json").stdout
    )
    assert result["nfe"] == 2 and 0.8 < result["accuracy"] <= 1
    assert all((tmp_path / name).read_bytes().startswith(PNG) for name in ("path.png", "sweep.png"))


@pytest.mark.slow
def test_demo_writes_its_report(tmp_path: Path) -> None:
    """Run again over an earlier demo's output (as a second `make demo` is), it replaces that run."""
    earlier = tmp_path / "finetune"
    earlier.mkdir()
    for name in ("best.safetensors", "last.safetensors", "train_state.safetensors", "history.json"):
        (earlier / name).write_bytes(b"an earlier demo's run")
    done = subprocess.run(
        [sys.executable, "-m", "odeify", "demo", "--out", str(tmp_path), "--epochs", "1"],
        env=ENV, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]  # the report counts reverse's fallbacks
    # captured output is not a terminal: a line per part, no bar redraws (as in `make demo > log`)
    assert "demo part 2/4: sweep" in done.stdout and "|" not in done.stderr, done.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", report)
    assert len(images) == 5 and all((tmp_path / name).read_bytes().startswith(PNG) for name in images)
    assert odeify.load(tmp_path / "finetune" / "best.safetensors") is not None
    assert not (tmp_path / "finetune.previous").exists()


def test_a_failed_demo_run_leaves_the_last_one(tmp_path: Path, monkeypatch) -> None:
    """A demo whose fine-tuning fails puts the last demo's run back where it was."""
    from odeify.cli import demo

    run = tmp_path / "finetune"
    run.mkdir()
    (run / "best.safetensors").write_bytes(b"the last run")

    def killed(*args, out, **kwargs):
        out.mkdir()
        (out / "best.safetensors").write_bytes(b"half written")
        raise RuntimeError("killed")

    monkeypatch.setattr(demo, "finetune", killed)
    native = odeify.convert(str(DEFAULT_MODEL_PATH))
    test = [next(iter(demo.DataLoader(demo.open_data("digits", native).val, batch_size=8)))]
    with pytest.raises(RuntimeError, match="killed"):
        demo._finetune(native, None, test, demo.DEFAULT_RECIPE, tmp_path)
    assert (run / "best.safetensors").read_bytes() == b"the last run"
    assert not (tmp_path / "finetune.previous").exists()


def test_demo_refuses_a_run_folder_holding_other_files(tmp_path: Path) -> None:
    """The demo replaces its own last run only: a file it did not write there is named, not deleted."""
    from odeify.cli.demo import _check_demo_run

    run = tmp_path / "finetune"
    run.mkdir()
    (run / "best.safetensors").write_bytes(b"run")
    (run / ".best.tmp-0123abcd.safetensors").write_bytes(b"a killed write")
    _check_demo_run(run)  # a run's files only: accepted
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"notes\.txt.*another --out"):
        _check_demo_run(run)
    assert (run / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(ConfigError, match="file"):
        _check_demo_run(tmp_path / "file")


def test_model_kwargs_build_a_bare_state_dicts_architecture(tmp_path: Path) -> None:
    """--model-kwargs (timm train.py's flag) builds the architecture a bare safetensors file needs:
    a 2-block ViT at 32x32 with 8x8 patches, converted and equal to timm's eager model in float64."""
    import safetensors.torch

    from odeify.models._testing import make_test_model

    kwargs = {"img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 10}
    source = make_test_model("vit_tiny_patch16_224", **kwargs)  # LayerNorm affines randomised
    weights = tmp_path / "vit.safetensors"
    safetensors.torch.save_file(source.state_dict(), str(weights))
    out = tmp_path / "vit_ode.safetensors"
    argv = ["convert", str(weights), "--arch", "vit_tiny_patch16_224", "--img-size", "32", "-o", str(out)]
    assert main([*argv, "--model-kwargs", "img_size=32", "patch_size=8", "depth=2"]) == 0
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        got, want = as_float64(odeify.load(out))(x), as_float64(source)(x)
    assert (got - want).norm() / want.norm() < 1e-12  # measured 0: native Lie-Trotter is the network


@pytest.mark.parametrize(
    ("items", "message"),
    [(["depth"], "KEY=VALUE"), (["num_classes=3"], "--num-classes"), (["depth=2", "depth=3"], "twice")],
)
def test_bad_model_kwargs_exit_2_naming_the_fix(
    items: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["convert", "vit_tiny_patch16_224", "-o", str(tmp_path / "x.safetensors"), "--model-kwargs"]
    assert main([*argv, *items]) == 2
    assert message in capsys.readouterr().err
