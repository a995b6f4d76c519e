"""The project's own trained model and its data: a small timm ResNet on scikit-learn's 8x8 digits.

``digits_resnet`` builds the architecture (registered as the arch name ``"odeify.digits_resnet"``),
``load_digits`` returns the data exactly as the shipped model (``DEFAULT_MODEL_PATH``, trained by
``examples/train_digits.py``) saw it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from timm.models._manipulate import checkpoint_seq
from timm.models.resnet import BasicBlock, ResNet
from torch import Tensor, nn

from odeify.core.errors import OdeifyError
from odeify.models import DEFAULT_MODEL_PATH

__all__ = [
    "DEFAULT_MODEL_PATH",
    "DIGITS_ARCH",
    "DIGITS_MEAN",
    "DIGITS_NUM_CLASSES",
    "DIGITS_SEED",
    "DIGITS_SIZE",
    "DIGITS_STD",
    "DIGITS_TEST_FRACTION",
    "META_DIGITS",
    "DigitsResNet",
    "digits_resnet",
    "digits_split",
    "load_digits",
]

DIGITS_ARCH = "odeify.digits_resnet"
DIGITS_SIZE = 32  # images are upsampled 8x8 -> 32x32: stem /4 leaves 8x8 and 4x4 feature maps
DIGITS_SEED = 0  # seed of the train/test permutation
DIGITS_TEST_FRACTION = 0.2
DIGITS_MEAN = 0.3053  # mean and std of pixel/16 over the whole data set (fixed constants, not fitted)
DIGITS_STD = 0.3761
DIGITS_NUM_CLASSES = 10
META_DIGITS = "odeify_digits"  # checkpoint metadata key: the split and training record (JSON)


class DigitsResNet(ResNet):
    """timm's ResNet with any number of stages (the digits model has two).

    timm's ``ResNet.forward_features`` calls layer1..layer4 by name, so a two-stage ResNet needs
    this one override; everything else (stem, blocks, head, init, fx tracing) is timm's.
    """

    def forward_features(self, x: Tensor) -> Tensor:
        """Stem, then every ``layerN`` stage in order."""
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        stages = [getattr(self, f"layer{i + 1}") for i in range(len(self.feature_info) - 1)]
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(stages, x, flatten=True)
        for stage in stages:
            x = stage(x)
        return x


def digits_resnet(
    *,
    layers: tuple[int, ...] | list[int] = (4, 4),
    channels: tuple[int, ...] | list[int] = (16, 32),
    stem_width: int = 8,
    stem_type: str = "deep",
    in_chans: int = 1,
    num_classes: int = DIGITS_NUM_CLASSES,
    img_size: int = DIGITS_SIZE,
    **kwargs: Any,
) -> nn.Module:
    """Build the digits ResNet: timm's ResNet with BasicBlocks, sized for 1x32x32 inputs.

    The deep stem's output width (2 * stem_width) equals channels[0], so every block of stage 1 and
    all but the first of stage 2 are same-shape identity blocks (runs of 4 and 3 with the defaults).
    Spatial sizes for 32x32 inputs: stem 32 -> 16 -> 8 (max pool), stage 1 at 8x8, stage 2 at 4x4.
    ``img_size`` only sets ``pretrained_cfg["input_size"]`` (the net itself is size agnostic).
    """
    model = DigitsResNet(
        block=BasicBlock,
        layers=tuple(layers),
        channels=tuple(channels),
        stem_width=stem_width,
        stem_type=stem_type,
        in_chans=in_chans,
        num_classes=num_classes,
        **kwargs,
    )
    cfg = {
        "architecture": DIGITS_ARCH,
        "input_size": (in_chans, img_size, img_size),
        "num_classes": num_classes,
        "mean": (DIGITS_MEAN,) * in_chans,
        "std": (DIGITS_STD,) * in_chans,
        "first_conv": "conv1.0" if "deep" in stem_type else "conv1",
        "classifier": "fc",
    }
    model.pretrained_cfg = cfg
    model.default_cfg = cfg
    # what timm's factory records for its own models (timm.models.get_model_args reads it back)
    model._model_args = {
        "layers": list(layers),
        "channels": list(channels),
        "stem_width": stem_width,
        "stem_type": stem_type,
        "in_chans": in_chans,
        "num_classes": num_classes,
        "img_size": img_size,
        **kwargs,
    }
    return model


def digits_split(
    seed: int = DIGITS_SEED, test_fraction: float = DIGITS_TEST_FRACTION, n: int = 1797
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices into the digits data set; stable across numpy versions."""
    perm = np.random.RandomState(seed).permutation(n)  # legacy RandomState: a frozen stream
    n_test = int(round(n * test_fraction))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def load_digits(
    split: str = "test", size: int = DIGITS_SIZE, *, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """The digits ``(x, y)`` exactly as the shipped model was trained on them.

    ``x``: (N, 1, size, size), pixel/16 standardised with DIGITS_MEAN/DIGITS_STD, then bilinearly
    upsampled; ``y``: int64 labels. ``split`` is "train", "test" (the held-out 20%) or "all".
    """
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as exc:  # pragma: no cover - scikit-learn is in the test extra
        raise OdeifyError(
            "load_digits needs scikit-learn (the digits data ship with it): pip install scikit-learn"
        ) from exc
    data = sk_load_digits()
    images = torch.from_numpy(data.images).to(torch.float32)
    labels = torch.from_numpy(data.target).to(torch.int64)
    train_idx, test_idx = digits_split(n=len(labels))
    if split == "train":
        idx = torch.from_numpy(train_idx)
    elif split == "test":
        idx = torch.from_numpy(test_idx)
    elif split == "all":
        idx = torch.arange(len(labels))
    else:
        raise OdeifyError(f"load_digits: split must be 'train', 'test' or 'all', not {split!r}")
    x = ((images[idx] / 16.0 - DIGITS_MEAN) / DIGITS_STD).unsqueeze(1)
    if size != x.shape[-1]:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x.to(dtype).contiguous(), labels[idx]
