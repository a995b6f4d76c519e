"""Benchmark: how long trace + residual analysis takes, next to one eager forward of the same model.

The analysis runs once per conversion and per ``odeify inspect``, so it should cost about as much
as a forward pass, not minutes. Target: resnet152 analysed in under 1 s on a laptop-class CPU.
Writes a rich table to the terminal and a Markdown record to benchmarks/results/analyze.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from machine import command_line, write_results
from tables import print_table, results_document
from tqdm import tqdm

import odeify
from odeify.models.loading import load_model

DEFAULT_MODELS = ("resnet50", "resnet152")
INPUT_SHAPE = (1, 3, 224, 224)
TARGET = ("resnet152", 1.0)  # model, seconds
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "analyze.md"


@dataclass(frozen=True)
class Row:
    """Timings of one model, in seconds."""

    model: str
    blocks: int
    runs: str
    analyze_first: float
    analyze_median: float
    analyze_cpu: float
    forward_median: float

    @property
    def ratio(self) -> float:
        return self.analyze_median / self.forward_median


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall time and process CPU time of one call (CPU time shows how busy other processes kept us)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(name: str, repeats: int, progress: tqdm) -> Row:
    """First and median analysis time (median after the first call), and median eager forward time."""
    model = load_model(name)  # timm, pretrained=False: the weights do not matter for timing
    plans = []
    first, _ = timed(lambda: plans.append(odeify.analyze(model, INPUT_SHAPE)))
    progress.update()
    analyze_times = []
    for _ in range(repeats):
        analyze_times.append(timed(lambda: odeify.analyze(model, INPUT_SHAPE)))
        progress.update()
    x = torch.randn(INPUT_SHAPE, generator=torch.Generator().manual_seed(0))
    forward_times = []
    with torch.no_grad():
        model(x)  # warm-up: allocator and kernel selection
        for _ in range(repeats):
            forward_times.append(timed(lambda: model(x))[0])
            progress.update()
    return Row(
        model=name,
        blocks=len(plans[0].blocks),
        runs=", ".join(map(str, plans[0].run_lengths)),
        analyze_first=first,
        analyze_median=statistics.median(wall for wall, _ in analyze_times),
        analyze_cpu=statistics.median(cpu for _, cpu in analyze_times),
        forward_median=statistics.median(forward_times),
    )


HEADERS = ("model", "blocks", "runs", "analyze 1st", "analyze", "analyze CPU", "forward", "analyze/forward")


def cells(row: Row) -> tuple[str, ...]:
    return (
        row.model,
        str(row.blocks),
        row.runs,
        f"{row.analyze_first:.3f}",
        f"{row.analyze_median:.3f}",
        f"{row.analyze_cpu:.3f}",
        f"{row.forward_median:.3f}",
        f"{row.ratio:.2f}x",
    )


def verdict(rows: list[Row]) -> str:
    model, limit = TARGET
    row = next((r for r in rows if r.model == model), None)
    if row is None:
        return f"target ({model} analysed in < {limit:g} s) not measured"
    status = "met" if row.analyze_median < limit else "MISSED"
    return (
        f"target {status}: {model} analysed in {row.analyze_median:.3f} s "
        f"(median wall time, CPU {row.analyze_cpu:.3f} s; target < {limit:g} s)"
    )


def markdown(rows: list[Row], command: str, repeats: int) -> str:
    lines = [
        "# Trace + analysis time vs one eager forward (seconds)",
        "",
        f"`odeify.analyze(model, {INPUT_SHAPE})` (trace, meta-tensor shapes, residual blocks and runs)",
        f"against one eager forward at {'x'.join(map(str, INPUT_SHAPE))} under `torch.no_grad()`; medians of",
        f"{repeats} runs after a warm-up call. 'analyze 1st' is that warm-up analysis; for the first model",
        "it also pays the process's one-time costs (lazy imports, first-call set-up). 'analyze CPU' is the",
        "process CPU time of the analysis: on an idle machine it matches the wall time, so a gap between",
        "them shows time lost to other processes.",
    ]
    return results_document(
        lines, HEADERS, map(cells, rows), command, text_columns=3, after=[verdict(rows) + "."]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Time odeify.analyze (trace + residual analysis) against one eager forward pass "
        f"at {'x'.join(map(str, INPUT_SHAPE))}, for timm models with random weights.",
    )
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="timm model names")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="Markdown record to write")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    rows = []
    with tqdm(total=len(args.models) * (2 * args.repeats + 1), desc="timing", file=sys.stderr) as progress:
        for name in args.models:
            rows.append(measure(name, args.repeats, progress))

    title = "odeify.analyze vs one eager forward (seconds)"
    print_table(title, verdict(rows), HEADERS, map(cells, rows), text_columns=3, width=120)

    command = command_line(__file__, argv)
    write_results(args.output, markdown(rows, command, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
