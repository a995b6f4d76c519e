"""Measure: how large the reversible lattice's integer counts get on real weights, and how they are kept.

``backward='reversible'`` holds a reversible scheme's registers (reversible Heun's (y, z), ALF's
(z, p = h/2 v)) as float64 counts of a per-sample spacing q, 2^-bits of the input's largest
magnitude (``odeify.runtime.lattice.lattice_bits``). What the forward keeps for backward, and when
it must fall back, depends on how large those counts get: the state outgrows the input by the
stage's growth, and float64 sums stay exact below 2^52. For every stage of resnet50 (random
non-trivial weights, standard-normal 224x224 images) and of the shipped digits model (its test
images), at native and 4x steps, for both schemes (``--models`` adds resnet152, whose random-weight
layer3 outgrows the lattice; ``--files`` adds trained checkpoints, e.g. the corpus's, with their
standard-normal images at ``--file-size``), this prints and records the largest |count| of
the output register, of the other register as the forward keeps it (Heun: d_N = z_N - y_N; ALF:
p_N), of the output's rounding residual to the input dtype, and of every evaluation's input along
the way, and the integer types the compact state uses.
Writes benchmarks/results/lattice_range.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from machine import command_line, write_results
from tables import results_document

import odeify
from odeify.models._testing import make_test_model
from odeify.models.digits import DEFAULT_MODEL_PATH, load_digits
from odeify.models.loading import load_model
from odeify.runtime.lattice import lattice_bits
from odeify.runtime.reversible import run_on_lattice

RESULTS = Path(__file__).resolve().parent / "results"
HEADERS = (
    "model", "integrator", "stage", "steps", "growth (log2)", "output", "other register (as kept)",
    "output residual", "peak evaluation input", "residual kept as", "other kept as",
)  # fmt: skip
INTEGRATORS = ("reversible_heun", "alf")
RANDOM_MODELS = ("resnet50", "resnet152")
"""timm models with random non-trivial weights (``make_test_model``), at 224x224."""


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
    for integrator in INTEGRATORS:
        for steps in ("native", "x4"):
            gm = odeify.convert(model, integrator=integrator, steps=steps, input_size=(1, *x.shape[1:]))
            inputs = stage_inputs(gm, x)
            for stage in odeify.converted_stages(gm):
                rows.append((name, integrator, *_stage_row(stage, inputs[stage.stage_name])))
                print("  " + " | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _stage_row(stage: odeify.ODEStage, x_in: torch.Tensor) -> tuple[str, ...]:
    points: list[torch.Tensor] = []
    lattice, program, registers = run_on_lattice(stage, x_in, points)
    out = lattice.value(registers[0])
    residual = registers[0] - torch.div(out, lattice.quantum)
    layout = program.scheme.registers
    other = registers[1] - registers[0] if layout[1].kept == "relative" else registers[1].clone()
    _, packed, _why = lattice.pack(registers, program.scheme)  # consumes the registers after the first
    kept, compact = (None, None) if packed is None else packed[:2]
    peak = max(float((p.double().abs() / lattice.quantum).amax()) for p in points)
    growth = float((out.abs().amax(dim=(1, 2, 3)) / x_in.abs().amax(dim=(1, 2, 3))).max())
    return (
        stage.stage_name,
        str(stage.steps),
        f"{math.log2(growth):.1f}",
        log2(float(registers[0].abs().amax())),
        log2(float(other.abs().amax())),
        log2(float(residual.abs().amax())),
        log2(peak),
        "-" if compact is None else "nothing" if kept is None else str(kept.dtype).removeprefix("torch."),
        "falls back (past 2^52)"
        if compact is None
        else _kept_as(compact, layout[1].name in program.scheme.even_registers),
    )


def _kept_as(compact: torch.Tensor, even: bool) -> str:
    """How a register is kept: an integer type, or a byte count (halved first for an even register)."""
    if compact.dtype != torch.uint8:
        return str(compact.dtype).removeprefix("torch.")
    return f"{compact.shape[-1]} bytes" + (", halved" if even else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--batch", type=int, default=2, help="timm models' images (digits: its 360 test images)"
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=("digits", *RANDOM_MODELS),
        default=["digits", "resnet50"],
        help="models",
    )
    parser.add_argument("--files", nargs="*", default=[], metavar="PATH", help="trained checkpoints to add")
    parser.add_argument("--file-size", type=int, default=32, metavar="N", help="image side for --files")
    parser.add_argument("--output", type=Path, default=RESULTS / "lattice_range.md", help="Markdown record")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    if "digits" in args.models:
        rows += measure("digits", load_model(DEFAULT_MODEL_PATH), load_digits("test")[0])
    for name in (m for m in args.models if m != "digits"):
        images = torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
        rows += measure(name, make_test_model(name), images)
    for path in args.files:
        size = args.file_size
        images = torch.randn(args.batch, 3, size, size, generator=torch.Generator().manual_seed(0))
        rows += measure(path, load_model(path), images)
    bits = lattice_bits(torch.float32)
    command = command_line(__file__, argv)
    lines = [
        "# How large the reversible lattice's counts get",
        "",
        f"fp32 inputs, lattice spacing q = 2^-{bits} of each sample's largest |input| (rounded up to",
        "a power of two). Counts are log2 of the largest |value| / q over the batch; 'growth' is log2",
        "of the largest ratio of a sample's max |output| to its max |input|. 'output' is the output",
        "register (reversible Heun's y_N, ALF's z_N); 'other register' reversible Heun's",
        "d_N = z_N - y_N and ALF's p_N = h/2 v_N, as the forward keeps them; 'peak evaluation",
        "input' the largest register a field was evaluated at. The forward keeps registers below",
        f"2^52 counts, where the float64 sums are exact (growth below 2^{52 - bits}); the output's",
        "residual to fp32 and the other register are kept in the narrowest integer type that holds",
        "them (the other register: int32, else 5 to 7 bytes a count, halved first where the",
        "scheme keeps it even: ALF's p).",
    ]
    write_results(args.output, results_document(lines, HEADERS, rows, command, text_columns=3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
