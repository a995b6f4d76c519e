"""A data set that fails mid-run: the crash a resumed fine-tuning run must recover from."""

from __future__ import annotations

from torch.utils.data import Dataset


class CrashAfter(Dataset):
    """``base``, raising once ``limit`` samples have been read: a crash mid-run."""

    def __init__(self, base: Dataset, limit: int) -> None:
        self.base, self.limit, self.reads = base, limit, 0

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        self.reads += 1
        if self.reads > self.limit:
            raise RuntimeError("simulated crash")
        return self.base[index]
