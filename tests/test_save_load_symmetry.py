"""What ``save`` writes, ``load`` reads: one schema on both sides (issue 18, part 3).

Each case is a model odeify can make that ``load`` would refuse once written. ``save`` must refuse
it before writing anything, naming the same problem as ``load`` does for that file; the oracle is
``load`` itself, run on the file written without save's checks (what save wrote before). And a
model that load accepts must save: a 5-channel model's 5-entry mean round-trips.
"""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from pathlib import Path

import pytest
import safetensors.torch
import timm.data
import torch

import odeify
from odeify.core.errors import OdeifyError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models._testing import make_test_model
from odeify.models.digits import digits_resnet
from odeify.serialization.file_recipe import recipe_of
from odeify.serialization.io import RECIPE_KEY

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits() -> torch.nn.Module:
    return odeify.convert(str(DEFAULT_MODEL_PATH))


def _unchecked(model: torch.nn.Module, path: Path) -> Path:
    """The file save wrote before it checked: the tensors and the recipe, as they are."""
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    body = json.dumps(recipe_of(model).to_body())  # NaN allowed: a crafted file may hold one
    path.write_bytes(safetensors.torch.save(tensors, metadata={RECIPE_KEY: body}))
    return path


def _tableau(name: str, a: list, b: list, order: int = 1) -> odeify.Tableau:
    return odeify.Tableau.create(name, a, b, order=order)


def _wide(digits):
    return odeify.retarget(digits, integrator=_tableau("wide", [[0] * 17] * 17, ["1/17"] * 17))


def _long_digits(digits):
    q = 10**30 + 7
    return odeify.retarget(digits, integrator=_tableau("long", [[0, 0], [1, 0]], [f"1/{q}", f"{q - 1}/{q}"]))


def _renamed(name: str) -> odeify.Tableau:
    """A tableau whose name was changed after ``Tableau.create`` checked it (which refuses these names)."""
    return dataclasses.replace(_tableau("mine", [[0]], [1]), name=name)


def _long_name(digits):
    return odeify.retarget(digits, integrator=_renamed("x" * 65))


def _newline_name(digits):
    return odeify.retarget(digits, integrator=_renamed("mine\nimport os"))


def _head_200000(digits):
    model = odeify.retarget(digits, steps=1)
    model.reset_classifier(200_000)
    return model


def _nan_knot(digits):
    model = odeify.retarget(digits, steps=1)
    with torch.no_grad():
        model.get_parameter("layer1_ode.knots.conv1_weight")[0, 0, 0, 0, 0] = float("nan")
    return model


def _batch_65(digits):
    return odeify.convert(str(DEFAULT_MODEL_PATH), input_size=(65, 1, 32, 32))


def _mixed_dtype(digits):
    model = odeify.retarget(digits, steps=1)
    model.fc.double()
    return model


def _image_5000(digits):
    return odeify.convert(digits_resnet(img_size=5000))  # img_size over a file's bound: no arch, and H > 4096


def _license_5k(digits):
    model = odeify.retarget(digits, steps=1)
    model.pretrained_cfg = {**model.pretrained_cfg, "license": "x" * 5000}
    return model


def _nan_crop(digits):
    model = odeify.retarget(digits, steps=1)
    model.pretrained_cfg = {**model.pretrained_cfg, "crop_pct": float("nan")}
    return model


CASES = {
    "a head of 200000 classes": (_head_200000, "'num_classes' must be an integer in [0, 100000]"),
    "a NaN knot": (_nan_knot, "layer1_ode.knots.conv1_weight holds non-finite values (NaN or inf)"),
    "an example batch of 65": (_batch_65, "input_shape must be [N, C, H, W] with N <= 64"),
    "a tableau of 17 stages": (_wide, "a tableau has 1 to 16 stages"),
    "a tableau with 30-digit fractions": (_long_digits, "at most 20 digits each"),
    "a tableau named with 65 characters": (_long_name, "a tableau name is a Python name of 1 to 64"),
    "a tableau name with a newline": (_newline_name, "a tableau name is a Python name"),
    "a float64 head on a float32 model": (
        _mixed_dtype,
        "fc.weight is torch.float64, the model needs torch.float32",
    ),
    "an image size of 5000": (_image_5000, "H, W <= 4096"),
    "a 5000-character license": (_license_5k, "'license' must be a short text"),
    "a NaN crop_pct": (_nan_crop, "'crop_pct' must be a number in [0.5, 2.0], not nan"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_refuses_what_load_refuses_with_the_same_words(digits, tmp_path: Path, case: str) -> None:
    make, problem = CASES[case]
    model = make(digits)
    target = tmp_path / "m.safetensors"
    with pytest.raises(OdeifyError) as saving:
        odeify.save(model, target)
    assert not target.exists()  # refused before anything was written
    said = str(saving.value)
    assert said.startswith(f"odeify.save refuses to write {target}: ") and problem in said, said
    shared = said.split(": ", 1)[1].rsplit("; odeify.load would refuse", 1)[0]
    with pytest.raises(OdeifyError) as loading:
        odeify.load(_unchecked(model, tmp_path / "unchecked.safetensors"), model=_source_for(case))
    assert shared in str(loading.value), (shared, str(loading.value))


def _source_for(case: str):
    """load(model=...) where the file cannot name its source (as save's warning says to)."""
    return digits_resnet(img_size=5000) if case == "an image size of 5000" else None


def test_a_model_load_accepts_saves(tmp_path: Path) -> None:
    """A 5-channel model with a mean and std per channel (the loader allowed 4 entries)."""
    source = make_test_model("resnet18", in_chans=5, num_classes=7)
    source.pretrained_cfg = {**source.pretrained_cfg, "mean": (0.5,) * 5, "std": (0.25,) * 5}
    model = odeify.convert(source, input_size=(1, 5, 32, 32))
    odeify.save(model, tmp_path / "five.safetensors")
    loaded = odeify.load(tmp_path / "five.safetensors")
    assert timm.data.resolve_model_data_config(loaded)["mean"] == (0.5,) * 5
    x = torch.randn(2, 5, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_the_largest_values_a_file_may_hold_round_trip(digits, tmp_path: Path) -> None:
    """At the bounds themselves: 16 tableau stages, 20-digit entries, a 64-character name."""
    q = 10**19 + 9
    tableau = _tableau("y" * 64, [[0] * 16] * 16, [f"1/{q}"] * 15 + [str(Fraction(1) - 15 * Fraction(1, q))])
    model = odeify.retarget(digits, integrator=tableau, steps=1)
    odeify.save(model, tmp_path / "m.safetensors")
    assert odeify.converted_stages(odeify.load(tmp_path / "m.safetensors"))[0].integrator == tableau


def test_convert_of_a_checkpoint_with_nan_weights_writes_nothing(tmp_path: Path, capsys) -> None:
    from odeify.cli.parser import main

    model = odeify.load_model(DEFAULT_MODEL_PATH)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["fc.weight"][0, 0] = float("inf")
    torch.save(state, tmp_path / "w.pth")
    out = tmp_path / "w.safetensors"
    assert main(["convert", str(tmp_path / "w.pth"), "--arch", "odeify.digits_resnet", "-o", str(out)]) == 2
    assert "fc.weight holds non-finite values" in capsys.readouterr().err
    assert not out.exists()
