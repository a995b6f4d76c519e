"""--device and --data as eval, sweep and finetune read them: a device this machine has, a data set
that exists (checked before the model loads), its validation batches."""

from __future__ import annotations

import argparse

import torch
from torch import nn

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


def require_data(spec: str | None) -> None:
    """--data is given and names a data set; checked before the model loads (seconds)."""
    from odeify.train.datasets import check_data_spec

    if spec is None:
        raise ConfigError(
            "--data is required: 'digits' for the built-in set, or an ImageFolder DIR (train/, val/)."
        )
    check_data_spec(spec)


def val_batches(args: argparse.Namespace, model: nn.Module):
    from odeify.train.datasets import make_loader, open_data

    require_data(args.data)
    data = open_data(args.data, model)
    return make_loader(data.val, args.batch_size, train=False, workers=args.workers)
