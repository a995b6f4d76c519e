"""Image folders and data configs that hung, blew up memory, gave a traceback or were taken silently
(issue 39): each is refused where it enters, naming the problem, or read with a one-line warning."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_datasets import image_folder

import odeify
from odeify.cli.parser import main
from odeify.core.errors import ConfigError, ModelLoadError
from odeify.models.data_config import check_data_config
from odeify.train.datasets import DataError, make_loader, open_data

pytestmark = pytest.mark.usefixtures("one_thread")


def _samples(root: Path, native: torch.nn.Module) -> list[str]:
    data = open_data(root, native)
    return [os.path.relpath(path, root / "train") for path, _ in data.train.reader.samples]


@pytest.mark.timeout(60)  # timm's reader lists the FIFO and PIL's open blocks on it forever
def test_a_fifo_among_the_images_is_skipped_by_name(native: torch.nn.Module, tmp_path: Path) -> None:
    root = image_folder(tmp_path, train=2, val=1)
    os.mkfifo(root / "train" / "digit_1" / "zz_fifo.png")
    (root / "train" / "digit_1" / "notes.txt").write_text("not an image")
    skipped = r"skipped 2 files, not images: digit_1/notes\.txt, digit_1/zz_fifo\.png;"
    with pytest.warns(UserWarning, match=skipped):
        data = open_data(root, native)
    assert len(data.train) == 4
    [data.train[i] for i in range(len(data.train))]


def test_the_formats_pil_reads_are_images(native: torch.nn.Module, tmp_path: Path) -> None:
    root = image_folder(tmp_path, train=1, val=1)
    pixels = np.full((8, 8), 99, np.uint8)
    for suffix in (".gif", ".bmp", ".webp", ".tif", ".TIFF"):
        Image.fromarray(pixels, mode="L").save(root / "train" / "digit_0" / f"x{suffix}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped
        data = open_data(root, native)
    assert len(data.train) == 2 + 5  # timm's reader had dropped all five
    first = data.train[1][0]  # x.bmp, natural order after 0.png
    torch.testing.assert_close(first, torch.full_like(first, float(first.flatten()[0])))


def test_a_link_loop_and_shared_splits_are_refused(native: torch.nn.Module, tmp_path: Path) -> None:
    root = image_folder(tmp_path / "loop", train=2, val=1)
    os.symlink("..", root / "train" / "digit_1" / "loop")
    with pytest.raises(DataError, match=r"digit_1/loop is a link back to a folder it is in"):
        open_data(root, native)  # timm's reader read the loop 40 times over
    os.unlink(root / "train" / "digit_1" / "loop")
    (root / "train" / "digit_1").rename(tmp_path / "digit_1")
    os.symlink(tmp_path / "digit_1", root / "train" / "digit_1")  # a link, not a loop: read
    assert _samples(root, native) == ["digit_0/0.png", "digit_0/1.png", "digit_1/0.png", "digit_1/1.png"]
    shared = image_folder(tmp_path / "shared", train=2, val=1)
    (shared / "train").rename(shared / "old_train")
    os.symlink("val", shared / "train")
    with pytest.raises(DataError, match="read the same images .* through a link"):
        open_data(shared, native)


def test_folders_of_one_name_under_two_classes_and_one_class_are_refused(
    native: torch.nn.Module, tmp_path: Path
) -> None:
    root = image_folder(tmp_path / "nested", train=2, val=1)
    for label in (0, 1):
        folder = root / "train" / f"digit_{label}"
        (folder / "x").mkdir()
        (folder / "0.png").rename(folder / "x" / "0.png")
    with pytest.raises(DataError, match="digit_0/x and .*digit_1/x have the same name"):
        open_data(root, native)
    one = image_folder(tmp_path / "one", train=2, val=1)
    for split in ("train", "val"):
        for path in (one / split / "digit_1").iterdir():
            path.unlink()
        (one / split / "digit_1").rmdir()
    with pytest.raises(DataError, match=r"one class folder \(digit_0\)"):
        open_data(one, native)


def test_different_class_folders_are_named(native: torch.nn.Module, tmp_path: Path) -> None:
    root = image_folder(tmp_path, train=1, val=1)
    (root / "val" / "digit_1").rename(root / "val" / "digit_7")
    with pytest.raises(DataError, match=r"only train/ has digit_1; only val/ has digit_7"):
        open_data(root, native)


def test_a_decompression_bomb_is_refused_by_path(
    native: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = image_folder(tmp_path, train=1, val=1)
    data = open_data(root, native)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 16)  # an 8x8 image is then over twice the limit
    with pytest.raises(DataError, match=r"digit_0/0\.png is too large to read safely"):
        data.train[0]


@pytest.mark.timeout(60)  # at n=100000 timm's RandAugment never finished a batch
@pytest.mark.parametrize("policy", ["rand-n100000-m9", "augmix-m5-w100000", "rand-m9-mmax1000"])
def test_a_policy_that_asks_for_endless_work_is_refused(
    native: torch.nn.Module, tmp_path: Path, policy: str
) -> None:
    entry = {"train_augmentation": {"aa": policy}}
    with pytest.raises(ModelLoadError, match="'train_augmentation' must be"):
        check_data_config(entry, "a file")
    assert check_data_config({"train_augmentation": {"aa": "rand-m9-n2-mstd0.5"}}, "a file")
    root = image_folder(tmp_path, train=1, val=1)
    before = native.pretrained_cfg
    native.pretrained_cfg = {**before, **entry}  # set in memory, past the file check
    try:
        with pytest.raises(DataError, match=f"--aa {policy} asks for more work"):
            open_data(root, native).train[0]
    finally:
        native.pretrained_cfg = before


@pytest.mark.parametrize(
    ("key", "value"),
    [("crop_pct", 1e-9), ("std", [1e-320]), ("mean", [1e308]), ("test_crop_pct", 0.1), ("std", [20.0])],
)
def test_a_data_config_number_out_of_range_is_refused(key: str, value: object) -> None:
    with pytest.raises(ModelLoadError, match=f"'{key}' must be"):
        check_data_config({key: value}, "a file")


def test_data_config_numbers_in_range_still_evaluate(native: torch.nn.Module, tmp_path: Path) -> None:
    root = image_folder(tmp_path, train=1, val=1)
    cfg = {"crop_pct": 0.5, "mean": [-10.0], "std": [1e-3]}  # the ends of each range
    assert check_data_config(cfg, "a file")
    before = native.pretrained_cfg
    native.pretrained_cfg = {**before, **cfg}
    try:
        x = open_data(root, native).val[0][0]
    finally:
        native.pretrained_cfg = before
    assert bool(torch.isfinite(x).all()) and float(x.min()) >= 10 / 1e-3


def test_an_image_folder_batch_over_the_input_budget_is_refused(
    native: torch.nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = image_folder(tmp_path, train=1, val=1)
    before = native.pretrained_cfg
    native.pretrained_cfg = {**before, "input_size": (1, 4096, 4096)}
    try:
        data = open_data(root, native)
        with pytest.raises(ConfigError, match=r"\[256, 1, 4096, 4096\] would hold 16\.0 GiB"):
            make_loader(data.val, 256, train=False)
        make_loader(data.val, 8, train=False)  # 0.5 GiB: within the budget
    finally:
        native.pretrained_cfg = before
    path = tmp_path / "big.safetensors"
    odeify.save(native, path)
    assert main(["eval", str(path), "--data", str(root), "--input-size", "1", "4096", "4096"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size" in err and "ODEIFY_MAX_INPUT_BYTES" in err


@pytest.mark.parametrize(
    ("arch", "kwargs"), [("convnext_atto", {}), ("vit_tiny_patch16_224", {"depth": 1, "img_size": 32})]
)
def test_img_size_takes_the_channels_from_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str, kwargs: dict
) -> None:
    import safetensors.torch
    import timm

    source = timm.create_model(arch, num_classes=2, in_chans=1, **kwargs)
    plain = tmp_path / "model.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in source.state_dict().items()}, plain)
    out = tmp_path / "m.safetensors"
    given = [f"{k}={v}" for k, v in {"in_chans": 1, **kwargs}.items()]
    argv = ["convert", str(plain), "--arch", arch, "--num-classes", "2", "--img-size", "32", "--no-verify"]
    assert main([*argv, "--model-kwargs", *given, "-o", str(out)]) == 0
    average = sum(source.pretrained_cfg["mean"]) / 3  # timm's RGB mean, its 1-channel reading
    assert f"averages are used for each channel (mean {average:.4g} (of 3)" in capsys.readouterr().err
    model = odeify.load(out)
    config = timm.data.resolve_model_data_config(model)  # asserted one mean per channel before
    assert config["input_size"] == tuple(model.meta["odeify"]["input_shape"][1:]) == (1, 32, 32)
    root = image_folder(tmp_path / "data", train=1, val=2)
    assert main(["eval", str(out), "--data", str(root)]) == 0
    assert "accuracy" in capsys.readouterr().out
