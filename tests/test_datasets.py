"""Data for finetune/eval/sweep: the built-in digits set and ImageFolder directories via timm."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import odeify
from odeify.cli.parser import main
from odeify.models.digits import DIGITS_MEAN, DIGITS_STD, load_digits
from odeify.train.datasets import DataError, make_loader, open_data

pytestmark = pytest.mark.usefixtures("one_thread")


def image_folder(root: Path, train: int = 12, val: int = 4) -> Path:
    """Two classes of 8x8 grey digits (0 and 1 from scikit-learn) as PNG files, ImageFolder layout."""
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    for label in (0, 1):
        images = data.images[data.target == label]
        for split, count, offset in (("train", train, 0), ("val", val, train)):
            folder = root / split / f"digit_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = (images[offset + i] * 255 / 16).astype(np.uint8)
                Image.fromarray(pixels, mode="L").save(folder / f"{i}.png")
    return root


def test_digits_are_the_split_the_model_was_trained_on(native: torch.nn.Module) -> None:
    data = open_data("digits", native)
    assert (len(data.train), len(data.val), data.num_classes) == (1438, 359, 10)
    torch.testing.assert_close(data.val.tensors[0], load_digits("test")[0], rtol=0, atol=0)


def test_digits_refuse_a_model_with_other_inputs() -> None:
    from odeify.models._testing import make_test_model

    with pytest.raises(DataError, match="1-channel"):
        open_data("digits", make_test_model("resnet18"))


def test_image_folder_uses_the_models_transforms(native: torch.nn.Module, tmp_path: Path) -> None:
    root = image_folder(tmp_path)
    data = open_data(root, native)
    assert (len(data.train), len(data.val), data.num_classes) == (24, 8, 2)
    x, y = data.val[0]
    assert x.shape == (1, 32, 32) and y == 0  # the model's 1x32x32 input from an 8x8 grey PNG
    for split in ("train", "val"):
        for name in ("c", "d"):  # two classes: one is refused
            (tmp_path / "grey" / split / name).mkdir(parents=True)
            Image.fromarray(np.full((8, 8), 200, np.uint8), mode="L").save(
                tmp_path / "grey" / split / name / "a.png"
            )
    uniform, _ = open_data(tmp_path / "grey", native).val[0]
    expected = (200 / 255 - DIGITS_MEAN) / DIGITS_STD  # resize and crop keep a uniform image uniform
    torch.testing.assert_close(uniform, torch.full_like(uniform, expected), rtol=0, atol=1e-5)


def test_image_folder_errors(native: torch.nn.Module, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        open_data(tmp_path / "missing", native)
    (tmp_path / "only_train" / "train" / "a").mkdir(parents=True)
    with pytest.raises(DataError, match="no val/ subfolder"):
        open_data(tmp_path / "only_train", native)
    root = image_folder(tmp_path / "mismatch")
    (root / "val" / "digit_1").rename(root / "val" / "digit_7")
    with pytest.raises(DataError, match="different class folders"):
        open_data(root, native)


def test_training_batches_depend_only_on_seed_and_epoch(native: torch.nn.Module) -> None:
    data = open_data("digits", native)

    def first_labels(epoch: int) -> torch.Tensor:
        loader = make_loader(data.train, 32, train=True, seed=3)
        loader.sampler.set_epoch(epoch)
        return next(iter(loader))[1]

    torch.manual_seed(123)
    a = first_labels(1)
    torch.manual_seed(456)  # the global RNG does not matter
    assert torch.equal(a, first_labels(1)) and not torch.equal(a, first_labels(2))


def test_finetune_on_an_image_folder_with_other_classes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = image_folder(tmp_path / "data")
    run = tmp_path / "run"
    argv = [
        "finetune",
        "--data",
        str(root),
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "1",
        "--out",
        str(run),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "classifier was reset" in out and "without distillation" in out
    model = odeify.load(run / "last.safetensors")
    assert model.num_classes == 2
    history = json.loads((run / "history.json").read_text())
    x = torch.stack([open_data(root, model).val[i][0] for i in range(8)])
    y = torch.tensor([0] * 4 + [1] * 4)
    with torch.no_grad():
        assert (model(x).argmax(1) == y).double().mean().item() == pytest.approx(history[-1]["val_accuracy"])


def test_a_truncated_image_stops_with_its_path(
    native: torch.nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = image_folder(tmp_path)
    broken = root / "val" / "digit_1" / "2.png"
    broken.write_bytes(broken.read_bytes()[:60])  # the header survives, the pixels do not
    data = open_data(root, native)
    assert len(data.val) == 8  # every file counted once
    assert data.val[0][1] == 0  # readable images still load
    with pytest.raises(DataError, match=f"cannot read the image {broken}"):
        data.val[6]  # timm's own dataset logs a warning and returns the next image instead
    path = tmp_path / "ode.safetensors"
    odeify.save(native, path)
    assert main(["eval", str(path), "--data", str(root)]) == 2
    err = capsys.readouterr().err
    assert str(broken) in err and "truncated" in err and err.count("\n") == 1


def test_a_bad_data_argument_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing_model = tmp_path / "no_such_model.safetensors"  # loading it would fail: --data is checked first
    for command in (["eval"], ["sweep"], ["finetune", "--out", str(tmp_path / "run")]):
        assert (
            main([*command[:1], str(missing_model), "--data", str(tmp_path / "nowhere"), *command[1:]]) == 2
        )
        err = capsys.readouterr().err
        assert "--data" in err and "does not exist" in err and "no_such_model" not in err
