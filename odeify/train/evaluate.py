"""Measure a model: accuracy, loss, field evaluations and time per batch; memory kept for backward."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from odeify.codegen.emit import count_evaluations
from odeify.compiler.conversion import converted_stages
from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError

__all__ = ["Evaluation", "evaluate", "field_evaluations", "saved_for_backward"]


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
    dtype = model_dtype(model)  # images arrive as float32; a float64 model reads them as float64
    was_training = model.training
    model.eval()
    correct = samples = 0
    loss_sum = 0.0
    times: list[float] = []
    try:
        for index, (x, y) in enumerate(batches):
            if max_batches is not None and index == max_batches:
                break
            x, y = x.to(device, dtype), y.to(device)
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


def saved_for_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd keeps between forward and backward in one training step on ``(x, y)``.

    Every tensor packed for backward (``saved_tensors_hooks``) counts once per storage; the
    parameters' own storages are left out (they exist anyway). The model is left in train mode
    with its gradients cleared.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in params:
            storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())
