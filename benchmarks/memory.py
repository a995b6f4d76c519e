"""How the benchmarks measure memory: bytes saved for backward, and the process's resident memory."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


class SavedBytes:
    """Bytes of the tensors autograd saves for backward, once per storage, parameters excluded.

    Use ``with counter.counting():`` around a forward. Parameters are excluded because they exist
    whatever the backward mode; a storage saved twice (an output saved by its op and by the next
    op as its input) counts once. Tensors kept outside autograd's saved tensors (a closure) are
    not seen; ``torch.utils.checkpoint`` (non-reentrant) saves its inputs through autograd, so its
    inputs are seen.
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, int] = {}

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.storages.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    @contextmanager
    def counting(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield


def rss(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process, in bytes.

    Not getrusage's ru_maxrss: Linux carries the parent's peak over fork/exec into the child's,
    so a child of the parent that built resnet50 would report the parent's peak.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Restart VmHWM at the current RSS (Linux >= 4.0), so the next peak is the step's own.

    Where the kernel does not offer it (gVisor), the peak includes the setup's.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
