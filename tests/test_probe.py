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
from odeify.core.errors import ModelLoadError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models._testing import make_test_model
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
    assert recipe["version"] == 2
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


def test_a_file_saved_before_the_probe_still_loads(saved: Path, tmp_path: Path) -> None:
    recipe, tensors = _contents(saved)
    recipe = {k: v for k, v in recipe.items() if k != "probe"} | {"version": 1}
    plain = {k: v for k, v in tensors.items() if not k.startswith(PROBE_PREFIX)}
    old = odeify.load(_write(tmp_path / "v1.safetensors", recipe, plain))
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
