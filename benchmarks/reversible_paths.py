"""Measure: how close the reversible integrators stay to the source network, per weight path and depth.

``backward='reversible'`` runs reversible Heun or ALF (MALI's asynchronous leapfrog). On the
default piecewise-constant weight path reversible Heun's step-end evaluation reads the left limit
(docs/design-math.md section 6), so every step sees one block's weights, at the price of two field
evaluations per step; on a linear path (which, at native steps, is what a right-continuous step
end would compute) consecutive steps share one evaluation, but each step mixes two blocks. ALF
evaluates once per step, at its midpoint, with v_0 = 0 (the default) or v_0 = F(t_0, z_0) (one more
evaluation per stage). At half the native steps on the constant path ALF's midpoints fall on block
boundaries and odeify refuses it; the rows marked "refused" measure what it would compute there,
eagerly: the point value (the right-hand block) and the weights averaged over the step.

This measures, before any fine-tuning, the distance of the logits to the source network's, how
often the top-1 class agrees with the source's, and the field evaluations of all stages (NFE),
for the shipped digits model and any other trained digits models given (their 359 test images;
also the accuracy) and random-weight timm ResNets (non-zero branches, randomised BN statistics;
standard-normal images), in float64. Random weights are a weak witness here: their blocks are
unrelated from one to the next and their stages expand, so every integrator with steps of one
block is far from the network, and their top classes are degenerate; the trained models are the
case a user has. Euler at native steps is the oracle row: both paths read exactly the blocks there,
so both must reproduce the source. Writes benchmarks/results/reversible_paths.md.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import torch
from machine import command_line, write_results
from tables import results_document

import odeify
from odeify.codegen.emit import count_evaluations
from odeify.core.errors import ConfigError, OdeifyError
from odeify.models._testing import make_test_model
from odeify.models.digits import DEFAULT_MODEL_PATH, load_digits
from odeify.models.loading import load_model
from odeify.numerics.schemes import AsyncLeapfrog
from odeify.numerics.tableaus import resolve_integrator

RESULTS = Path(__file__).resolve().parent / "results"
HEADERS = ("model", "integrator", "steps", "basis", "logit distance", "top-1 agreement", "accuracy", "NFE")
ALF_FIELD_START = AsyncLeapfrog("field")
DEPTHS = ("native", "x2", "x4", "x8", "x0.5")
MANIFESTATIONS = (
    ("euler", "native"),
    ("euler", "x0.5"),
    *(("reversible_heun", steps) for steps in DEPTHS),
    *(("alf", steps) for steps in DEPTHS),
    *((ALF_FIELD_START, steps) for steps in DEPTHS),
)


def share(logits: torch.Tensor, classes: torch.Tensor, digits: int) -> str:
    """The percentage of rows of ``logits`` whose top class is ``classes``."""
    return f"{100 * (logits.argmax(1) == classes).double().mean().item():.{digits}f}%"


def measure(name: str, model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor | None) -> list[tuple]:
    """One row per (manifestation, basis): relative logit distance and top-1 agreement with ``model``."""
    model = model.double().eval()
    x = x.double()
    with torch.no_grad():
        source = model(x)

    def row(label: str, steps: str, basis: str, logits: torch.Tensor, nfe: int) -> tuple:
        distance = ((logits - source).norm() / source.norm()).item()
        accuracy = "-" if labels is None else share(logits, labels, digits=2)
        found = (
            name,
            label,
            steps,
            basis,
            f"{distance:.1e}",
            share(logits, source.argmax(1), 1),
            accuracy,
            str(nfe),
        )
        print("  " + " | ".join(found), file=sys.stderr, flush=True)
        return found

    rows = []
    if labels is not None:
        rows.append((name, "source network", "-", "-", "0", "100.0%", share(source, labels, digits=2), "-"))
    for integrator, steps in MANIFESTATIONS:
        label = integrator if isinstance(integrator, str) else "alf, v0 = F(t0, z0)"
        for basis in ("constant", "linear"):
            try:
                converted = odeify.convert(model, integrator=integrator, steps=steps, basis=basis)
            except ConfigError:  # ALF's midpoints on the constant path's jumps: what it would compute
                for how, weights in (("point value", _point), ("step-average weights", _step_average)):
                    logits, nfe = _eager_alf(model, integrator, steps, basis, weights, x)
                    rows.append(row(f"{label} (refused; {how})", steps, basis, logits, nfe))
                continue
            with torch.no_grad():
                logits = converted(x)
            nfe = sum(count_evaluations(s) for s in odeify.converted_stages(converted))
            rows.append(row(label, steps, basis, logits, nfe))
    return rows


Weights = Callable[[odeify.ODEStage, Fraction, Fraction], odeify.ODEStage]


def _eager_alf(
    model, alf, steps: str, basis: str, weights: Weights, x: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The model with every stage run as an eager ALF loop; ``weights(stage, t0, t1)`` is the stage
    whose field at the step's midpoint gives step [t0, t1]'s evaluation. Returns logits and NFE."""
    gm = odeify.convert(model, steps=steps, basis=basis, backward="checkpoint")  # stages stay calls
    field_start = resolve_integrator(alf).initial_velocity == "field"
    evaluations = 0
    for stage in odeify.converted_stages(gm):

        def run(z: torch.Tensor, stage=stage) -> torch.Tensor:
            nonlocal evaluations
            h = Fraction(1, stage.steps)
            v = torch.zeros_like(z)
            if field_start:
                v, evaluations = stage.field(Fraction(0), z), evaluations + 1
            for n in range(stage.steps):
                s = z + float(h / 2) * v
                v = 2 * weights(stage, n * h, (n + 1) * h).field((n + Fraction(1, 2)) * h, s) - v
                z, evaluations = s + float(h / 2) * v, evaluations + 1
            return z

        stage.forward = run
    with torch.no_grad():
        return gm(x), evaluations


def _point(stage: odeify.ODEStage, t0: Fraction, t1: Fraction) -> odeify.ODEStage:
    return stage  # the field at the midpoint itself: on a jump, the right-hand cell


def _step_average(stage: odeify.ODEStage, t0: Fraction, t1: Fraction) -> odeify.ODEStage:
    """A copy of the stage whose every knot is the weight path averaged over [t0, t1] (exact rows)."""
    K = stage.num_knots
    cuts = sorted({t0, t1, *(Fraction(k, K) for k in range(K + 1) if t0 < Fraction(k, K) < t1)})
    row = [Fraction(0)] * K
    for a, b in zip(cuts, cuts[1:], strict=False):  # the path is constant on each piece
        for k, c in enumerate(stage.row((a + b) / 2, False)):
            row[k] += c * (b - a) / (t1 - t0)
    twin = copy.deepcopy(stage)
    with torch.no_grad():
        for knots in twin.knot_tensors():
            knots.copy_(sum(float(c) * knots[k] for k, c in enumerate(row)).expand_as(knots))
    return twin


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
        "# Reversible Heun and ALF, per weight path and depth: distance to the source network",
        "",
        "Each model converted with one knot per block, evaluated in float64 without fine-tuning.",
        "'logit distance' is ||logits - source logits|| / ||source logits|| over the batch; 'top-1",
        "agreement' the share of images whose top class is the source network's; NFE the field",
        f"evaluations of all stages. Random-weight models: {args.batch} standard-normal",
        f"{args.size}x{args.size} images; digits: the 359 held-out test images. On the constant path",
        "reversible Heun's step end reads the left limit (one block per step, two evaluations per",
        "step); the linear path shares the step-end evaluation with the next step (blocks n and n + 1",
        "mixed in step n). ALF evaluates once per step, at its midpoint, from v_0 = 0 ('alf', the",
        "default) or v_0 = F(t_0, z_0); at half the steps on the constant path its midpoints fall on",
        "block boundaries and odeify refuses it: the 'refused' rows are what it would compute there,",
        "run eagerly, with the point value (the right-hand block) or the weights averaged over the",
        "step. Euler at native steps is the oracle: both paths must reproduce the source there. The",
        "other digits models (--digits-models) are the shipped recipe with another seed:",
        "`python examples/train_digits.py --seed N --out PATH`.",
    ]
    write_results(args.output, results_document(lines, HEADERS, rows, command, text_columns=4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
