"""Fine-tune a converted model memory-free on several processes, launched with torchrun.

    torchrun --standalone --nproc_per_node=2 examples/finetune_ddp.py

Every process converts the shipped digits ResNet (or loads a model saved with ``odeify.save``,
``--converted``), compresses each stage to ``--knots`` knots as reversible Heun with the exact
memory-free backward (``backward='reversible'``), and wraps it in DistributedDataParallel: the
knots are ordinary parameters, so DDP averages their gradients like any other. Each rank trains
on its shard of the digits training set (DistributedSampler); rank 0 shows the progress bar,
reports test accuracy after every epoch and saves the model atomically, so an interrupted run
leaves the last epoch's file intact. CPU processes use the gloo backend, GPUs nccl. Run without
torchrun it trains in one process.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

import odeify
from odeify.digits import DEFAULT_MODEL_PATH, load_digits


def setup() -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment; one process without it."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cpu")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def student(args: argparse.Namespace) -> torch.fx.GraphModule:
    """The model to fine-tune: converted (or loaded), compressed, reversible Heun, memory-free."""
    ode = odeify.load(args.converted) if args.converted else odeify.convert(str(DEFAULT_MODEL_PATH))
    return odeify.retarget(
        ode, knots=args.knots, basis="linear", integrator="reversible_heun", backward="reversible"
    )


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return correct


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=3, help="epochs over the training set (default 3)")
    parser.add_argument("--batch", type=int, default=32, help="batch size per process (default 32)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--knots", type=int, default=2, help="knots per stage after compression (default 2)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
    parser.add_argument("--converted", type=Path, help="start from a model saved with odeify.save")
    parser.add_argument(
        "--out", type=Path, default=Path("out/ddp/digits_ode.safetensors"), help="saved model"
    )
    args = parser.parse_args(argv)
    if min(args.epochs, args.batch, args.knots, args.max_steps or 1) < 1 or args.lr <= 0:
        parser.error("--epochs, --batch, --knots and --max-steps must be positive, --lr above 0")

    rank, world, device = setup()
    try:
        torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts rank 0's)
        model = student(args).to(device)
        trained = DistributedDataParallel(model) if world > 1 else model
        x_train, y_train = load_digits("train")
        x_test, y_test = load_digits("test")
        data = TensorDataset(x_train, y_train)
        sampler = DistributedSampler(data, world, rank, shuffle=True, seed=0) if world > 1 else None
        loader = DataLoader(data, args.batch, shuffle=sampler is None, sampler=sampler, drop_last=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
        if rank == 0:
            before = accuracy(model, x_test.to(device), y_test.to(device))
            print(f"{world} process(es) on {device.type}; test accuracy before fine-tuning {before:.4f}")
            args.out.parent.mkdir(parents=True, exist_ok=True)
        model.train()
        for epoch in range(args.epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            steps = min(len(loader), args.max_steps or len(loader))
            bar = tqdm(loader, total=steps, desc=f"epoch {epoch + 1}/{args.epochs}", disable=rank != 0)
            for step, (x, y) in enumerate(bar):
                if step == steps:
                    break
                loss = F.cross_entropy(trained(x.to(device)), y.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                bar.set_postfix(loss=f"{loss.item():.3f}")
            if rank == 0:
                after = accuracy(model, x_test.to(device), y_test.to(device))
                odeify.save(model, args.out)
                print(f"epoch {epoch + 1}: test accuracy {after:.4f}; saved {args.out}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
