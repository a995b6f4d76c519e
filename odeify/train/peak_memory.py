"""The peak memory of an epoch's training, as a user watching for out-of-memory reads it.

On a GPU: ``torch.cuda.max_memory_allocated`` since the epoch began. On the CPU: the process's peak
resident memory (``VmHWM``), restarted at the epoch's start where the kernel allows it (Linux 4.0 and
later; elsewhere the peak includes what came before, and on systems without ``/proc`` it is unknown).
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["EpochPeakMemory"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class EpochPeakMemory:
    """``start()`` at an epoch's start, ``mib()`` at its end: the peak in MiB, or None where unknown."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            _CLEAR_REFS.write_text("5")  # restart VmHWM at the current resident memory
        except OSError:
            pass

    def mib(self) -> float | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        try:
            lines = _STATUS.read_text().splitlines()
        except OSError:
            return None
        peak = [line.split()[1] for line in lines if line.startswith("VmHWM:")]
        return int(peak[0]) / 1024 if peak else None
