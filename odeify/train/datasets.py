"""Labelled images for fine-tuning and evaluation: the built-in digits set or an ImageFolder directory.

``--data digits`` is scikit-learn's 8x8 digits exactly as the shipped model saw them
(:func:`odeify.models.digits.load_digits`), held in memory. ``--data DIR`` is a folder with ``train/``
and ``val/`` (or ``validation/``) subfolders of one folder per class, read by timm's data
pipeline (``timm.data.create_dataset``) with the transforms timm derives from the model's
pretrained config (``resolve_model_data_config`` + ``create_transform``): training augmentation
on ``train``, the evaluation resize and crop on ``val``.

Batches come from :func:`make_loader`, which always uses a ``DistributedSampler`` (one replica
when not distributed): its order depends only on the seed and the epoch, so a resumed run sees
the same batches as an uninterrupted one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from odeify.core.errors import OdeifyError
from odeify.models.timm_interface import default_input_size

__all__ = ["DIGITS", "DataError", "LabelledData", "make_loader", "open_data"]

DIGITS = "digits"
VAL_FOLDERS = ("val", "validation")


class DataError(OdeifyError):
    """The data set named by ``--data`` cannot be read, or does not fit the model."""


@dataclass(frozen=True)
class LabelledData:
    """A training and a validation split with their class count; ``name`` is what the user passed."""

    name: str
    train: Dataset
    val: Dataset
    num_classes: int


def open_data(spec: str | os.PathLike[str], model: nn.Module) -> LabelledData:
    """The data ``spec`` names (``"digits"`` or an ImageFolder path), prepared for ``model``'s input."""
    if os.fspath(spec) == DIGITS:
        return _digits(model)
    return _image_folder(Path(spec).expanduser(), model)


def _digits(model: nn.Module) -> LabelledData:
    from odeify.models.digits import DIGITS_NUM_CLASSES, load_digits

    _, channels, height, width = _input_shape(model)
    if channels != 1 or height != width:
        raise DataError(
            f"the digits set is 1-channel square images, but this model takes {channels}x{height}x{width} "
            "inputs. Use the shipped digits model (odeify's default MODEL) or pass --data DIR with an "
            "ImageFolder of your own images (DIR/train/<class>/*.png, DIR/val/<class>/*.png)."
        )
    return LabelledData(
        DIGITS,
        TensorDataset(*load_digits("train", height)),
        TensorDataset(*load_digits("test", height)),
        DIGITS_NUM_CLASSES,
    )


def _input_shape(model: nn.Module) -> tuple[int, ...]:
    """The input shape a converted model was converted for, else the one timm's config gives."""
    recorded = getattr(model, "meta", {}).get("odeify", {}).get("input_shape")
    return tuple(recorded) if recorded else default_input_size(model)


def _image_folder(root: Path, model: nn.Module) -> LabelledData:
    import timm.data

    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise DataError(
            f"--data {root} {what}. Pass 'digits' for the built-in set, or a folder holding train/ and "
            "val/ subfolders with one folder of images per class (the ImageFolder layout)."
        )
    train_dir = root / "train"
    val_dir = next((root / name for name in VAL_FOLDERS if (root / name).is_dir()), None)
    if not train_dir.is_dir() or val_dir is None:
        missing = " and ".join(
            name for name, found in (("train/", train_dir.is_dir()), ("val/", val_dir)) if not found
        )
        raise DataError(
            f"--data {root} has no {missing} subfolder. The ImageFolder layout is DIR/train/<class>/*.jpg "
            "and DIR/val/<class>/*.jpg (val/ may be named validation/)."
        )
    config = timm.data.resolve_model_data_config(model)
    mode = "L" if config["input_size"][0] == 1 else "RGB"
    splits = []
    for folder, training in ((train_dir, True), (val_dir, False)):
        try:
            dataset = timm.data.create_dataset("", root=str(folder), search_split=False, input_img_mode=mode)
        except (OSError, RuntimeError, ValueError) as exc:
            raise DataError(f"cannot read the image folder {folder}: {exc}") from exc
        if len(dataset) == 0:
            raise DataError(f"{folder} holds no images (expected {folder}/<class>/<image files>).")
        dataset.transform = timm.data.create_transform(**config, is_training=training)
        splits.append(dataset)
    train, val = splits
    classes = train.reader.class_to_idx
    if val.reader.class_to_idx != classes:
        raise DataError(
            f"{train_dir} and {val_dir} hold different class folders "
            f"({len(classes)} vs {len(val.reader.class_to_idx)}); both need the same class names."
        )
    return LabelledData(str(root), train, val, len(classes))


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    train: bool,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    workers: int = 0,
) -> DataLoader:
    """Batches of ``dataset``: shuffled per epoch (call ``loader.sampler.set_epoch``) when ``train``.

    Training batches are this rank's shard, full batches only; evaluation batches are the whole
    split in order, on one process.
    """
    sampler = DistributedSampler(
        dataset, num_replicas=world_size if train else 1, rank=rank if train else 0, shuffle=train, seed=seed
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=train,
        num_workers=workers,
        persistent_workers=False,
    )
