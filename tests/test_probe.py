"""The probe: a loaded file proves it computes what was saved, within round-off measured for its dtype.

Oracles: the float64 computation of the same weights (what both the saving and the loading float32
computations approximate), and a genuinely different float32 computation on this machine (the
convolutions with oneDNN switched off: another kernel, another rounding, as on another CPU).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import odeify
from odeify.cli.parser import main
from odeify.core.errors import ModelLoadError, OdeifyError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models._testing import make_test_model
from odeify.serialization.file_schema import PROBE_SOURCE
from odeify.serialization.io import RECIPE_KEY
from odeify.serialization.probe import FACTOR, PROBE_PREFIX

pytestmark = pytest.mark.usefixtures("one_thread")


def _contents(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as handle:
        recipe = json.loads(handle.metadata()[RECIPE_KEY])
    return recipe, safetensors.torch.load_file(str(path))


def _write(path: Path, recipe: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.write_bytes(safetensors.torch.save(tensors, metadata={RECIPE_KEY: json.dumps(recipe)}))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "digits.safetensors"
    odeify.save(odeify.retarget(odeify.convert(str(DEFAULT_MODEL_PATH)), integrator="heun", steps=2), path)
    return path


def test_save_records_each_stage_and_the_output_in_graph_order(saved: Path) -> None:
    recipe, tensors = _contents(saved)
    assert recipe["version"] == 3
    assert [name for name, _ in recipe["probe"]["points"]] == ["layer1", "layer2", "output"]
    assert all(error > 0 for _, error in recipe["probe"]["points"])
    assert tensors[PROBE_PREFIX + "output"].shape == (10,)  # batch 1, ten logits
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():  # the probe values are not what the model gives on another input
        assert not torch.equal(odeify.load(saved)(x)[0], tensors[PROBE_PREFIX + "output"])


def test_the_probe_check_allows_round_off_and_refuses_more(saved: Path, tmp_path: Path) -> None:
    """A saved value moved by half its recorded round-off still loads; by 10x FACTOR of it, refused there."""
    recipe, tensors = _contents(saved)
    error = dict(recipe["probe"]["points"])["layer2"]
    for scale, loads in ((0.5, True), (10 * FACTOR, False)):
        moved = {**tensors, PROBE_PREFIX + "layer2": tensors[PROBE_PREFIX + "layer2"] + scale * error}
        path = _write(tmp_path / f"moved_{scale}.safetensors", recipe, moved)
        if loads:
            odeify.load(path)
        else:
            with pytest.raises(ModelLoadError, match="at stage 'layer2'"):
                odeify.load(path)


def test_another_convolution_kernel_still_loads(tmp_path: Path) -> None:
    """Saved with oneDNN's convolutions, loaded with torch's own: other float32 bits, the same file.

    Measured on AMD EPYC (digits, resnet18, resnet50 at 64x64): the two float32 results differ by up
    to 2.8e-3 (resnet50 layer4), while each lies within 1.0x its measured round-off of float64.
    """
    model = odeify.convert(make_test_model("resnet18", num_classes=10), input_size=(1, 3, 64, 64))
    odeify.save(model, tmp_path / "r18.safetensors")
    _, tensors = _contents(tmp_path / "r18.safetensors")
    x = torch.randn((1, 3, 64, 64), generator=torch.Generator().manual_seed(0))
    with torch.backends.mkldnn.flags(enabled=False), torch.no_grad():
        loaded = odeify.load(tmp_path / "r18.safetensors")
        other = loaded(x)
    with torch.no_grad():
        assert not torch.equal(other, model(x))  # really another rounding
    assert tensors[PROBE_PREFIX + "layer1"].numel() == 4096  # 64 x 16 x 16 values, evenly subsampled
    assert tensors[PROBE_PREFIX + "layer4"].numel() == 512 * 2 * 2  # all of them


def test_a_changed_function_is_far_past_round_off_and_named(saved: Path, tmp_path: Path) -> None:
    """Measured on AMD EPYC (digits model): 1.9e4x (rk4 for heun), 2.9e4x (gelu), 1.3e5x (max pooling)."""
    recipe, tensors = _contents(saved)
    for edit, where in (
        (lambda r: r["stages"][1].update(integrator="rk4"), "stage 'layer2'"),
        (lambda r: r["arch"]["kwargs"].update(global_pool="max"), "the model's output"),
        (lambda r: r["arch"]["kwargs"].update(act_layer="gelu"), "stage 'layer1'"),
    ):
        changed = json.loads(json.dumps(recipe))
        edit(changed)
        with pytest.raises(ModelLoadError, match=f"does not compute what was saved: at {where}") as info:
            odeify.load(_write(tmp_path / "changed.safetensors", changed, tensors))
        distance, allowed = map(
            float, re.search(r"is (\S+) from the saved one, over the (\S+) ", str(info.value)).groups()
        )
        assert distance > 1e3 * allowed


def test_a_file_saved_before_the_probe_loads_only_unchecked_on_request(saved: Path, tmp_path: Path) -> None:
    """Version 1 has no probe: a downgraded file (here with another activation) would skip the check."""
    recipe, tensors = _contents(saved)
    recipe = {k: v for k, v in recipe.items() if k != "probe"} | {"version": 1}
    plain = {k: v for k, v in tensors.items() if not k.startswith(PROBE_PREFIX)}
    path = _write(tmp_path / "v1.safetensors", recipe, plain)
    gelu = json.loads(json.dumps(recipe))
    gelu["arch"]["kwargs"]["act_layer"] = "gelu"
    for file in (path, _write(tmp_path / "v1_gelu.safetensors", gelu, plain)):
        with pytest.raises(ModelLoadError, match=r"older odeify \(format 1\) with no probe.*verify=False"):
            odeify.load(file)
    with pytest.warns(UserWarning, match="verify=False: its probe was not run"):
        old = odeify.load(path, verify=False)
    x = torch.randn(3, 1, 32, 32)
    with torch.no_grad():
        assert torch.equal(old(x), odeify.load(saved)(x))
    with pytest.raises(ModelLoadError, match="unknown recipe keys"):  # a version 1 file has no probe
        odeify.load(
            _write(tmp_path / "v1p.safetensors", {**recipe, "probe": {"seed": 0, "points": []}}, plain)
        )


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_round_trip_with_their_own_round_off(tmp_path: Path, dtype: torch.dtype) -> None:
    model = odeify.convert(make_test_model("odeify.digits_resnet").to(dtype))
    odeify.save(model, tmp_path / "m.safetensors")
    recipe, tensors = _contents(tmp_path / "m.safetensors")
    assert tensors[PROBE_PREFIX + "output"].dtype == dtype
    errors = [e for _, e in recipe["probe"]["points"]]
    # measured on AMD EPYC: float64 1e-14..5e-14, bfloat16 0.3..1.6 (float32: 5e-6..2.5e-5)
    assert max(errors) < 1e-10 if dtype == torch.float64 else min(errors) > 1e-2
    x = torch.randn(2, 1, 32, 32).to(dtype)
    with torch.no_grad():
        assert torch.equal(odeify.load(tmp_path / "m.safetensors")(x), model(x))


def test_saving_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    model = odeify.convert(make_test_model("odeify.digits_resnet", drop_path_rate=0.2)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    odeify.save(model, tmp_path / "m.safetensors")
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    odeify.load(tmp_path / "m.safetensors")  # the probe ran in eval mode: no DropPath draw in it


def test_a_probe_in_proportion_to_its_weights_passes_the_input_limit(tmp_path: Path, monkeypatch) -> None:
    """The input limit lowered to 100 kB, below what the digits model's probe holds at its 32x32 (0.5 MB,
    under 4x its 0.7 MiB of float64 weights): a model whose own forward needs that saves and loads. At
    128x128 (16x the activations, 8 MB) the same weights do not vouch for it: refused, as a file's."""
    monkeypatch.setenv("ODEIFY_MAX_INPUT_BYTES", "100000")
    model = odeify.convert(str(DEFAULT_MODEL_PATH))
    odeify.save(model, tmp_path / "m.safetensors")
    x = torch.randn(1, 1, 32, 32)
    with torch.no_grad():
        assert torch.equal(odeify.load(tmp_path / "m.safetensors")(x), model(x))
    wide = odeify.convert(str(DEFAULT_MODEL_PATH), input_size=(1, 128, 128))
    with pytest.raises(OdeifyError, match=r"the probe, on one 1x128x128 input .* its weights in float64"):
        odeify.save(wide, tmp_path / "wide.safetensors")


def _gelu(recipe: dict) -> None:
    recipe["arch"]["kwargs"]["act_layer"] = "gelu"


def _rk4(recipe: dict) -> None:
    recipe["stages"][1]["integrator"] = "rk4"


@pytest.mark.parametrize("edit", [_gelu, _rk4])
def test_the_allowance_is_measured_at_load_not_read_from_the_file(saved: Path, tmp_path: Path, edit) -> None:
    """Every point's recorded round-off raised to 1e300 does not let another function through."""
    recipe, tensors = _contents(saved)
    edit(recipe)
    recipe["probe"]["points"] = [[name, 1e300] for name, _ in recipe["probe"]["points"]]
    with pytest.raises(ModelLoadError, match="does not compute what was saved") as info:
        odeify.load(_write(tmp_path / "lax.safetensors", recipe, tensors))
    assert "the file says 1e+300 was measured when saving" in str(info.value)


@pytest.mark.parametrize("probe", ["deleted", None])
def test_a_current_file_without_its_probe_is_refused(saved: Path, tmp_path: Path, probe: None) -> None:
    recipe, tensors = _contents(saved)
    _gelu(recipe)
    if probe is None:
        recipe["probe"] = None
    else:
        del recipe["probe"]
    plain = {k: v for k, v in tensors.items() if not k.startswith(PROBE_PREFIX)}
    path = _write(tmp_path / "bare.safetensors", recipe, plain)
    for verify in (True, False):  # save always writes a probe: no caller can vouch for its absence
        with pytest.raises(ModelLoadError, match="has no probe, which odeify.save always writes"):
            odeify.load(path, verify=verify)


def test_a_probe_point_left_out_is_refused(saved: Path, tmp_path: Path) -> None:
    """Without its point, stage layer1 (here another integrator) would go unchecked until the output."""
    recipe, tensors = _contents(saved)
    recipe["stages"][0]["integrator"] = "rk4"
    recipe["probe"]["points"] = [p for p in recipe["probe"]["points"] if p[0] != "layer1"]
    fewer = {k: v for k, v in tensors.items() if k != PROBE_PREFIX + "layer1"}
    with pytest.raises(ModelLoadError, match="its probe checks stage 'layer2', the model's output, but"):
        odeify.load(_write(tmp_path / "fewer.safetensors", recipe, fewer))


def test_weights_that_overflow_leave_no_allowance(saved: Path, tmp_path: Path) -> None:
    """Every head weight 3e38: the float32 logits are inf, so the model's own round-off is inf."""
    recipe, tensors = _contents(saved)
    huge = {**tensors, "fc.weight": torch.full_like(tensors["fc.weight"], 3e38)}
    with pytest.raises(ModelLoadError, match="round-off at the model's output is inf.*overflows"):
        odeify.load(_write(tmp_path / "huge.safetensors", recipe, huge))


def test_one_probe_value_moved_is_refused(saved: Path, tmp_path: Path) -> None:
    """The distance is the largest over a point's values: one value of 512 moved by 10x the allowance
    is refused (a mean distance would be 10/512 = 0.02x the allowance)."""
    recipe, tensors = _contents(saved)
    error = dict(recipe["probe"]["points"])["layer2"]
    values = tensors[PROBE_PREFIX + "layer2"].clone()
    assert values.numel() == 512  # 32 channels x 4 x 4
    values[200] += 10 * FACTOR * error
    moved = {**tensors, PROBE_PREFIX + "layer2": values}
    with pytest.raises(ModelLoadError, match="at stage 'layer2'"):
        odeify.load(_write(tmp_path / "one.safetensors", recipe, moved))


@pytest.fixture(scope="module")
def compressed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two linear knots for each stage: the file keeps the source's blocks (source_* tensors)."""
    path = tmp_path_factory.mktemp("probe") / "linear2.safetensors"
    odeify.save(odeify.retarget(odeify.convert(str(DEFAULT_MODEL_PATH)), knots=2, basis="linear"), path)
    return path


def test_the_source_network_is_probed(compressed: Path, tmp_path: Path) -> None:
    """The source tensors are read by fine-tuning's teacher only: its output is a probe point."""
    recipe, tensors = _contents(compressed)
    assert [name for name, _ in recipe["probe"]["points"]][-1] == PROBE_SOURCE
    kept = "layer1_ode.source_conv1_weight"
    assert kept in tensors
    moved = {**tensors, kept: tensors[kept] * 1.01}  # 1% on one slot of the first stage's blocks
    with pytest.raises(ModelLoadError, match="at the source network's output"):
        odeify.load(_write(tmp_path / "teacher.safetensors", recipe, moved))


def test_an_older_file_with_unprobed_source_tensors_loads_only_unchecked(
    compressed: Path, tmp_path: Path
) -> None:
    """Format 2 did not probe the source network: such a file is not checked enough to load unasked."""
    recipe, tensors = _contents(compressed)
    recipe["version"] = 2
    recipe["probe"]["points"] = [p for p in recipe["probe"]["points"] if p[0] != PROBE_SOURCE]
    older = {k: v for k, v in tensors.items() if k != PROBE_PREFIX + PROBE_SOURCE}
    path = _write(tmp_path / "v2.safetensors", recipe, older)
    with pytest.raises(ModelLoadError, match=r"format 2\) or altered.*verify=False"):
        odeify.load(path)
    with pytest.warns(UserWarning, match="verify=False"):
        odeify.load(path, verify=False)


def test_the_cli_refuses_in_one_paragraph_and_no_verify_loads(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file without a probe and one with an altered fold record: exit 2, one paragraph naming the fix."""
    recipe, tensors = _contents(saved)
    plain = {k: v for k, v in tensors.items() if not k.startswith(PROBE_PREFIX)}
    old = {k: v for k, v in recipe.items() if k != "probe"} | {"version": 1}
    older = _write(tmp_path / "v1.safetensors", old, plain)
    zero = {**tensors, "folds.bn1.inv_std": torch.zeros_like(tensors["folds.bn1.inv_std"])}
    altered = _write(tmp_path / "zero.safetensors", recipe, zero)
    for path, message in ((older, "--no-verify"), (altered, "which no BatchNorm gives")):
        assert main(["inspect", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("odeify: error: ") and err.count("\n") == 1 and message in err, err
    assert main(["inspect", str(older), "--no-verify"]) == 0
    assert "loaded with verify=False" in capsys.readouterr().err  # loaded unchecked, and said so
    assert main(["inspect", str(altered), "--no-verify"]) == 2  # not a check the flag skips


def test_an_older_file_without_fold_records_loads_only_unchecked(saved: Path, tmp_path: Path) -> None:
    """Fold records came after format 2's probe: a format 3 file downgraded to 2 without them would
    have fine-tuning train its folded tensors directly (what the records exist to prevent)."""
    recipe, tensors = _contents(saved)
    bare = {k: v for k, v in tensors.items() if ".folds." not in f".{k}"}
    current = _write(tmp_path / "v3.safetensors", recipe, bare)
    with pytest.raises(ModelLoadError, match=r"holds no fold records .*The file was damaged or altered"):
        odeify.load(current, verify=False)
    older = _write(tmp_path / "v2.safetensors", recipe | {"version": 2}, bare)
    with pytest.raises(ModelLoadError, match=r"older odeify \(format 2\) or altered.*verify=False"):
        odeify.load(older)
    with pytest.warns(UserWarning, match="verify=False"):
        assert not any(".folds." in f".{k}" for k in odeify.load(older, verify=False).state_dict())
