"""--device and --data as eval, sweep and finetune read them: a device this machine has, a data set
that exists (checked before the model loads), its validation batches."""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

from odeify.core.errors import ConfigError

__all__ = ["check_device", "chosen_device", "require_data", "val_batches"]


def check_device(name: str | None) -> None:
    """--device names a device this machine has."""
    if name is not None and name.startswith("cuda"):
        index = int(name.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s). Pass "
                "--device cpu, or leave --device out (CUDA when available, else the CPU)."
            )


def chosen_device(args: argparse.Namespace) -> torch.device:
    """--device, else CUDA when available."""
    if args.device is not None:
        check_device(args.device)
        return torch.device(args.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def require_data(spec: str | None, *, evaluation: bool = False) -> None:
    """--data is given and names a data set (with ``evaluation``, one that evaluation alone reads: no
    train/ needed); checked before the model loads (seconds)."""
    from odeify.train.datasets import check_data_spec

    if spec is None:
        raise ConfigError(
            "--data is required: 'digits' for the built-in set, or an ImageFolder DIR (train/, val/)."
        )
    check_data_spec(spec, evaluation=evaluation)


def val_batches(args: argparse.Namespace, model: nn.Module) -> tuple[DataLoader, str]:
    """The batches of the split evaluation reads, and which it is (a folder, or the digits test split)."""
    from odeify.train.datasets import make_loader, open_evaluation

    require_data(args.data, evaluation=True)
    data = open_evaluation(args.data, model)
    _check_classes(data.num_classes, data.read, model, args)
    return make_loader(data.val, args.batch_size, train=False, workers=args.workers), data.read


def _check_classes(classes: int, read: str, model: nn.Module, args: argparse.Namespace) -> None:
    """The model has an output for every class of the data (labels past its head cannot be scored)."""
    from odeify.cli.model_flags import model_source

    outputs = getattr(model, "num_classes", None)
    if not isinstance(outputs, int) or not 0 < outputs < classes:
        return
    labels = f"label {outputs} has" if classes == outputs + 1 else f"labels {outputs} to {classes - 1} have"
    raise ConfigError(
        f"{read} holds {classes} class folders, but the model predicts {outputs} classes: the {labels} no "
        f"output to score. Evaluate on data of the model's {outputs} classes, or fine-tune it on these "
        f"classes first (odeify finetune {model_source(args)} --data DIR --out RUN, with DIR/train/ and "
        f"DIR/val/, resets its classifier to {classes} classes), then evaluate RUN/best.safetensors."
    )
