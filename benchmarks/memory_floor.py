"""Benchmark: how much of a transformer's saved-for-backward memory any block scheme can remove.

A memory-free backward replaces what the residual blocks keep; the parts between them (patch
embedding, Swin's patch merging, the final norm and head: the glue) keep what they keep whatever the
blocks do. This script measures that floor: the bytes autograd saves for backward when every block
of the model is replaced by an identity, beside timm plain, timm's ``set_grad_checkpointing`` and
odeify's memory-free rows on the whole model (``benchmarks/train_step.py``'s rows, the same batch,
size and random non-trivial weights; one forward each, no timing). The blocks' share of a row is
``(row - floor) / (timm checkpointing - floor)``: what the row keeps for its blocks against what
timm's checkpointing keeps for them.

    python benchmarks/memory_floor.py --output benchmarks/results/memory_floor.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import command_line, describe_machine
from memory import SavedBytes
from tables import markdown_table
from torch import nn
from train_step import BATCH, CLASSES, ROWS, SIZE, build

MODELS = ("vit_small_patch16_224", "swin_tiny_patch4_window7_224")
TIMM_ROWS = ("timm + grad checkpointing",)
ODEIFY_ROWS = ("odeify checkpoint", "odeify reversible ALF", "odeify reversible")
BLOCKS = ("Block", "SwinTransformerBlock")
"""timm's block classes, replaced by identities for the floor."""
MB = 2**20


def saved_bytes(model: nn.Module) -> int:
    """Bytes saved for backward by one training forward of a batch (``SavedBytes``)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=generator)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    counter = SavedBytes(model.parameters())
    with counter.counting():
        loss = F.cross_entropy(model(x), labels)
    loss.backward()
    return counter.total


def without_blocks(model: nn.Module) -> nn.Module:
    """``model`` with every timm block (:data:`BLOCKS`) replaced by an identity."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in BLOCKS:
                setattr(parent, name, nn.Identity())
                replaced += 1
    if not replaced:
        raise ValueError(f"{type(model).__name__} has no block of the classes {BLOCKS}")
    return model


def measure(model_name: str) -> dict[str, int]:
    """Saved bytes of each row of ``model_name``, and of the glue alone."""
    rows = {row: saved_bytes(build(model_name, ROWS[row], "native")) for row in ("timm", *TIMM_ROWS)}
    for row in ODEIFY_ROWS:
        rows[row] = saved_bytes(build(model_name, ROWS[row], "native"))
    glue = without_blocks(build(model_name, ROWS["timm"], "native"))
    rows["glue alone (blocks removed)"] = saved_bytes(glue)
    return rows


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--output", type=Path, default=None, help="results file (default: print only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    table = []
    for model_name in args.models:
        rows = measure(model_name)
        floor, checkpointed = rows["glue alone (blocks removed)"], rows["timm + grad checkpointing"]
        for row, value in rows.items():
            share = (value - floor) / (checkpointed - floor)
            ratio = value / checkpointed
            table.append((model_name, row, f"{value / MB:.1f}", f"{ratio:.2f}", f"{share:.2f}"))
        print(f"{model_name}: done", file=sys.stderr, flush=True)
    text = "\n".join([
        "# The glue's floor: saved-for-backward bytes no block scheme removes",
        "",
        f"Command: `{command_line('memory_floor.py', argv)}`  ",
        f"Machine: {describe_machine()}",
        "",
        f"Batch {BATCH}, {SIZE}x{SIZE}, fp32, random non-trivial weights (`make_test_model`), one training "
        "forward each. `vs timm ckpt`: the row's bytes over timm's `set_grad_checkpointing`'s; `blocks' "
        "share`: (row - glue alone) / (timm checkpointing - glue alone), what the row keeps for its blocks "
        "against what timm's checkpointing keeps for them.",
        "",
        *markdown_table(("model", "row", "saved MiB", "vs timm ckpt", "blocks' share"), table),
        "",
    ])  # fmt: skip
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
