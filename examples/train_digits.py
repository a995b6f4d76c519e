"""Train odeify's shipped default model: a small timm ResNet on scikit-learn's bundled digits.

No download is needed (the 1797 8x8 digits ship with scikit-learn). The net is
``odeify.models.digits.digits_resnet`` (timm ResNet, BasicBlocks, layers (4, 4), channels (16, 32)), so each
stage holds a run of same-shape identity blocks for odeify to turn into an ODE stage. Fixed seed,
80/20 split (``odeify.models.digits.digits_split``); about 20 s on 2 CPU cores. Run from the repo root:

    python examples/train_digits.py            # writes odeify/data/digits_resnet.safetensors
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from odeify.models.checkpoints import save_checkpoint
from odeify.models.digits import (
    DEFAULT_MODEL_PATH,
    DIGITS_ARCH,
    DIGITS_MEAN,
    DIGITS_SEED,
    DIGITS_SIZE,
    DIGITS_STD,
    DIGITS_TEST_FRACTION,
    META_DIGITS,
    digits_resnet,
    digits_split,
    load_digits,
)

# Recorded in the checkpoint so load_model rebuilds exactly this net (defaults of digits_resnet).
ARCH_KWARGS = {
    "layers": [4, 4],
    "channels": [16, 32],
    "stem_width": 8,
    "stem_type": "deep",
    "in_chans": 1,
    "num_classes": 10,
    "img_size": DIGITS_SIZE,
}


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Top-1 accuracy of ``model`` (eval mode) on ``(x, y)``."""
    model.eval()
    return (model(x).argmax(1) == y).float().mean().item()


def train(epochs: int, batch_size: int, lr: float, seed: int) -> tuple[nn.Module, float, float]:
    """Train from scratch; return (model in eval mode, test accuracy, seconds spent training)."""
    torch.manual_seed(seed)
    x_train, y_train = load_digits("train", DIGITS_SIZE)
    x_test, y_test = load_digits("test", DIGITS_SIZE)
    model = digits_resnet(**ARCH_KWARGS)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=5e-4)
    steps_per_epoch = (len(x_train) + batch_size - 1) // batch_size
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=lr, epochs=epochs, steps_per_epoch=steps_per_epoch, pct_start=0.25
    )
    gen = torch.Generator().manual_seed(seed)
    tqdm.write(f"{'epoch':>5} {'loss':>8} {'train acc':>9} {'test acc':>8} {'time s':>7}")
    start = time.perf_counter()
    test_acc = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        perm = torch.randperm(len(x_train), generator=gen)
        total, correct, loss_sum = 0, 0, 0.0
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch}", leave=False, unit="batch")
        for i in bar:
            idx = perm[i * batch_size : (i + 1) * batch_size]
            xb, yb = x_train[idx], y_train[idx]
            logits = model(xb)
            loss = F.cross_entropy(logits, yb, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += len(yb)
            correct += (logits.argmax(1) == yb).sum().item()
            loss_sum += loss.item() * len(yb)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        test_acc = accuracy(model, x_test, y_test)
        elapsed = time.perf_counter() - start
        tqdm.write(
            f"{epoch:>5} {loss_sum / total:>8.4f} {correct / total:>9.4f} {test_acc:>8.4f} {elapsed:>7.1f}"
        )
    return model.eval(), test_acc, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, train, report and write the checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_PATH)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, test_acc, seconds = train(args.epochs, args.batch_size, args.lr, args.seed)
    _, test_idx = digits_split()
    digits_meta = {
        "split_seed": DIGITS_SEED,
        "test_fraction": DIGITS_TEST_FRACTION,
        "test_indices": test_idx.tolist(),
        "size": DIGITS_SIZE,
        "mean": DIGITS_MEAN,
        "std": DIGITS_STD,
        "train_seed": args.seed,
        "epochs": args.epochs,
        "test_accuracy": round(test_acc, 4),
        "torch": torch.__version__,
        "timm": timm.__version__,
    }
    save_checkpoint(
        model, args.out, DIGITS_ARCH, ARCH_KWARGS, metadata={META_DIGITS: json.dumps(digits_meta)}
    )
    n_params = sum(p.numel() for p in model.parameters())
    size_kb = args.out.stat().st_size / 1024
    print(
        f"test accuracy {test_acc:.4f} on {len(test_idx)} held-out digits; trained in {seconds:.1f} s "
        f"({args.threads} threads); {n_params} parameters; wrote {args.out} ({size_kb:.0f} KiB)"
    )


if __name__ == "__main__":
    main()
