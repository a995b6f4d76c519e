"""The unlabelled images calibration reads: a tensor, batches, a Dataset or an image folder.

Calibration (:mod:`odeify.train.calibration`) needs a few hundred of the images a model will see,
transformed as the model's evaluation transform makes them; labels are never read. Whatever form
they come in, :func:`calibration_images` returns one ``[N, C, H, W]`` tensor of at most ``images``
samples, checked where it enters: floating-point, the model's channel count, finite.
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from odeify.core.errors import ConfigError
from odeify.train.datasets import DIGITS, IMAGE_SUFFIXES, LabelledData, data_config, open_data

__all__ = ["calibration_images"]

CalibrationData = torch.Tensor | Dataset | LabelledData | Iterable | str | os.PathLike


def calibration_images(data: CalibrationData, model: nn.Module, images: int, seed: int) -> torch.Tensor:
    """At most ``images`` samples of ``data`` as one float tensor ``[N, C, H, W]`` on the model's
    device and dtype, a seeded random choice where ``data`` holds more.

    ``data``: a tensor of images; a :class:`LabelledData` (its training split, through its
    validation split's transform: not the training augmentation); a Dataset or an
    iterable of batches, whose items are images or ``(image, label)`` pairs (the label is dropped);
    ``"digits"``; or the path of an image folder, read with the model's evaluation transform (a
    fine-tuning folder's ``train/`` split when it has one, else every image file below the folder).
    """
    if isinstance(data, (str, os.PathLike)):
        x = _from_path(data, model, images, seed)
    elif isinstance(data, torch.Tensor):
        x = _choose(data, images, seed)
    elif isinstance(data, LabelledData):
        x = _from_dataset(_evaluated(data), images, seed)
    elif isinstance(data, Dataset) and hasattr(data, "__len__"):
        x = _from_dataset(data, images, seed)
    elif isinstance(data, Iterable):
        x = _from_batches(data, images, seed)
    else:
        raise ConfigError(
            f"calibration data must be a tensor of images, a Dataset, an iterable of batches or an image "
            f"folder's path; got {type(data).__name__}."
        )
    weight = next(p for p in model.parameters() if p.is_floating_point())
    _check(x, model)
    return x.to(device=weight.device, dtype=weight.dtype)


def _evaluated(data: LabelledData) -> Dataset:
    """``data``'s training split read with the evaluation transform where the splits carry timm
    transforms. Random-resized crops and flips fit the stages to images the model is not evaluated
    on: the corpus ViT at a third of its steps calibrated to 81.62% on augmented crops, 89.42% on the
    same images as evaluated (docs/calibration.md)."""
    train, val = data.train, data.val
    if not (hasattr(train, "transform") and hasattr(val, "transform")):
        return train  # tensors: nothing is augmented
    evaluated = copy.copy(train)
    evaluated.transform = val.transform
    return evaluated


def _choose(x: torch.Tensor, images: int, seed: int) -> torch.Tensor:
    """``images`` rows of ``x`` chosen at random with ``seed`` (all of them, in order, when it has fewer)."""
    if x.shape[0] <= images:
        return x
    pick = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:images]
    return x[pick.sort().values]


def _image_of(item: object) -> torch.Tensor:
    """A sample's image: the item itself, or the first element of an ``(image, label)`` pair."""
    image = item[0] if isinstance(item, (tuple, list)) else item
    if not isinstance(image, torch.Tensor):
        raise ConfigError(
            f"calibration samples must be image tensors or (image, label) pairs; got {type(image).__name__} "
            "(a Dataset needs a transform that returns tensors, such as timm's create_transform)."
        )
    return image


def _from_dataset(dataset: Dataset, images: int, seed: int) -> torch.Tensor:
    n = len(dataset)
    if n == 0:
        raise ConfigError("the calibration data set is empty: pass at least one image.")
    order = list(range(n))
    if n > images:
        order = sorted(random.Random(seed).sample(order, images))
    return torch.stack([_image_of(dataset[i]) for i in order])


def _from_batches(batches: Iterable, images: int, seed: int) -> torch.Tensor:
    """Images from the first batches of an iterable (a DataLoader), up to twice ``images``, then a choice."""
    taken, count = [], 0
    for batch in batches:
        x = _image_of(batch)
        if x.ndim == 3:
            x = x.unsqueeze(0)
        taken.append(x)
        count += x.shape[0]
        if count >= 2 * images:
            break
    if not taken:
        raise ConfigError("the calibration batches are empty: pass at least one image.")
    return _choose(torch.cat(taken), images, seed)


def _from_path(path: str | os.PathLike[str], model: nn.Module, images: int, seed: int) -> torch.Tensor:
    if os.fspath(path) == DIGITS:
        return _from_dataset(open_data(DIGITS, model).train, images, seed)
    root = Path(path).expanduser()
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise ConfigError(
            f"calibration data {root} {what}: pass a folder of images (a fine-tuning folder's train/ "
            "split is used when it has one), 'digits', or the images themselves in Python."
        )
    folder = root / "train" if (root / "train").is_dir() else root
    files = _image_files(folder)
    if not files:
        raise ConfigError(
            f"calibration data {folder} holds no image files ({', '.join(IMAGE_SUFFIXES)}), in it or "
            "below it."
        )
    if len(files) > images:
        files = sorted(random.Random(seed).sample(files, images))
    import timm.data

    config = data_config(model)  # once: it warns when the config's size is not the traced one
    transform = timm.data.create_transform(**config, is_training=False)
    mode = "L" if config["input_size"][0] == 1 else "RGB"
    return torch.stack([transform(_read(file, mode)) for file in files])


def _image_files(folder: Path) -> list[Path]:
    """Every regular image file below ``folder``, sorted; links to folders are not followed (no loops)."""
    found = []
    for top, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            file = Path(top) / name
            if file.suffix.lower() in IMAGE_SUFFIXES and file.is_file():
                found.append(file)
    return found


def _read(file: Path, mode: str):
    """One image file as a PIL image in ``mode`` ('RGB' or 'L'); a file PIL cannot read is named."""
    from PIL import Image

    try:
        with Image.open(file) as image:
            return image.convert(mode)
    except (OSError, Image.DecompressionBombError) as exc:
        raise ConfigError(f"cannot read the calibration image {file} ({exc}); fix or remove it.") from exc


def _check(x: torch.Tensor, model: nn.Module) -> None:
    """Refuse images the model cannot take: not [N, C, H, W] floats, another channel count, NaN or inf."""
    if x.ndim != 4 or not x.is_floating_point() or x.shape[0] == 0:
        raise ConfigError(
            f"calibration images must be a non-empty float tensor [N, C, H, W]; got {x.dtype} of shape "
            f"{tuple(x.shape)}."
        )
    shape = getattr(model, "meta", {}).get("odeify", {}).get("input_shape")
    channels = shape[1] if shape else None
    if channels is not None and x.shape[1] != channels:
        raise ConfigError(
            f"the calibration images have {x.shape[1]} channel(s), the model takes {channels}: pass images "
            "as the model's data config makes them (its evaluation transform)."
        )
    finite = torch.isfinite(x).flatten(1).all(1)
    if not bool(finite.all()):
        first = int((~finite).nonzero()[0])
        raise ConfigError(
            f"the calibration images hold NaN or inf values (image {first} is the first); clean the data."
        )
