"""Benchmark: inference time of converted models against the original timm model.

The converted model at native depth (Euler, steps = blocks) is the original network with BatchNorm
folded into the convolutions, so it should cost no more than the timm model (target: median time
ratio <= 1.00). Other manifestations trade accuracy for time: rk4 at native steps evaluates each
stage's field four times per step; fewer knots at native steps cost what the native model costs
(constant basis: each step reads one knot; linear: a mix of two); Euler at half the steps halves the
stages' cost. All variants run in one process, eval mode, under ``torch.no_grad()``, with a fixed
thread count, interleaved round-robin (original, native, rk4, ..., original, native, ...), so drift
in machine load hits every variant alike; ratios are medians of the per-round ratios to the original.

Writes a rich table to the terminal and a Markdown record to benchmarks/results/forward.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from machine import command_line, machine_info, write_results
from tables import print_table, results_document
from torch import nn
from torch.fx.experimental.optimization import fuse
from tqdm import tqdm

import odeify
from odeify.codegen.emit import count_evaluations
from odeify.compiler.conversion import converted_stages
from odeify.models._testing import make_test_model

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "forward.md"
TARGET = 1.00  # converted-native time / original time


@dataclass(frozen=True)
class Variant:
    """One manifestation: a label, how to build it from the native conversion, and a description."""

    label: str
    what: str
    build: Callable[[nn.Module, nn.Module], nn.Module]  # (timm model, native conversion) -> module


def half_knots(native: nn.Module, basis: str) -> nn.Module:
    """Every stage compressed to half its blocks (at least 1 knot), steps native."""
    knots = {s.stage_name: max(1, s.depth // 2) for s in converted_stages(native)}
    if basis != "constant":
        native = odeify.retarget(native, basis=basis)  # one knot per block: the basis may change
    return odeify.retarget(native, knots=knots)


def timm_bn_folded(model: nn.Module) -> nn.Module:
    """The timm model with BatchNorm folded by torch itself: the baseline for odeify's own overhead."""
    return fuse(copy.deepcopy(model).eval())


VARIANTS = (
    Variant(
        "timm, BN folded by torch",
        "torch.fx.experimental.optimization.fuse (not odeify)",
        lambda model, native: timm_bn_folded(model),
    ),
    Variant("converted, native", "euler, steps = blocks, knots = blocks", lambda model, m: m),
    Variant(
        "rk4, native steps",
        "4 field evaluations per step",
        lambda model, m: odeify.retarget(m, integrator="rk4"),
    ),
    Variant(
        "knots = half (constant)",
        "least-squares compressed, euler, native steps",
        lambda model, m: half_knots(m, "constant"),
    ),
    Variant(
        "knots = half (linear)",
        "least-squares compressed, euler, native steps",
        lambda model, m: half_knots(m, "linear"),
    ),
    Variant(
        "euler, steps x0.5", "half the field evaluations", lambda model, m: odeify.retarget(m, steps="x0.5")
    ),
    Variant(
        "midpoint, steps x0.5",
        "as many evaluations as native",
        lambda model, m: odeify.retarget(m, integrator="midpoint", steps="x0.5"),
    ),
)


@dataclass(frozen=True)
class Row:
    label: str
    what: str
    evaluations: int  # field evaluations of all stages together
    parameters: int
    deviation: float  # max |out - timm| / max |timm|
    median: float  # seconds
    ratio: float  # median of per-round ratios to the original


def timed(module: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    module(x)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> tuple[list[Row], float]:
    torch.set_num_threads(args.threads)
    shape = (args.batch, 3, args.size, args.size)
    model = make_test_model(args.model).eval()  # non-trivial random weights; timing ignores them
    native = odeify.convert(model, input_size=shape).eval()
    modules = {"original": model}
    built = []
    for variant in VARIANTS:
        module = variant.build(model, native).eval()
        modules[variant.label] = module
        built.append((variant, module))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {label: [] for label in modules}
    with torch.no_grad():
        reference = model(x)
        outputs = {label: module(x) for label, module in modules.items()}  # warm-up, and the deviation
        with tqdm(total=args.repeats * len(modules), desc="timing", file=sys.stderr) as progress:
            for _ in range(args.repeats):
                for label, module in modules.items():  # round-robin: A B C ... A B C ...
                    times[label].append(timed(module, x))
                    progress.update()
    rows = []
    scale = reference.abs().max()
    for variant, module in built:
        ratios = [t / o for t, o in zip(times[variant.label], times["original"], strict=True)]
        rows.append(
            Row(
                label=variant.label,
                what=variant.what,
                evaluations=sum(count_evaluations(s) for s in converted_stages(module)),
                parameters=sum(p.numel() for p in module.parameters()),
                deviation=((outputs[variant.label] - reference).abs().max() / scale).item(),
                median=statistics.median(times[variant.label]),
                ratio=statistics.median(ratios),
            )
        )
    return rows, statistics.median(times["original"])


HEADERS = ("variant", "stages", "field evals", "params (M)", "median (s)", "time / timm")


def cells(row: Row) -> tuple[str, ...]:
    return (
        row.label,
        row.what,
        str(row.evaluations),
        f"{row.parameters / 1e6:.1f}",
        f"{row.median:.3f}",
        f"{row.ratio:.2f}x",
    )


def verdict(rows: list[Row]) -> str:
    native = rows[0]
    status = "met" if native.ratio <= TARGET else "MISSED"
    return (
        f"target {status}: converted native / timm = {native.ratio:.2f}x (target <= {TARGET:.2f}x); "
        f"native output = timm output to {native.deviation:.1e} relative"
    )


def markdown(rows: list[Row], original: float, args: argparse.Namespace, command: str, info: dict) -> str:
    shape = f"{args.batch}x3x{args.size}x{args.size}"
    lines = [
        f"# Forward time: converted {args.model} vs timm",
        "",
        f"Eval mode, `torch.no_grad()`, input {shape}, {info['threads']} threads. All variants run in one",
        f"process, round-robin for {args.repeats} rounds after a warm-up call each; 'time / timm' is the",
        "median of the per-round ratios to the original timm model, whose median time was",
        f"{original:.3f} s. 'field evals' counts block evaluations over all ODE stages (the native model:",
        "one per block). Weights are random (timing does not depend on them), so only the native",
        "variant's output is compared with timm's (max |out - timm| / max |timm|, below the table).",
    ]
    return results_document(lines, HEADERS, map(cells, rows), command, after=[verdict(rows) + "."])


def main(argv: list[str] | None = None) -> int:
    default_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser = argparse.ArgumentParser(
        description="Time converted-model manifestations against the original timm model (eval, no_grad), "
        "interleaved in one process; prints a table and writes benchmarks/results/forward.md.",
    )
    parser.add_argument("--model", default="resnet50", help="timm model name (random weights)")
    parser.add_argument("--batch", type=int, default=8, help="batch size")
    parser.add_argument("--size", type=int, default=224, help="input height and width")
    parser.add_argument(
        "--repeats", type=int, default=10, help="timed rounds (each times every variant once)"
    )
    parser.add_argument("--threads", type=int, default=default_threads, help="torch.set_num_threads value")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="Markdown record to write")
    args = parser.parse_args(argv)
    for name in ("batch", "size", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")

    rows, original = run(args)
    title = f"{args.model} forward, {args.batch}x3x{args.size}x{args.size}: time relative to timm"
    print_table(title, verdict(rows), HEADERS, map(cells, rows), text_columns=2, width=140)
    print(f"timm median: {original:.3f} s; native ratio: {rows[0].ratio:.2f}x")

    command = command_line(__file__, argv)
    write_results(args.output, markdown(rows, original, args, command, machine_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
