"""The most tensor bytes alive at once while some code runs: a training step's peak, op by op.

Resident memory (RSS) says what the process touched, allocator caching and page reuse included, and
differs between runs; this counts the storages of the tensors that operators create, from their
creation to their release, under a ``TorchDispatchMode``, so the same step gives the same bytes on
any machine. Tensors alive before it starts (parameters, gradients, inputs) are not counted;
kernels' internal scratch memory is not seen. At the peak it keeps what was alive, by the op that
made it, its dtype and shape: :meth:`TensorPeak.breakdown`.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Alive", "TensorPeak"]


@dataclass(frozen=True)
class Alive:
    """One storage alive at the peak: its bytes and the op, dtype and shape that made it."""

    nbytes: int
    op: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class TensorPeak(TorchDispatchMode):
    """``with TensorPeak(before=model.parameters()) as peak: step()``, then ``peak.peak`` (bytes).

    ``before``: tensors that exist already and are not to be counted when an op returns them or a
    view of them (parameters, their gradients, the inputs).
    """

    def __init__(self, before: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in before}
        self.alive: dict[int, Alive] = {}
        self.current = 0
        self.peak = 0
        self.at_peak: list[Alive] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        grew = False
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                grew |= self._note(t, str(func.overloadpacket.__name__))
        if grew and self.current > self.peak:
            self.peak = self.current
            self.at_peak = list(self.alive.values())
        return out

    def _note(self, tensor: torch.Tensor, op: str) -> bool:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.known or key in self.alive or storage.nbytes() == 0:
            return False
        self.alive[key] = Alive(storage.nbytes(), op, tensor.dtype, tuple(tensor.shape))
        self.current += storage.nbytes()
        weakref.finalize(storage, self._release, key)
        return True

    def _release(self, key: int) -> None:
        alive = self.alive.pop(key, None)
        if alive is not None:
            self.current -= alive.nbytes

    def breakdown(self, top: int = 12) -> list[tuple[int, str]]:
        """What was alive at the peak, largest first: (bytes, 'op dtype shape'), alike ones summed."""
        groups: Counter[str] = Counter()
        for a in self.at_peak:
            groups[f"{a.op} {str(a.dtype).removeprefix('torch.')} {list(a.shape)}"] += a.nbytes
        return [(n, what) for what, n in groups.most_common(top)]
