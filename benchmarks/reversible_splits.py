"""Benchmark: how far a reversible split scheme is from the network before fine-tuning.

At native steps Lie-Trotter Euler on a transformer's split stage is the network; a reversible
splitting (ALF or reversible Heun sub-steps, Lie-Trotter or Strang order) is not: its sub-steps read
the fields at other points and keep an augmented state. On the corpus ViT (``vit6``, docs/corpus.md)
this script measures, for each reversible splitting at native and twice the steps, validation
accuracy and the relative logit distance ``||logits - source|| / ||source||`` over the 359 validation
images, beside Lie-Trotter Euler (the network) and Strang.

    python benchmarks/reversible_splits.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from finetune import CORPUS, RESULTS, native_model
from machine import command_line, describe_machine, write_results
from tables import markdown_table

SCHEMES = (
    "lie_trotter",
    "strang",
    "lie_trotter_alf",
    "strang_alf",
    "lie_trotter_reversible_heun",
    "strang_reversible_heun",
)
MODEL = "vit6"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--output", type=Path, default=RESULTS / "reversible_splits.md")
    args = parser.parse_args(argv)
    import odeify
    from odeify.core.errors import ConfigError

    torch.set_num_threads(1)
    native, data, _ = native_model(MODEL, args.corpus)
    x = torch.stack([data.val[i][0] for i in range(len(data.val))])
    y = torch.tensor([data.val[i][1] for i in range(len(data.val))])
    with torch.no_grad():
        source = native.eval()(x)
    rows = []
    for scheme in SCHEMES:
        for steps in ("native", "x2"):
            try:
                model = odeify.retarget(native, integrator=scheme, steps=steps).eval()
            except ConfigError as exc:
                rows.append([scheme, steps, "refused", "", str(exc).split(".")[0]])
                continue
            with torch.no_grad():
                logits = model(x)
            distance = float((logits - source).norm() / source.norm())
            accuracy = 100 * float((logits.argmax(1) == y).double().mean())
            rows.append([scheme, steps, f"{accuracy:.2f}", f"{distance:.3f}", ""])
            print(" | ".join(rows[-1]), flush=True)
    lines = [
        "# Reversible split schemes on the corpus ViT, before fine-tuning",
        "",
        f"Command: `{command_line(__file__, argv)}`  ",
        f"Machine: {describe_machine()}",
        "",
        f"Source: {MODEL}, {100 * float((source.argmax(1) == y).double().mean()):.2f}% on the 359 validation "
        "images (one image is 0.28 point). Logit distance: ||logits - source|| / ||source|| over them.",
        "",
        *markdown_table(["integrator", "steps", "accuracy %", "logit distance", "note"], rows),
        "",
    ]
    write_results(args.output, "\n".join(lines))


if __name__ == "__main__":
    main()
