"""Checkpoint files as timm users hold them, written by timm's own tools (for the loading and CLI tests).

Each helper takes a model and a folder and returns the path it wrote: a ``train.py`` checkpoint
(timm's ``CheckpointSaver``, with ``args`` and EMA weights that differ from the model's), plain state
dicts (``.pth``, ``.safetensors``), and a Hugging Face-style folder (``timm.models.save_for_hf``).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import safetensors.torch
import torch
from timm.models import save_for_hf
from timm.optim import create_optimizer_v2
from timm.utils import CheckpointSaver, ModelEmaV3
from torch import nn

from odeify.models.timm_interface import default_input_size


def train_checkpoint(
    model: nn.Module,
    folder: Path,
    arch: str,
    num_classes: int,
    epochs: int = 2,
    model_kwargs: dict | None = None,
    **args_set: object,
) -> Path:
    """``model_best.pth.tar`` as timm's train.py writes it; the model's weights are left as they were.

    One optimizer step per epoch on random data makes ``state_dict`` and ``state_dict_ema`` differ.
    ``args`` is an ``argparse.Namespace`` with the fields train.py records (model, num_classes, ...;
    ``model_kwargs``: what ``--model-kwargs`` records, the other build kwargs of ``model``), plus
    ``args_set`` (e.g. ``img_size=32, hflip=0.0``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(model).train()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-2, weight_decay=0.05)
    ema = ModelEmaV3(model, decay=0.5)
    args = argparse.Namespace(
        model=arch, num_classes=num_classes, in_chans=None, input_size=None, gp=None,
        model_kwargs=dict(model_kwargs or {}), lr=1e-2, epochs=epochs, opt="adamw", sched="cosine",
        device="cpu", amp=False, data_dir="/data", smoothing=0.1, decay_milestones=[90, 180],
        layer_decay=None, pretrained=False, **args_set,
    )  # fmt: skip
    saver = CheckpointSaver(model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(folder))
    generator = torch.Generator().manual_seed(0)
    chans = default_input_size(model)[1]
    for epoch in range(epochs):
        x = torch.randn(4, chans, 32, 32, generator=generator)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema.update(model)
        saver.save_checkpoint(epoch, metric=float(epoch))
    return folder / "model_best.pth.tar"


def plain_pth(model: nn.Module, path: Path) -> Path:
    """``torch.save(model.state_dict(), path)``."""
    torch.save(model.state_dict(), path)
    return path


def plain_safetensors(model: nn.Module, path: Path) -> Path:
    """A safetensors state dict with no metadata, as ``safetensors.torch.save_file`` writes it."""
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def hf_folder(model: nn.Module, folder: Path) -> Path:
    """``config.json`` + ``model.safetensors`` from ``timm.models.save_for_hf``."""
    save_for_hf(model, str(folder), safe_serialization=True)
    return folder
