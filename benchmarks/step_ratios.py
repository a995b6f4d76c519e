"""Benchmark: whole-model training-step time as a ratio to timm plain, measured interleaved.

``benchmarks/train_step.py`` runs each configuration in its own process, one after another, so on
a shared machine a change of load between two processes moves their ratio (15-30% between runs
there). Here every row is built in one process and the rows take turns: each round steps every
row once, each row's time is divided by timm plain's in the same round, and the report gives the
median over rounds with the spread. Process CPU time, with ``--threads 1``, is the steadiest
measure on a busy machine (other processes then cost this one cache, not CPU time); wall time is
reported too. The rows and models are train_step.py's (random-weight timm models, batch 8 of
224x224, fp32, the memory-free rows with checkpointed segments); saved bytes and gradients are
train_step.py's job. Writes benchmarks/results/step_ratios.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import command_line, write_results
from tables import results_document
from train_step import (
    BATCH,
    CLASSES,
    MODEL_CHOICES,
    MODELS,
    ROWS,
    SIZE,
    STEPS,
    WEIGHTS,
    build,
    weights_phrase,
)

RESULTS = Path(__file__).resolve().parent / "results"
HEADERS = (
    "model",
    "row",
    "steps",
    "CPU time vs timm",
    "spread",
    "wall time vs timm",
    "spread",
    "timm step s",
)


def measure(
    model_name: str, rows: list[str], steps: str, rounds: int, weights: str = "random"
) -> list[tuple[str, ...]]:
    """One table row per training row: median and spread of its per-round ratios to timm plain."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=g)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
    models = {row: build(model_name, ROWS[row], steps, weights) for row in rows}

    def step(model: torch.nn.Module) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), time.process_time()
        F.cross_entropy(model(x), labels).backward()
        return time.perf_counter() - wall, time.process_time() - cpu

    for model in models.values():  # warm-up: graphs built, gradients allocated
        step(model)
    times: dict[str, list[tuple[float, float]]] = {row: [] for row in rows}
    for turn in range(rounds):
        for row, model in models.items():
            times[row].append(step(model))
        print(f"  {model_name} {steps} round {turn + 1}/{rounds}", file=sys.stderr, flush=True)
    base = times["timm"]
    table = []
    for row in rows:
        cpu = [c / b for (_, c), (_, b) in zip(times[row], base, strict=True)]
        wall = [w / b for (w, _), (b, _) in zip(times[row], base, strict=True)]
        shown = steps if ROWS[row].integrator else "-"
        table.append(
            (
                model_name,
                row,
                shown,
                *_ratio(cpu),
                *_ratio(wall),
                f"{statistics.median(w for w, _ in base):.2f}",
            )
        )
    return table


def _ratio(ratios: list[float]) -> tuple[str, str]:
    return f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}..{max(ratios):.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", nargs="+", choices=MODEL_CHOICES, default=MODELS, help="models to run (a ViT, a Swin too)"
    )
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="ways to train")
    parser.add_argument("--steps", choices=STEPS, default="native", help="the manifestation's steps")
    parser.add_argument("--rounds", type=int, default=5, help="rounds: every row steps once per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest CPU time)")
    parser.add_argument(
        "--weights", choices=WEIGHTS, default="random", help="train_step.py's --weights (default: random)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "step_ratios.md", help="Markdown record")
    args = parser.parse_args(argv)
    if "timm" not in args.rows:
        parser.error("the ratios need the 'timm' row")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", "odeify: stage", RuntimeWarning)  # fallbacks: train_step.py counts them
    rows = ["timm", *(row for row in args.rows if row != "timm")]
    table = [
        line for model in args.models for line in measure(model, rows, args.steps, args.rounds, args.weights)
    ]
    weakened = weights_phrase(args.weights)
    lines = [
        "# Training-step time against timm plain, interleaved in one process",
        "",
        f"Every row built in one process; each of {args.rounds} rounds steps every row once; a row's time",
        "over timm plain's in the same round, median and spread over the rounds. Random-weight timm",
        f"models{weakened}, batch {BATCH} of {SIZE}x{SIZE}, fp32, {args.threads} torch thread(s).",
        "Saved bytes, gradients and fallbacks: benchmarks/results/train_step.md.",
    ]
    write_results(
        args.output, results_document(lines, HEADERS, table, command_line(__file__, argv), text_columns=3)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
