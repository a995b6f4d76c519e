"""The peak memory of one training step of a model, measured before a run trains it.

``odeify finetune`` picks its default backward mode by this measure (:mod:`odeify.train.manifestations`):
which mode's step holds fewer bytes depends on the model and the input, not only on the mode
(reversible ALF is lowest on 224x224 ResNets, ViTs and ConvNeXts; checkpointing on a resnet18 at
32x32, whose peak is a weight gradient: benchmarks/results/peak_memory_user.md). The measure is
:class:`odeify.inspection.TensorPeak`'s: bytes of tensors alive at once, the same on every machine
and every rank for the same model, batch shape and device type.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from odeify.inspection.tensor_peak import TensorPeak

__all__ = ["training_step_peak"]


def training_step_peak(model: nn.Module, batch_shape: Sequence[int], device: torch.device) -> int:
    """Bytes of one training step's tensor peak, over the weights, their gradients and the batch.

    The step runs on a copy of ``model`` in train mode on ``device``, on a standard-normal batch of
    ``batch_shape`` drawn from a fixed seed, with its gradients allocated first (as from the second
    step of a run on) and the RNG forked: ``model`` and what the caller draws next are unchanged.
    The loss is the mean square of the output: any scalar loss gives a whole backward pass, and a
    loss's own tensors are a batch of logits, small beside the model's.
    """
    probe = copy.deepcopy(model).to(device).train()
    trained = [p for p in probe.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.zeros_like(p)
    dtype = next((p.dtype for p in probe.parameters() if p.is_floating_point()), torch.float32)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(0)
        batch = torch.randn(tuple(batch_shape), dtype=dtype, device=device)
        before = [*probe.parameters(), *probe.buffers(), *(p.grad for p in trained), batch]
        with TensorPeak(before=before) as peak:
            probe(batch).float().square().mean().backward()
    return peak.peak
