"""Stepping a memory-saving pass over slices of the batch, so its working set follows a slice.

What a reversible stage needs while it steps (float64 registers and increments, the field's
activations in the re-run, the cotangents) grows with the batch; what it keeps between forward and
backward does not need to. A stage's field is per sample (a BatchNorm in training mode is refused,
:func:`odeify.runtime.rerun.training_batchnorm`) and so is the lattice (one spacing per sample), so
a slice of the batch computes its samples' states on its own. Forward and backward use the same
slices, so the rebuild stays exact whatever a kernel does at another batch size. A slice's outputs
need not carry the whole batch's bits: on the CPU we measured, convs on maps of 7x7 and larger gave a
slice the batch's bits, one-sample slices of smaller maps did not (their float32 error, still within
its own round-off, was about twice the batch's); tests/test_batch_slices.py checks the rebuild.

A slice is sized by what one sample costs while it steps: its float64 register plus the tensors one
evaluation of the field creates for it (what a re-run with grad keeps), measured once per input
shape on one sample (:func:`probe_sample_bytes`), and holds at most :data:`SLICE_BYTES` of that, at
least one sample. At 224x224 on the CPU that is one sample a slice in resnet50's first two stages,
three in its third (and resnet152's), seven in its fourth, four in a ViT's blocks
(benchmarks/results/peak_memory.md has the steps' peaks and times).

What ``torch.compile`` traces (a checkpointed segment between stages, :mod:`odeify.passes.segments`)
steps its batch whole: the probe's dispatch mode and cache cannot be traced (a graph break inside
a segment made dynamo compile every segment as one frame, recompiled with dynamic shapes that
inductor then failed on), and a compiled backward recomputes a checkpointed region where its
partitioner places it, not slice by slice. The stages' own passes run eagerly, sliced as above.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["SLICE_BYTES", "batch_slices", "probe_sample_bytes"]

MIB = 2**20

SLICE_BYTES = {"cpu": 16 * MIB, "cuda": 512 * MIB}
"""What one slice may cost while it steps (float64 register and one evaluation's tensors), by device
type (others take the CUDA figure). On the CPU, measured on one training step: slices of one sample
slowed resnet152's small layer3 states (8.1 s a step against 6.5 s at five samples a slice, 6.6 s
unsliced), slices of six a ViT's memory (77 MiB at batch 16 against 52 at three). On a GPU a slice
must stay large enough to fill the device (not measured here: no GPU was lent)."""


def batch_slices(*batches: Tensor, sample_bytes: int | None = None) -> list[slice]:
    """The rows each slice of a batch takes, in order: as many samples as :data:`SLICE_BYTES` holds
    at ``sample_bytes`` each (default: the largest sample among ``batches`` as float64), at least
    one. One slice for a batch of one, for tensors that do not share their first dimension (what
    their rows mean is not known then), or while ``torch.compile`` traces the caller (module
    docstring)."""
    if torch.compiler.is_compiling():
        return [slice(None)]
    sizes = {t.shape[0] if t.dim() else None for t in batches}
    batch = sizes.pop() if len(sizes) == 1 else None
    if batch is None or batch <= 1:
        return [slice(None)]
    if sample_bytes is None:
        sample_bytes = 8 * max(t[0].numel() for t in batches)
    budget = SLICE_BYTES.get(batches[0].device.type, SLICE_BYTES["cuda"])
    rows = max(1, budget // max(sample_bytes, 1))
    if rows >= batch:
        return [slice(None)]
    return [slice(start, min(start + rows, batch)) for start in range(0, batch, rows)]


_PROBED: weakref.WeakKeyDictionary[object, dict[tuple, int]] = weakref.WeakKeyDictionary()


def probe_sample_bytes(
    owner: object, run: Callable[[Sequence[Tensor]], object], batches: Sequence[Tensor]
) -> int:
    """Bytes of the tensors ``run`` creates for one sample of ``batches`` (their first rows), counted
    once per ``owner`` and sample shape: ``run`` under ``no_grad`` with the RNG forked, so nothing
    the caller draws afterwards changes. While ``torch.compile`` traces the caller, nothing runs and
    the answer is 0: a traced caller steps its batch whole (:func:`batch_slices`)."""
    if torch.compiler.is_compiling():
        return 0
    key = tuple((tuple(t.shape[1:]), t.dtype, t.device.type) for t in batches)
    cache = _PROBED.setdefault(owner, {})
    if key not in cache:
        counter = _CreatedBytes()
        devices = [t.device for t in batches if t.device.type == "cuda"][:1]
        samples = [t[:1].clone() for t in batches]  # what the run does in place stays in the copy
        with torch.no_grad(), torch.random.fork_rng(devices=devices), counter:
            run(samples)
        cache[key] = counter.total
    return cache[key]


class _CreatedBytes(TorchDispatchMode):
    """Sums the bytes of the storages operators create: every output that is not one of the op's
    inputs or a view of one (in-place ops and views create nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)
        }
        created = {t.untyped_storage() for t in tree_leaves(out) if isinstance(t, Tensor)}
        self.total += sum(s.nbytes() for s in created if s.data_ptr() not in inputs)
        return out
