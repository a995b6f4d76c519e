"""Measure: how large the reversible lattice's integer counts get on real weights, and how they are kept.

``backward='reversible'`` holds reversible Heun's state (y, z) as float64 counts of a per-sample
spacing q, 2^-bits of the input's largest magnitude (``odeify.runtime.reversible.lattice_bits``). What the
forward keeps for backward, and when it must fall back, depends on how large those counts get:
the state outgrows the input by the stage's growth, and float64 sums stay exact below 2^52. For
every stage of resnet50 (random non-trivial weights, standard-normal 224x224 images) and of the
shipped digits model (its test images), at native and 4x steps, this prints and records the
largest |count| of y_N, of d_N = z_N - y_N, of y_N's rounding residual to the input dtype, and of
z along the way, and the integer types the compact state uses.
Writes benchmarks/results/lattice_range.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from machine import command_line, provenance, write_results
from tables import markdown_table

import odeify
from odeify.models._testing import make_test_model
from odeify.models.digits import DEFAULT_MODEL_PATH, load_digits
from odeify.models.loading import load_model
from odeify.runtime import reversible
from odeify.runtime.rerun import ForwardContext

RESULTS = Path(__file__).resolve().parent / "results"
HEADERS = (
    "model", "stage", "steps", "growth (log2)", "y_N", "d_N = z_N - y_N", "y_N residual", "peak z",
    "residual kept as", "d kept as",
)  # fmt: skip


def stage_inputs(gm: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each stage's input for the batch ``x`` (a forward with the stages called, not inlined)."""
    seen: dict[str, torch.Tensor] = {}
    stages = odeify.converted_stages(odeify.set_backward(gm, "reversible"))
    hooks = [s.register_forward_pre_hook(lambda m, a: seen.setdefault(m.stage_name, a[0])) for s in stages]
    with torch.no_grad():
        gm(x)
    for hook in hooks:
        hook.remove()
    return seen


def log2(value: float) -> str:
    return f"{math.log2(value):.1f}" if value > 0 else "-inf"


def measure(name: str, model: torch.nn.Module, x: torch.Tensor) -> list[tuple[str, ...]]:
    rows = []
    for steps in ("native", "x4"):
        gm = odeify.convert(model, integrator="reversible_heun", steps=steps, input_size=(1, *x.shape[1:]))
        inputs = stage_inputs(gm, x)
        for stage in odeify.converted_stages(gm):
            x_in = inputs[stage.stage_name]
            lattice = reversible._Lattice(x_in, reversible.half_step(stage))
            points: list[torch.Tensor] = []
            with torch.no_grad():
                y, z = reversible._integrate(
                    stage,
                    lattice,
                    ForwardContext.capture(x_in),
                    stage.knot_tensors(),
                    lattice.counts(x_in),
                    points,
                )
                out = lattice.value(y)
                residual = y - torch.div(out, lattice.quantum)
                difference = z - y
                (kept, d, _), why = lattice.pack(y, z, out)  # consumes z
            assert not why, why
            peak = max(float((p.double().abs() / lattice.quantum).amax()) for p in points)
            growth = float((out.abs().amax(dim=(1, 2, 3)) / x_in.abs().amax(dim=(1, 2, 3))).max())
            rows.append(
                (
                    name,
                    stage.stage_name,
                    str(stage.steps),
                    f"{math.log2(growth):.1f}",
                    log2(float(y.abs().amax())),
                    log2(float(difference.abs().amax())),
                    log2(float(residual.abs().amax())),
                    log2(peak),
                    "nothing" if kept is None else str(kept.dtype).removeprefix("torch."),
                    str(d.dtype).removeprefix("torch."),
                )
            )
            print("  " + " | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2, help="resnet50 images (digits: its 360 test images)")
    parser.add_argument("--output", type=Path, default=RESULTS / "lattice_range.md", help="Markdown record")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = measure("digits", load_model(DEFAULT_MODEL_PATH), load_digits("test")[0])
    images = torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    rows += measure("resnet50", make_test_model("resnet50"), images)
    bits = reversible.lattice_bits(torch.float32)
    command = command_line(__file__, argv)
    lines = [
        "# How large the reversible lattice's counts get",
        "",
        f"fp32 inputs, lattice spacing q = 2^-{bits} of each sample's largest |input| (rounded up to",
        "a power of two). Counts are log2 of the largest |value| / q over the batch; 'growth' is log2",
        "of the largest ratio of a sample's max |output| to its max |input|. 'peak z' is the largest",
        "z along the way. The forward keeps states below 2^52 counts, where the float64 sums are",
        f"exact (growth below 2^{52 - bits}); the residual of y_N to fp32 and d_N are kept in the",
        "narrowest integer type that holds them (d: int32 or float64).",
        "",
        *markdown_table(HEADERS, rows, text_columns=2),
        "",
        *provenance(command),
    ]
    write_results(args.output, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
