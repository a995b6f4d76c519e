"""Stepping a memory-saving stage over slices of the batch, so its working set follows a slice.

What a reversible stage needs while it steps (float64 registers and increments, the field's
activations in the re-run, the cotangents) grows with the batch; what it keeps between forward and
backward does not need to. A stage's field is per sample (a BatchNorm in training mode is refused,
:func:`odeify.runtime.rerun.training_batchnorm`) and so is the lattice (one spacing per sample), so
a slice of the batch computes its samples' states on its own. Forward and backward use the same
slices, so the rebuild stays exact whatever a kernel does at another batch size (the CPU's conv and
matmul kernels give the whole batch's bits on a slice: tests/test_batch_slices.py).

The slice is sized by its float64 register: :data:`SLICE_BYTES` per device type, at least one sample.
Measured on resnet50, batch 16 at 224 on the CPU (benchmarks/peak_memory.py): the reversible ALF
step's peak fell from 1.6x to 0.55x timm checkpointing's at the same step time.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["SLICE_BYTES", "batch_slices"]

MIB = 2**20

SLICE_BYTES = {"cpu": 2 * MIB, "cuda": 64 * MIB}
"""Bytes of one float64 register a slice may hold, by device type (others take the CUDA figure).

On the CPU small slices cost nothing: the kernels run at the speed of the whole batch down to one
sample of resnet50's first stage (6 MiB of float64 a sample). On a GPU a slice must stay large enough
to fill the device."""


def batch_slices(*batches: Tensor) -> list[slice]:
    """The rows each slice of a batch takes, in order, sized by the largest sample among ``batches``
    (tensors sharing their first dimension); one slice for a batch of one, or for tensors that do not
    share a first dimension (what their rows mean is not known then)."""
    sizes = {t.shape[0] if t.dim() else None for t in batches}
    batch = sizes.pop() if len(sizes) == 1 else None
    if batch is None or batch <= 1:
        return [slice(None)]
    per_sample = 8 * max(t[0].numel() for t in batches)
    budget = SLICE_BYTES.get(batches[0].device.type, SLICE_BYTES["cuda"])
    rows = max(1, budget // max(per_sample, 1))
    if rows >= batch:
        return [slice(None)]
    return [slice(start, min(start + rows, batch)) for start in range(0, batch, rows)]
