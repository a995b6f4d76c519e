"""Benchmark: which weights should a coarse step start from, before any calibration or training?

A stage of L blocks at s < L steps takes steps of L/s blocks. Two ways to give step i its weights:

- ``left point`` (odeify's default, Euler): the knots read at the step's start, which is the weights
  of block ``floor(i L / s)``, the block the layer-drop student keeps, applied with the step's size;
- ``average``: the mean of the weights of the blocks the step spans (the least-squares fit of s
  piecewise-constant knots, one per step: knots at the step midpoints), the step's size the same.

Both are compared with the layer-drop student (the source's kept blocks at unit size, converted at
native depth; ``benchmarks/compression.py``) on the corpus's validation images (359).

    python benchmarks/coarse_start.py --models vit6,digits_seed0,digits_seed2,resnetv2_18
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from compression import _accuracy, _per_stage, layer_dropped
from finetune import CORPUS, RESULTS, SPLIT_MODELS, native_model
from machine import command_line, describe_machine, write_results
from tables import markdown_table

STAGE_COMPRESSIONS = {"half steps": {"steps": "x0.5"}, "third of steps": {"steps": "x0.33"}}
SPLIT_COMPRESSIONS = {
    "Lie-Trotter, half steps": {"steps": "x0.5"},
    "Strang, half steps": {"integrator": "strang", "steps": "x0.5"},
    "Lie-Trotter, third of steps": {"steps": "x0.33"},
}


def measure(model_name: str, corpus: Path) -> list[list[str]]:
    """One table row per compression of ``model_name``: the three starts' accuracies."""
    import odeify

    native, data, path = native_model(model_name, corpus, "as trained")
    source = odeify.load_model(path).eval()
    rows = []
    compressions = SPLIT_COMPRESSIONS if model_name in SPLIT_MODELS else STAGE_COMPRESSIONS
    for label, settings in compressions.items():
        settings = _per_stage(native, settings)
        left = odeify.retarget(native, **settings)
        steps = {stage.stage_name: stage.steps for stage in odeify.converted_stages(left)}
        average = odeify.retarget(native, **settings, knots=steps, basis="constant")
        student = odeify.convert(
            layer_dropped(source, left), input_size=native.meta["odeify"]["input_shape"][1:]
        )
        accuracies = [_accuracy(m, data) for m in (left, average, student)]
        rows.append([model_name, label, *(f"{a:.2f}" for a in accuracies)])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="vit6,digits_seed0,digits_seed2,resnetv2_18")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--output", type=Path, default=RESULTS / "coarse_start.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row for name in args.models.split(",") for row in measure(name, args.corpus)]
    header = ["model", "compression", "left point", "average", "layer drop"]
    text = "\n\n".join(
        [
            "# Which weights a coarse step starts from (before calibration)",
            f"Command: `{command_line(__file__, argv)}`  \nMachine: {describe_machine()}",
            "Accuracy (%) on the 359 validation images of the corpus model at the compression, before "
            "calibration or fine-tuning: `left point` reads each step's weights at its start (the "
            "kept block's), `average` the mean of the blocks it spans, `layer drop` is the student.",
            "\n".join(markdown_table(header, rows)),
        ]
    )
    write_results(args.output, text + "\n")


if __name__ == "__main__":
    main()
