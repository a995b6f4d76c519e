"""Labelled images for fine-tuning and evaluation: the built-in digits set or an ImageFolder directory.

``--data digits`` is scikit-learn's 8x8 digits exactly as the shipped model saw them
(:func:`odeify.models.digits.load_digits`), held in memory. ``--data DIR`` is a folder with ``train/``
and ``val/`` (or ``validation/``) subfolders of one folder per class, read by timm's data
pipeline (``timm.data.create_dataset``) with the transforms timm derives from the model's
pretrained config (``resolve_model_data_config`` + ``create_transform``): training augmentation
on ``train``, the evaluation resize and crop on ``val``. Evaluation alone (:func:`open_evaluation`)
needs no ``train/``: it reads ``val/`` (or ``validation/``, or ``test/``), else DIR itself as a
folder of class folders, and says which.

Batches come from :func:`make_loader`, which always uses a ``DistributedSampler`` (one replica
when not distributed): its order depends only on the seed and the epoch, so a resumed run sees
the same batches as an uninterrupted one.

:func:`check_data` refuses data that cannot train the model (labels out of range or not integers,
another channel count, NaN or inf inputs) where it enters fine-tuning, not in the training loop;
:func:`fingerprint` is what a resumed run checks to be training on the same data.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from odeify.core.budget import check_input_bytes
from odeify.core.errors import OdeifyError
from odeify.core.limits import MAX_NUM_CLASSES
from odeify.core.words import plural
from odeify.models.data_config import AA_BOUNDS, aa_policy
from odeify.models.timm_interface import default_input_size

__all__ = [
    "DIGITS",
    "Augmentation",
    "DataError",
    "EvaluationData",
    "LabelledData",
    "check_data",
    "check_data_spec",
    "data_config",
    "fingerprint",
    "make_loader",
    "open_data",
    "open_evaluation",
]

DIGITS = "digits"
DIGITS_SAMPLES = 1797  # scikit-learn's digits: what open_data("digits") holds in memory, both splits
VAL_FOLDERS = ("val", "validation")
EVAL_FOLDERS = (*VAL_FOLDERS, "test")  # what evaluation alone reads, in this order
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")  # what PIL reads
IGNORE_INDEX = -100  # the label cross-entropy skips (torch's default ignore_index)
LARGE_INPUT = 1e4  # normalised images lie within a few units of 0; raw 0..255 pixels within 255


class DataError(OdeifyError):
    """The data set named by ``--data`` cannot be read, or does not fit the model."""


@dataclass(frozen=True)
class LabelledData:
    """A training and a validation split with their class count; ``name`` is what the user passed."""

    name: str
    train: Dataset
    val: Dataset
    num_classes: int
    augmentation: str = "none"  # how the training split is augmented, and why (for the run's log)


@dataclass(frozen=True)
class EvaluationData:
    """The split evaluation reads and its class count; ``read`` says which it is (a folder, or the
    digits set's test split), ``name`` what the user passed."""

    name: str
    val: Dataset
    num_classes: int
    read: str


@dataclass(frozen=True)
class Augmentation:
    """Training augmentation with timm train.py's flag names, meanings and defaults (its
    ``create_transform`` arguments): ``no_aug`` (resize and centre-crop only), the random-resized
    crop's ``scale`` and ``ratio`` ranges, ``hflip``/``vflip`` probabilities, ``color_jitter``, the
    AutoAugment policy ``aa`` (e.g. ``"rand-m9-mstd0.5"``) and random erasing's ``reprob``."""

    no_aug: bool = False
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    vflip: float = 0.0
    color_jitter: float = 0.4
    aa: str | None = None
    reprob: float = 0.0

    def describe(self, base: Mapping[str, Any] | None = None) -> str:
        """The settings that differ from ``base`` (default: timm's defaults), as train.py flags
        ("--hflip 0"), or "defaults"."""
        base = {**asdict(Augmentation()), **(base or {})}
        changed = [
            f"--{name.replace('_', '-')}" + ("" if value is True else f" {_flag_value(value)}")
            for name, value in asdict(self).items()
            if value != base[name]
        ]
        return " ".join(changed) or "defaults"

    def transform_kwargs(self) -> dict[str, Any]:
        """The arguments of ``timm.data.create_transform`` that say this augmentation."""
        return {
            "no_aug": self.no_aug, "scale": self.scale, "ratio": self.ratio, "hflip": self.hflip,
            "vflip": self.vflip, "color_jitter": self.color_jitter, "auto_augment": self.aa,
            "re_prob": self.reprob,
        }  # fmt: skip


def open_data(
    spec: str | os.PathLike[str], model: nn.Module, augmentation: Augmentation | None = None
) -> LabelledData:
    """The data ``spec`` names (``"digits"`` or an ImageFolder path), prepared for ``model``'s input;
    an image folder's training split with ``augmentation``; by default, as the source network was
    trained where its file recorded that (:func:`recorded_augmentation`), else timm's defaults."""
    if os.fspath(spec) == DIGITS:
        if augmentation is not None and augmentation != Augmentation():
            raise DataError(
                "the augmentation flags (--hflip, --scale, --aa, ...) apply to an image folder's images; "
                "--data digits is the 8x8 digits as tensors, trained as they are. Leave them out, or pass "
                "--data DIR."
            )
        return _digits(model)
    recorded = recorded_augmentation(model)
    from_file = "as the source was trained (its file records train.py's settings)"
    if augmentation is not None:  # what differs from the file is given; what the file set and is kept, said
        same = {k: v for k, v in asdict(augmentation).items() if k in recorded and recorded[k] == v}
        kept = Augmentation(**same)
        said = f"as given: {augmentation.describe(recorded)}"
        said += f"; {from_file}: {kept.describe()}" if kept != Augmentation() else ""
    elif recorded:
        augmentation = Augmentation(**recorded)
        said = f"{from_file}: {augmentation.describe()}"
    else:
        augmentation, said = Augmentation(), "timm's defaults"
    root = Path(spec).expanduser()
    train_dir, val_dir = _split_folders(root)
    return replace(_image_folder(root, train_dir, val_dir, model, augmentation), augmentation=said)


def open_evaluation(spec: str | os.PathLike[str], model: nn.Module) -> EvaluationData:
    """The split that evaluation reads of the data ``spec`` names, prepared for ``model``'s input.

    An image folder needs no ``train/``: its ``val/`` (or ``validation/``, or ``test/``) is read, else
    the folder itself when it holds class folders. With a ``train/`` beside it, both must hold the same
    classes (the class indices the model was trained with are those of ``train/``'s folders).
    """
    if os.fspath(spec) == DIGITS:
        data = _digits(model)
        return EvaluationData(DIGITS, data.val, data.num_classes, "digits (its test split)")
    root = Path(spec).expanduser()
    folder = _evaluation_folder(root)
    val = _split(folder, data_config(model), None)
    classes = val.reader.class_to_idx
    if folder != root and (root / "train").is_dir():
        _same_classes(root / "train", scan_folder(root / "train")[1], folder, classes)
    _at_least_two(folder, classes)
    return EvaluationData(str(root), val, len(classes), str(folder))


def _flag_value(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(map(_flag_value, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def recorded_augmentation(model: nn.Module) -> dict[str, Any]:
    """The training augmentation ``model``'s file recorded for its source network (timm train.py's
    ``args``, kept as the data config entry ``train_augmentation``), as Augmentation fields; {} if none."""
    cfg = getattr(model, "pretrained_cfg", None)
    recorded = cfg.get("train_augmentation") if isinstance(cfg, Mapping) else None
    if not isinstance(recorded, Mapping):
        return {}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()}


def _digits(model: nn.Module) -> LabelledData:
    from odeify.models.digits import DIGITS_NUM_CLASSES, load_digits

    _, channels, height, width = _input_shape(model)
    if channels != 1 or height != width:
        raise DataError(
            f"the digits set is 1-channel square images, but this model takes {channels}x{height}x{width} "
            "inputs. Use the shipped digits model (odeify's default MODEL) or pass --data DIR with an "
            "ImageFolder of your own images (DIR/train/<class>/*.png, DIR/val/<class>/*.png)."
        )
    check_input_bytes(
        "the digits set at the model's input size", (DIGITS_SAMPLES, channels, height, width), 4
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


def check_data_spec(spec: str | os.PathLike[str], *, evaluation: bool = False) -> None:
    """Refuse a ``--data`` that names no data set (not 'digits', not an ImageFolder with train/ and
    val/; with ``evaluation``, none that :func:`open_evaluation` reads), before any model is loaded:
    the check costs a few stat calls, loading a model seconds."""
    if os.fspath(spec) != DIGITS:
        root = Path(spec).expanduser()
        if evaluation:
            _evaluation_folder(root, say=False)
        else:
            _split_folders(root, say=False)


def _evaluation_folder(root: Path, *, say: bool = True) -> Path:
    """The folder evaluation reads: ``root``'s val/, validation/ or test/ (the first there; with ``say``,
    a warning names it when there are several), else ``root`` itself as a folder of class folders when
    it has no train/."""
    _check_folder(root)
    found = _present(root, EVAL_FOLDERS, "evaluation" if say else None)
    if found is not None:
        return found
    if (root / "train").is_dir():
        raise DataError(
            f"--data {root} has train/ but no val/ subfolder to evaluate on (nor validation/ or test/); "
            "evaluation does not read the training images. Add DIR/val/<class>/*.jpg."
        )
    return root


def _present(root: Path, names: tuple[str, ...], role: str | None) -> Path | None:
    """The first of ``root``'s subfolders ``names`` that exists; when several do, a warning says which
    one is read (as the split ``role``; None: no warning) and which are not."""
    found = [root / name for name in names if (root / name).is_dir()]
    if len(found) > 1 and role is not None:
        others = " and ".join(f"{path.name}/" for path in found[1:])
        warnings.warn(
            f"--data {root} has {found[0].name}/ and {others}: {found[0].name}/ is read as the {role} split, "
            f"{others} {'is' if len(found) == 2 else 'are'} not. Rename or remove the one you do not mean.",
            UserWarning,
            stacklevel=4,
        )
    return found[0] if found else None


def _check_folder(root: Path) -> None:
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise DataError(
            f"--data {root} {what}. Pass 'digits' for the built-in set, or a folder holding train/ and "
            "val/ subfolders with one folder of images per class (the ImageFolder layout)."
        )


def _split_folders(root: Path, *, say: bool = True) -> tuple[Path, Path]:
    """``root``'s train/ and val/ (or validation/) folders; a DataError naming what is missing (with
    ``say``, a warning names the one read when both val/ and validation/ are there)."""
    _check_folder(root)
    train_dir = root / "train"
    val_dir = _present(root, VAL_FOLDERS, "validation" if say else None)
    if not train_dir.is_dir() or val_dir is None:
        missing = " and ".join(
            name for name, found in (("train/", train_dir.is_dir()), ("val/", val_dir)) if not found
        )
        raise DataError(
            f"--data {root} has no {missing} subfolder. The ImageFolder layout is DIR/train/<class>/*.jpg "
            "and DIR/val/<class>/*.jpg (val/ may be named validation/)."
        )
    return train_dir, val_dir


def _strict_dataset(folder: Path, mode: str) -> Dataset:
    """timm's ImageDataset of ``folder`` as :func:`scan_folder` lists it, except that an image it cannot
    read stops with its path: timm's own logs a warning and returns the next image in its place, so
    an evaluation silently counts another image twice (361 samples of 360)."""
    from PIL import Image
    from timm.data import ImageDataset
    from timm.data.readers.reader_image_folder import ReaderImageFolder

    class ScannedReader(ReaderImageFolder):
        def __init__(self, root: Path) -> None:  # timm's reader walks the folder itself, following loops
            self.root = str(root)
            self.samples, self.class_to_idx = scan_folder(root)

    class StrictImageDataset(ImageDataset):
        def __getitem__(self, index: int):
            file, target = self.reader[index][:2]
            path = self.filename(index, absolute=True)
            try:
                image = Image.open(file).convert(self.input_img_mode)  # decodes: a truncated file fails here
            except OSError as exc:
                raise DataError(
                    f"cannot read the image {path} ({exc}); fix or remove it. odeify does not put another "
                    "image in its place."
                ) from exc
            except Image.DecompressionBombError as exc:
                raise DataError(
                    f"the image {path} is too large to read safely ({exc}); shrink or remove it."
                ) from exc
            return (self.transform(image) if self.transform is not None else image), target

    return StrictImageDataset(str(folder), reader=ScannedReader(folder), input_img_mode=mode)


def scan_folder(folder: Path) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """The images of ``folder`` (an ImageFolder split) with their class indices, and the classes, as timm's
    reader finds them (a class is an image's folder name; both sorted naturally), except that: only
    regular files are read (a FIFO would block), a link back to a folder's own ancestor is refused (timm
    reads the loop until the path is too long), a folder name under two parents, images outside any
    class folder and a folder of images inside a class folder are refused (timm makes each a class),
    and what is skipped is named in a warning."""
    from timm.utils.misc import natural_key

    images: list[tuple[str, str]] = []
    skipped: list[str] = []

    def walk(directory: str, ancestors: frozenset[str]) -> None:
        real = os.path.realpath(directory)
        if real in ancestors:
            raise DataError(
                f"{directory} is a link back to a folder it is in ({real}), so the images under it would be "
                "read again and again; remove the link."
            )
        with os.scandir(directory) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_dir():
                    walk(entry.path, ancestors | {real})
                elif entry.is_file() and entry.name.lower().endswith(IMAGE_SUFFIXES):
                    images.append((entry.path, os.path.dirname(os.path.relpath(entry.path, folder))))
                else:
                    skipped.append(os.path.relpath(entry.path, folder))

    walk(os.fspath(folder), frozenset())
    if skipped:
        warnings.warn(
            f"{folder}: skipped {plural(len(skipped), 'file')}, not images: {', '.join(skipped[:3])}"
            f"{', ...' if len(skipped) > 3 else ''}; odeify reads regular files named "
            f"*{', *'.join(IMAGE_SUFFIXES)}.",
            UserWarning,
            stacklevel=4,
        )
    where: dict[str, str] = {}
    for _, relative in images:
        name = os.path.basename(relative)
        if not relative:
            raise DataError(
                f"{folder} holds images outside any class folder ({images[0][0]}, ...); move them into "
                f"{folder}/<class>/."
            )
        if where.setdefault(name, relative) != relative:
            raise DataError(
                f"{folder}/{where[name]} and {folder}/{relative} have the same name, and a class is an "
                "image's folder name: they would be merged into one class. Rename one, or move the images "
                "up into their class folder."
            )
    _refuse_nested(folder, set(where.values()))
    classes = {name: i for i, name in enumerate(sorted(where, key=natural_key))}
    samples = [(path, classes[os.path.basename(relative)]) for path, relative in images]
    return sorted(samples, key=lambda s: natural_key(s[0])), classes


def _refuse_nested(folder: Path, image_folders: set[str]) -> None:
    """No folder of images lies inside another (a class folder): its images would be a class of their own."""
    for relative in sorted(image_folders):
        outer = next((p for p in Path(relative).parents if str(p) in image_folders), None)
        if outer is not None:
            inner = os.path.basename(relative)
            raise DataError(
                f"{folder}/{relative} is a folder of images inside the class folder {folder}/{outer}: a "
                f"class is an image's own folder name, so its images would become a class '{inner}' of "
                f"their own, not images of '{outer.name}'. Move them up into {folder}/{outer}/ if they are "
                f"'{outer.name}', or move {inner}/ beside it to make it a class."
            )


def data_config(model: nn.Module) -> dict[str, Any]:
    """timm's data config for ``model`` (``resolve_model_data_config``: its pretrained_cfg). When it
    resizes images to another size than the model was traced (and verified) at, one warning names both."""
    import timm.data

    config = timm.data.resolve_model_data_config(model)
    traced = getattr(model, "meta", {}).get("odeify", {}).get("input_shape")
    used = tuple(config["input_size"])
    if traced and tuple(traced[1:]) != used:
        warnings.warn(
            f"the model's data config resizes images to {'x'.join(map(str, used))}, but the model was "
            f"converted (traced and verified) at {'x'.join(map(str, traced[1:]))}; the data config wins. "
            f"If the model was trained at {'x'.join(map(str, traced[2:]))} pixels, pass --input-size "
            f"{' '.join(map(str, traced[1:]))} (Python: set model.pretrained_cfg['input_size']).",
            UserWarning,
            stacklevel=3,
        )
    return config


def _image_folder(
    root: Path, train_dir: Path, val_dir: Path, model: nn.Module, augmentation: Augmentation
) -> LabelledData:
    config = data_config(model)
    train, val = _split(train_dir, config, augmentation), _split(val_dir, config, None)
    classes = train.reader.class_to_idx
    _same_classes(train_dir, classes, val_dir, val.reader.class_to_idx)
    _at_least_two(train_dir, classes)
    shared = _folders(train) & _folders(val)
    if shared:
        raise DataError(
            f"{train_dir} and {val_dir} read the same images (from {min(shared)}, through a link): "
            "validation would measure the training images. Give val/ images of its own."
        )
    return LabelledData(str(root), train, val, len(classes))


def _split(folder: Path, config: dict[str, Any], augmentation: Augmentation | None) -> Dataset:
    """The images of ``folder`` with timm's transform for ``config``: training with ``augmentation``,
    else evaluation (None)."""
    mode = "L" if config["input_size"][0] == 1 else "RGB"
    try:
        dataset = _strict_dataset(folder, mode)
    except DataError:
        raise
    except (OSError, RuntimeError, ValueError) as exc:
        raise DataError(f"cannot read the image folder {folder}: {exc}") from exc
    if len(dataset) == 0:
        raise DataError(f"{folder} holds no images (expected {folder}/<class>/<image files>).")
    dataset.transform = _transform(config, augmentation)
    dataset.input_size = tuple(config["input_size"])  # what make_loader's budget check reads
    return dataset


def _same_classes(
    train_dir: Path, classes: dict[str, int], val_dir: Path, val_classes: dict[str, int]
) -> None:
    """Both splits hold the same class folders (a class's index is its place among them)."""
    if val_classes == classes:
        return
    only = [
        f"only {folder.name}/ has {', '.join(sorted(set(a) - set(b))[:5])}"
        for folder, a, b in ((train_dir, classes, val_classes), (val_dir, val_classes, classes))
        if set(a) - set(b)
    ]
    raise DataError(
        f"{train_dir} and {val_dir} hold different class folders ({'; '.join(only)}); both need the "
        "same class names."
    )


def _at_least_two(folder: Path, classes: dict[str, int]) -> None:
    if len(classes) < 2:
        raise DataError(
            f"{folder} holds one class folder ({', '.join(classes)}): a classifier of one class is always "
            "right, so training and accuracy would mean nothing. Add a folder per class (at least two)."
        )


def _folders(dataset: Dataset) -> set[str]:
    """The real paths of the folders ``dataset``'s images are in (links followed)."""
    folders = {os.path.dirname(path) for path, _ in dataset.reader.samples}
    return {os.path.realpath(folder) for folder in folders}


def _transform(config: dict[str, Any], augmentation: Augmentation | None):
    """timm's transform for ``config``: training with ``augmentation``, else evaluation (None)."""
    import timm.data

    if augmentation is None:
        return timm.data.create_transform(**config, is_training=False)
    if augmentation.aa is not None and not aa_policy(augmentation.aa):
        raise DataError(
            f"the AutoAugment policy --aa {augmentation.aa[:100]} asks for more work per image than odeify "
            f"allows ({', '.join(f'{k} at most {v}' for k, v in AA_BOUNDS.items())}); ask for less."
        )
    try:
        return timm.data.create_transform(**config, is_training=True, **augmentation.transform_kwargs())
    except (AssertionError, KeyError, ValueError, TypeError, IndexError) as exc:
        raise DataError(
            f"timm cannot build the training augmentation {augmentation} ({type(exc).__name__}: {exc}); "
            "check --aa (timm's policy names: rand-m9-mstd0.5, augmix-m5-w3, original, v0, ...), --scale "
            "and --ratio."
        ) from exc


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
    split in order, on one process. An image folder's batch is checked against the input budget.
    """
    size = getattr(dataset, "input_size", None)
    if size is not None:
        check_input_bytes(
            f"a batch of {batch_size} images at the data config's input size",
            (batch_size, *size),
            4,
            fix="use a smaller --batch-size or input size (--input-size)",
        )
    sampler = DistributedSampler(
        dataset, num_replicas=world_size if train else 1, rank=rank if train else 0, shuffle=train, seed=seed
    )
    return _Loader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=train,
        num_workers=workers,
        persistent_workers=False,
    )


class _Loader(DataLoader):
    """A DataLoader whose workers' DataErrors read as the main process's: torch raises a worker's error
    again with the worker's whole traceback in its message, where ``workers=0`` gives the one line."""

    def __iter__(self):
        batches = super().__iter__()
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except DataError as exc:
                raise DataError(_raised_in_worker(str(exc))) from None
            yield batch


def _raised_in_worker(message: str) -> str:
    """The message a worker's DataError was raised with, out of torch's "Caught DataError in
    DataLoader worker process N. Original Traceback ..." (which ends with the error's own line)."""
    if not message.startswith(f"Caught {DataError.__name__} in DataLoader worker"):
        return message
    return message.rpartition(f"{DataError.__module__}.{DataError.__qualname__}: ")[2].rstrip("\n")


# -- what fine-tuning checks of its data -----------------------------------------------------------
def check_data(data: object, model: nn.Module) -> None:
    """Refuse data that cannot train ``model``, naming the split and sample; warn on huge inputs.

    Labels are int64 class indices in [0, num_classes) (or the ignore index -100); inputs are
    floating-point images with the model's channel count and finite values. An in-memory split (a
    ``TensorDataset``) is checked whole, any other dataset by its first sample.
    """
    if not isinstance(data, LabelledData):
        raise DataError(
            f"fine-tuning takes a LabelledData (odeify.train.datasets.open_data or LabelledData(name, train, "
            f"val, num_classes)), not {type(data).__name__}."
        )
    n = data.num_classes
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NUM_CLASSES:
        raise DataError(f"{data.name}: num_classes must be an integer in [1, {MAX_NUM_CLASSES}], not {n!r}.")
    channels = _input_shape(model)[1]
    for split, dataset in (("training", data.train), ("validation", data.val)):
        if len(dataset) == 0:
            raise DataError(f"{data.name}: the {split} split is empty.")
        if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
            x, y = dataset.tensors
        else:
            sample = dataset[0]
            x, y = sample[0].unsqueeze(0), torch.as_tensor([sample[1]])
        _check_inputs(x, channels, f"{data.name}: the {split} split's inputs")
        _check_labels(y, n, f"{data.name}: the {split} split's labels")


def _check_inputs(x: object, channels: int, where: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 4 or not x.is_floating_point():
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise DataError(f"{where} must be floating-point images [N, C, H, W]; got {got}.")
    if x.shape[1] != channels:
        raise DataError(f"{where} have {x.shape[1]} channel(s), the model takes {channels}.")
    finite = torch.isfinite(x).flatten(1).all(1)
    if not bool(finite.all()):
        first = int((~finite).nonzero()[0])
        raise DataError(f"{where} hold NaN or inf values (sample {first} is the first); clean the data.")
    largest = float(x.abs().max())
    if largest > LARGE_INPUT:
        warnings.warn(
            f"{where} reach {largest:.3g} in magnitude; images are usually normalised to a few units "
            "around 0 (timm's transforms do this). Check the data's scaling.",
            UserWarning,
            stacklevel=3,
        )


def _check_labels(y: object, n: int, where: str) -> None:
    if not isinstance(y, torch.Tensor) or y.dtype != torch.int64:
        got = y.dtype if isinstance(y, torch.Tensor) else type(y).__name__
        raise DataError(f"{where} must be int64 class indices (torch.long); got {got}: pass y.long().")
    bad = (y != IGNORE_INDEX) & ((y < 0) | (y >= n))
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0]) if bad.ndim else 0
        raise DataError(
            f"{where} hold {int(y.reshape(-1)[first])} (sample {first}), outside the {n} classes "
            f"[0, {n - 1}]; labels are class indices (or {IGNORE_INDEX}, ignored)."
        )


def fingerprint(data: LabelledData) -> dict[str, Any]:
    """What identifies ``data`` for a resumed run: its classes and, per split, its samples.

    An in-memory split is hashed whole; an image folder by its class names and file list (relative
    paths and sizes, not contents: reading every image again would cost as much as an epoch).
    """
    return {
        "classes": _class_names(data.train) or data.num_classes,
        "train": _split_print(data.train),
        "val": _split_print(data.val),
    }


def _class_names(dataset: Dataset) -> list[str] | None:
    classes = getattr(getattr(dataset, "reader", None), "class_to_idx", None)
    return sorted(classes, key=classes.get) if isinstance(classes, dict) else None


def _split_print(dataset: Dataset) -> dict[str, Any]:
    digest = hashlib.sha256()
    if isinstance(dataset, TensorDataset):
        for tensor in dataset.tensors:
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        reader = getattr(dataset, "reader", None)
        samples = getattr(reader, "samples", None)
        if not isinstance(samples, list):
            return {"samples": len(dataset), "content": None}  # a dataset odeify cannot look into
        for path, target in samples:
            relative = os.path.relpath(path, reader.root)
            digest.update(f"{relative}\0{os.stat(path).st_size}\0{target}\n".encode())
    return {"samples": len(dataset), "content": digest.hexdigest()[:32]}
