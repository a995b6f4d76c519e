"""Where this process runs: its rank in a torchrun (or SLURM) job and its device.

Set-up is timm's ``init_distributed_device_so``, as timm's ``train.py`` uses it: it reads the
torchrun variables and SLURM's, and picks gloo on CPU and nccl on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Processes", "start_processes", "stop_processes"]


@dataclass(frozen=True)
class Processes:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun) and its device."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def start_processes(device: str | None = None) -> Processes:
    """Join the torchrun or SLURM job described by the environment, if any (timm's set-up).

    ``device``: ``"cuda"``, ``"cpu"`` (default: CUDA when available); under torchrun each rank
    takes the CUDA device of its local rank.
    """
    from timm.utils.distributed import init_distributed_device_so

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dist.is_initialized():  # the caller set the job up itself
        return Processes(dist.get_rank(), dist.get_world_size(), torch.device(device))
    info = init_distributed_device_so(device)
    return Processes(info["global_rank"], info["world_size"], torch.device(info["device"]))


def stop_processes() -> None:
    """Leave the torchrun job, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
