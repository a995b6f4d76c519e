"""DistributedDataParallel trains a memory-free (reversible) model like one process on the whole batch.

The adjoint Function returns knot gradients as ordinary leaf gradients, so DDP's gradient hooks
fire and average them; with a loss that is a mean over the batch, two ranks on half a batch each
take the same SGD steps as one process on the whole batch.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import odeify
from odeify.models.digits import DEFAULT_MODEL_PATH
from odeify.models.loading import load_model

WORLD = 2
BATCH = 8
STEPS = 3


def _model(integrator: str) -> nn.Module:
    """The digits model as a reversible scheme, twice the native steps, trained with backward='reversible'."""
    gm = odeify.convert(load_model(DEFAULT_MODEL_PATH).double(), integrator=integrator, steps="x2")
    return odeify.set_backward(gm, "reversible").train()


def _train(model: nn.Module, params: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """STEPS of SGD with momentum on mean cross-entropy; returns the parameters of ``params``."""
    optimizer = torch.optim.SGD(params.parameters(), lr=0.01, momentum=0.9)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert all(s.adjoint_stats.backward_passes == STEPS for s in odeify.converted_stages(params))
    return {name: p.detach().clone() for name, p in params.named_parameters()}


def _worker(rank: int, port: int, out: Path, x: torch.Tensor, y: torch.Tensor, integrator: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model = _model(integrator)
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        trained = _train(DistributedDataParallel(model), model, x[shard], y[shard])
        if rank == 0:
            torch.save(trained, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("integrator", ["reversible_heun", "alf"])
def test_ddp_reversible_matches_single_process(tmp_path: Path, integrator: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 1, 32, 32, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(_free_port(), out, x, y, integrator), nprocs=WORLD, join=True)
    distributed = torch.load(out)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model(integrator)
        initial = {name: p.detach().clone() for name, p in model.named_parameters()}
        single = _train(model, model, x, y)
    finally:
        torch.set_num_threads(threads)

    knots = [name for name in single if ".knots." in name]
    assert knots and distributed.keys() == single.keys()
    for name, want in single.items():
        assert not torch.equal(want, initial[name]), f"{name} did not train"
        # measured: at most 5.9e-14 absolute (fp64 round-off: two half-batch sums allreduced
        # against one whole-batch sum, through three SGD steps); parameters move by >= 6e-3
        torch.testing.assert_close(distributed[name], want, rtol=1e-12, atol=5e-13, msg=name)
