"""Measure: how close reversible Heun stays to the source network on each weight path.

``backward='reversible'`` runs reversible Heun. On the default piecewise-constant weight path its
step-end evaluation reads the left limit (docs/design.md section 6), so every step sees one block's
weights, at the price of two field evaluations per step. On a linear path (which, at native
steps, is what a right-continuous step end would compute) consecutive steps share one
evaluation, so a training step is faster (benchmarks/results/train_step.md), but each step mixes
two blocks. This measures what that costs the converted model before any fine-tuning: the
distance of its logits to the source network's, and how often it agrees with the source's top-1
class, for the shipped digits model and any other trained digits models given (their 359 test
images; also the accuracy) and random-weight timm ResNets (non-zero branches, randomised BN
statistics; standard-normal images), in float64. Random weights are a weak witness here: their
blocks are unrelated from one to the next and their stages expand, so reversible Heun with steps
of one block is far from the network on either path, and their top classes are degenerate; the
trained models are the case a user has.
Euler at native steps is the oracle row: both paths read exactly the blocks there, so both must
reproduce the source. Writes benchmarks/results/reversible_paths.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from machine import command_line, provenance, write_results
from tables import markdown_table

import odeify
from odeify.core.errors import OdeifyError
from odeify.models._testing import make_test_model
from odeify.models.digits import DEFAULT_MODEL_PATH, load_digits
from odeify.models.loading import load_model

RESULTS = Path(__file__).resolve().parent / "results"
HEADERS = ("model", "integrator", "steps", "basis", "logit distance", "top-1 agreement", "accuracy")
MANIFESTATIONS = (("euler", "native"), ("reversible_heun", "native"), ("reversible_heun", "x2"))


def share(logits: torch.Tensor, classes: torch.Tensor, digits: int) -> str:
    """The percentage of rows of ``logits`` whose top class is ``classes``."""
    return f"{100 * (logits.argmax(1) == classes).double().mean().item():.{digits}f}%"


def measure(name: str, model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor | None) -> list[tuple]:
    """One row per (manifestation, basis): relative logit distance and top-1 agreement with ``model``."""
    model = model.double().eval()
    x = x.double()
    with torch.no_grad():
        source = model(x)
    rows = []
    if labels is not None:
        rows.append((name, "source network", "-", "-", "0", "100.0%", share(source, labels, digits=2)))
    for integrator, steps in MANIFESTATIONS:
        for basis in ("constant", "linear"):
            converted = odeify.convert(model, integrator=integrator, steps=steps, basis=basis)
            with torch.no_grad():
                logits = converted(x)
            distance = ((logits - source).norm() / source.norm()).item()
            agreement = share(logits, source.argmax(1), digits=1)
            accuracy = "-" if labels is None else share(logits, labels, digits=2)
            rows.append((name, integrator, steps, basis, f"{distance:.1e}", agreement, accuracy))
            print("  " + " | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["resnet18", "resnet50"], help="random-weight timm models"
    )
    parser.add_argument(
        "--digits-models",
        nargs="*",
        type=Path,
        default=[],
        help="more trained digits models (examples/train_digits.py --seed N --out PATH)",
    )
    parser.add_argument("--batch", type=int, default=64, help="images per random-weight model")
    parser.add_argument("--size", type=int, default=64, help="image side for the random-weight models")
    parser.add_argument(
        "--output", type=Path, default=RESULTS / "reversible_paths.md", help="Markdown record"
    )
    args = parser.parse_args(argv)
    try:  # a bad path is a usage error naming the file, before any measuring
        trained = {f"digits ({path.name}, trained)": load_model(path) for path in args.digits_models}
    except OdeifyError as error:
        parser.error(f"--digits-models: {error}")
    x, labels = load_digits("test")
    rows = measure("digits (shipped, trained)", load_model(DEFAULT_MODEL_PATH), x, labels)
    for name, model in trained.items():
        rows += measure(name, model, x, labels)
    images = torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    for name in args.models:
        rows += measure(f"{name} (random weights)", make_test_model(name), images, None)
    command = command_line(__file__, argv)
    lines = [
        "# Reversible Heun on a piecewise-constant and on a linear weight path: distance to the source",
        "",
        "Each model converted with one knot per block, evaluated in float64 without fine-tuning.",
        "'logit distance' is ||logits - source logits|| / ||source logits|| over the batch; 'top-1",
        "agreement' the share of images whose top class is the source network's. Random-weight",
        f"models: {args.batch} standard-normal {args.size}x{args.size} images; digits: the 359",
        "held-out test images. The constant path's step end reads the left limit (one block per",
        "step, two evaluations per step); the linear path shares the step-end evaluation with the",
        "next step (blocks n and n + 1 mixed in step n). Euler at native steps is the oracle: both",
        "paths must reproduce the source there. The other digits models (--digits-models) are the",
        "shipped recipe with another seed: `python examples/train_digits.py --seed N --out PATH`.",
        "",
        *markdown_table(HEADERS, rows, text_columns=4),
        "",
        *provenance(command),
    ]
    write_results(args.output, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
