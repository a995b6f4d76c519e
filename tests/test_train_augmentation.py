"""Fine-tuning augments as the source network was trained, where its file recorded how (issue 20).

timm's train.py records its augmentation settings in the checkpoint's ``args`` (``--hflip 0`` for
digits, which are not mirror-symmetric); a converted model keeps them as the data config entry
``train_augmentation``, saves and loads them, and ``open_data``/``odeify finetune`` use them unless
told otherwise. The oracle for the transform is timm's own ``create_transform`` with the same flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import timm.data
from checkpoint_files import train_checkpoint
from test_datasets import image_folder
from torch import nn

import odeify
from odeify.core.errors import ModelLoadError
from odeify.models._testing import make_test_model
from odeify.models.data_config import TRAIN_AUGMENTATION_KEYS as AUGMENTATION_FLAGS
from odeify.train.datasets import Augmentation, open_data, recorded_augmentation
from odeify.train.run_settings import augmentation

pytestmark = pytest.mark.usefixtures("one_thread")

# train.py's defaults for these settings, then what this user's run changed: --hflip 0 --scale 0.5 1
TRAIN_PY_AUGMENTATION = {
    "no_aug": False, "scale": [0.5, 1.0], "ratio": [3 / 4, 4 / 3], "hflip": 0.0, "vflip": 0.0,
    "color_jitter": 0.4, "aa": None, "reprob": 0.0,
}  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A train.py checkpoint of a 2-class resnet18 at 32x32 that records its augmentation, and data."""
    root = tmp_path_factory.mktemp("augmentation")
    model = make_test_model("resnet18", num_classes=2)
    path = train_checkpoint(model, root / "run", "resnet18", 2, img_size=32, **TRAIN_PY_AUGMENTATION)
    return path, image_folder(root / "data")


def _timm_transform(model: nn.Module, **flags: object) -> str:
    config = timm.data.resolve_model_data_config(model)
    return repr(timm.data.create_transform(**config, is_training=True, **flags))


def test_the_file_s_augmentation_is_the_default(trained: tuple[Path, Path]) -> None:
    path, folder = trained
    model = odeify.convert(str(path))
    assert recorded_augmentation(model) == {"no_aug": False, "scale": (0.5, 1.0), "ratio": (3 / 4, 4 / 3),
        "hflip": 0.0, "vflip": 0.0, "color_jitter": 0.4, "reprob": 0.0}  # fmt: skip
    data = open_data(folder, model)
    as_trained = _timm_transform(model, scale=(0.5, 1.0), hflip=0.0, color_jitter=0.4)
    assert repr(data.train.transform) == as_trained
    assert repr(data.train.transform) != _timm_transform(model)  # the oracle tells the two apart
    assert (
        data.augmentation.startswith("as the source was trained")
        and "--scale 0.5 1 --hflip 0" in data.augmentation
    )
    given = open_data(folder, model, Augmentation())  # an explicit augmentation replaces the file's
    assert repr(given.train.transform) == _timm_transform(model)


def test_saved_and_loaded_with_the_model(trained: tuple[Path, Path], tmp_path: Path) -> None:
    model = odeify.convert(str(trained[0]))
    odeify.save(odeify.retarget(model, steps=1), tmp_path / "m.safetensors")
    assert recorded_augmentation(odeify.load(tmp_path / "m.safetensors")) == recorded_augmentation(model)


def test_command_line_flags_change_only_what_they_name(trained: tuple[Path, Path]) -> None:
    model = odeify.convert(str(trained[0]))
    settings = argparse.Namespace(**{**dict.fromkeys(AUGMENTATION_FLAGS), "hflip": 0.5})
    assert augmentation(settings, model) == Augmentation(scale=(0.5, 1.0), hflip=0.5)
    assert augmentation(argparse.Namespace(**dict.fromkeys(AUGMENTATION_FLAGS)), model) is None


def test_the_log_says_which_settings_were_given_and_which_came_from_the_file(
    trained: tuple[Path, Path],
) -> None:
    path, folder = trained
    model = odeify.convert(str(path))
    settings = argparse.Namespace(**{**dict.fromkeys(AUGMENTATION_FLAGS), "hflip": 0.5})  # --hflip 0.5
    said = open_data(folder, model, augmentation(settings, model)).augmentation
    recorded = Augmentation(scale=tuple(TRAIN_PY_AUGMENTATION["scale"])).describe()  # the file's --scale
    file = "as the source was trained (its file records train.py's settings)"
    assert said == f"as given: --hflip 0.5; {file}: {recorded}"  # was "as given: --scale 0.5 1 --hflip 0.5"


def test_a_file_without_the_settings_gets_timm_s_defaults(tmp_path: Path) -> None:
    path = train_checkpoint(
        make_test_model("resnet18", num_classes=2), tmp_path / "run", "resnet18", 2, img_size=32
    )
    model = odeify.convert(str(path))
    data = open_data(image_folder(tmp_path / "data", train=2, val=2), model)
    assert recorded_augmentation(model) == {} and data.augmentation == "timm's defaults"
    assert repr(data.train.transform) == _timm_transform(model)


@pytest.mark.parametrize("setting", [{"hflip": 2.0}, {"scale": [0.0, 1.0]}, {"aa": "x" * 200}])
def test_an_unsound_recorded_setting_is_refused_where_the_file_is_read(setting: dict, tmp_path: Path) -> None:
    path = train_checkpoint(make_test_model("resnet18", num_classes=2), tmp_path, "resnet18", 2, **setting)
    with pytest.raises(ModelLoadError, match="train_augmentation"):
        odeify.convert(str(path))
