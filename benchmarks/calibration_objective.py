"""Benchmark: calibration's two objectives on a user's quick models, outside the corpus.

A timm model as a user's quick run makes it: ``--epochs`` epochs of AdamW with a one-cycle schedule
on the corpus's digits image folder (32x32) through timm's training transforms, from a fixed seed.
It is converted, retargeted to half and a third of its steps (Lie-Trotter for a ViT; a stage too
short for a third keeps one step) and calibrated with ``objective="stage"`` and ``"output"`` (the
default: the last stage fitted to the network's output too), seeds 0 and 1, on the same folder.
The models (``--models``): a ViT of 6 blocks (patch 4) with either head timm offers, the class
token (``token``: the head reads one token) and global average pooling (``avg``: it reads every
token); and ``resnet34`` (runs of 3, 3, 5 and 2 identity blocks, average pooling). Reported:
validation accuracy (359 images) of the source, of each compression as retargeted and as
calibrated.

    python benchmarks/calibration_objective.py                    # the ViT's two heads, 15 epochs
    python benchmarks/calibration_objective.py --models resnet34 \
        --output benchmarks/results/calibration_objective_resnet.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from compression import _per_stage
from finetune import CORPUS, RESULTS
from machine import command_line, describe_machine, write_results
from tables import markdown_table
from torch import nn

OBJECTIVES = ("stage", "output")
COMPRESSIONS = {"half the steps": "x0.5", "a third of the steps": "x0.33"}
MODELS = ("token", "avg", "resnet34")


def quick_model(kind: str, folder: Path, epochs: int) -> nn.Module:
    """A timm model trained as a user's quick run trains it (see the module docstring)."""
    import timm

    from odeify.train.datasets import make_loader, open_data

    torch.manual_seed(0)
    if kind == "resnet34":
        model = timm.create_model("resnet34", num_classes=10)
    else:
        model = timm.create_model(
            "vit_tiny_patch16_224", img_size=32, patch_size=4, depth=6, num_classes=10, global_pool=kind,
            class_token=kind == "token",
        )  # fmt: skip
    model.pretrained_cfg = {
        **model.pretrained_cfg, "input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.5,) * 3,
        "crop_pct": 1.0, "interpolation": "bicubic",
    }  # fmt: skip
    loader = make_loader(open_data(folder, model).train, 64, train=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-3, total_steps=epochs * len(loader))
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            schedule.step()
    return model.eval()


def measure(kind: str, folder: Path, epochs: int) -> list[list[str]]:
    """The rows of one model: each compression as retargeted and under each objective."""
    import odeify
    from odeify.train.datasets import make_loader, open_data
    from odeify.train.evaluate import evaluate

    model = quick_model(kind, folder, epochs)
    val = make_loader(open_data(folder, model).val, 256, train=False)

    def accuracy(m: nn.Module) -> str:
        return f"{100 * evaluate(m.eval(), val).accuracy:.2f}"

    native = odeify.convert(model, input_size=(3, 32, 32))
    native.pretrained_cfg = model.pretrained_cfg
    rows = []
    for label, steps in COMPRESSIONS.items():
        coarse = odeify.retarget(native, **_per_stage(native, {"steps": steps}))
        cells = []
        for objective in OBJECTIVES:
            runs = [
                odeify.calibrate(coarse, str(folder), seed=seed, progress=False, objective=objective)[0]
                for seed in (0, 1)
            ]
            cells.append(" / ".join(accuracy(m) for m in runs))
        rows.append([kind, accuracy(model), label, accuracy(coarse), *cells])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="token,avg", help=f"','-separated, of {', '.join(MODELS)} (default token,avg)"
    )
    parser.add_argument("--epochs", type=int, default=15, help="the quick run's epochs (default 15)")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (default 2; the quick run depends on it)"
    )
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--output", type=Path, default=RESULTS / "calibration_objective.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = args.models.split(",")
    unknown = [kind for kind in kinds if kind not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}: choose from {', '.join(MODELS)}")
    rows = [row for kind in kinds for row in measure(kind, args.corpus / "digits_png", args.epochs)]
    header = ["model", "source", "compression", "retargeted", "calibrated, stage", "calibrated, output"]
    text = "\n\n".join([
        "# Calibration's objectives on a user's quick models",
        f"Command: `{command_line(__file__, argv)}`  \nMachine: {describe_machine()}",
        f"A timm model trained {args.epochs} epochs on the corpus's digits folder at 32x32 (AdamW, "
        "one-cycle, timm's training transforms), converted and retargeted, then calibrated on 256 "
        "images of the same folder: accuracy on its 359 validation images, seed 0 / seed 1. `token` "
        "and `avg`: a ViT of 6 blocks (patch 4, Lie-Trotter) whose head reads the class token, or the "
        "mean of every token; `resnet34`: timm's, a stage too short for a third of its steps keeps one.",
        "\n".join(markdown_table(header, rows)),
    ])  # fmt: skip
    write_results(args.output, text + "\n")


if __name__ == "__main__":
    main()
