"""Where calibration keeps the activations it fits to: in memory within a byte budget, the rest in
a temporary file read back row by row.

Calibration holds, for the stage it fits, the stage's inputs at each depth asked and its target on
every calibration image: resnet50's layer1 at 224x224 is 3.2 MB per image per tensor, 822 MB for 256
images, and the stages' targets, taken in one pass of the source network, four times that. A
:class:`Budget` hands out the bytes: a :class:`Rows` that fits what is left of it stays in memory,
one that does not is written to an unnamed temporary file (gone when closed, or when the process
ends) and read back with plain reads, not mapped, so what lies on disk never counts as the
process's resident memory. Either way the rows read back are the rows written, bit for bit.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import torch

__all__ = ["Budget", "Rows"]

MIB = 2**20


class Budget:
    """The bytes of activations calibration may hold in memory at once; what it spilled to disk."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.left = nbytes
        self.spilled = 0

    def rows(self, n: int, like: torch.Tensor) -> Rows:
        """Room for ``n`` rows shaped as ``like``'s rows: in memory where they fit what is left."""
        size = n * like[0].numel() * like.element_size()
        in_memory = size <= self.left
        if in_memory:
            self.left -= size
        else:
            self.spilled += size
        return Rows(self, n, like, size, in_memory)


class Rows:
    """``n`` rows of one shape and dtype, written in order (:meth:`append`), read back in order
    (:meth:`batches`) or by index (:meth:`take`), on the device of the rows written."""

    def __init__(self, budget: Budget, n: int, like: torch.Tensor, size: int, in_memory: bool) -> None:
        self.budget, self.n, self.size = budget, n, size
        self.shape, self.dtype, self.device = tuple(like.shape[1:]), like.dtype, like.device
        self.row_bytes = like[0].numel() * like.element_size()
        self.written = 0
        self.data = torch.empty((n, *self.shape), dtype=self.dtype, device=self.device) if in_memory else None
        self.file = None if in_memory else tempfile.TemporaryFile(buffering=0)

    def append(self, batch: torch.Tensor) -> None:
        """Write the next rows."""
        if self.data is not None:
            self.data[self.written : self.written + batch.shape[0]] = batch
        else:
            self.file.write(memoryview(_bytes(batch.detach().cpu().contiguous()).numpy()))
        self.written += batch.shape[0]

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """The rows at ``index``, in its order."""
        if self.data is not None:
            return self.data[index]
        out = torch.empty((len(index), *self.shape), dtype=self.dtype)
        view = _bytes(out).numpy()
        for i, row in enumerate(index.tolist()):
            self._read(row, memoryview(view[i * self.row_bytes : (i + 1) * self.row_bytes]))
        return out.to(self.device)

    def batches(self, size: int) -> Iterator[torch.Tensor]:
        """The rows in order, ``size`` at a time."""
        if self.data is not None:
            yield from self.data.split(size)
            return
        for start in range(0, self.n, size):
            out = torch.empty((min(size, self.n - start), *self.shape), dtype=self.dtype)
            self._read(start, memoryview(_bytes(out).numpy()))
            yield out.to(self.device)

    def close(self) -> None:
        """Give the rows' memory back to the budget, or delete their file."""
        if self.data is not None:
            self.data = None
            self.budget.left += self.size
        elif self.file is not None:
            self.file.close()
            self.file = None

    def _read(self, row: int, into: memoryview) -> None:
        self.file.seek(row * self.row_bytes)
        done = 0
        while done < len(into):
            got = self.file.readinto(into[done:])
            if not got:
                raise OSError(f"calibration's temporary file ended at row {row}: was it changed?")
            done += got


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes, as a flat uint8 view (any dtype, bfloat16 included)."""
    return tensor.reshape(-1).view(torch.uint8)
