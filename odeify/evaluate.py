"""Evaluate a model on labelled batches: accuracy, loss, field evaluations and time per batch."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from odeify.conversion import converted_stages
from odeify.emit import count_evaluations
from odeify.errors import ConfigError

__all__ = ["Evaluation", "evaluate", "field_evaluations"]


@dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate` measured. ``seconds_per_batch`` is the median forward time of a batch."""

    accuracy: float
    loss: float
    samples: int
    batches: int
    nfe: int
    seconds_per_batch: float

    def to_dict(self) -> dict[str, float | int]:
        return {
            "accuracy": self.accuracy,
            "loss": self.loss,
            "samples": self.samples,
            "batches": self.batches,
            "nfe": self.nfe,
            "seconds_per_batch": self.seconds_per_batch,
        }


def field_evaluations(model: nn.Module) -> int:
    """Field evaluations (block evaluations) of all ODE stages in one forward pass."""
    return sum(count_evaluations(stage) for stage in converted_stages(model))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device | str | None = None,
    max_batches: int | None = None,
) -> Evaluation:
    """Top-1 accuracy and mean cross-entropy of ``model`` in eval mode over ``batches``.

    The model's train/eval mode is restored afterwards. The time per batch covers the forward pass
    only (not data loading), synchronised on GPUs.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = samples = 0
    loss_sum = 0.0
    times: list[float] = []
    try:
        for index, (x, y) in enumerate(batches):
            if max_batches is not None and index == max_batches:
                break
            x, y = x.to(device), y.to(device)
            _sync(device)
            started = time.perf_counter()
            logits = model(x)
            _sync(device)
            times.append(time.perf_counter() - started)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            samples += len(y)
    finally:
        model.train(was_training)
    if samples == 0:
        raise ConfigError("evaluate got no batches: the evaluation split is empty.")
    return Evaluation(
        accuracy=correct / samples,
        loss=loss_sum / samples,
        samples=samples,
        batches=len(times),
        nfe=field_evaluations(model),
        seconds_per_batch=statistics.median(times),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
