"""Benchmark: which fine-tuning recipe recovers a coarse manifestation's accuracy, and at what cost.

On the shipped digits model (odeify/data/digits_resnet.safetensors), for the four manifestations
of issue 11's table, each trained memory-free:

- Euler, 1 step per stage, ``backward='checkpoint'``;
- rk4, 1 step per stage, ``backward='reverse'``;
- reversible Heun, half the native steps, ``backward='reversible'``;
- linear basis, 2 knots per stage, Euler at native steps, ``backward='reverse'``;

every candidate recipe is run with ``odeify.train.finetune.finetune`` (the loop ``odeify finetune``
runs) from the same starting model, and the script reports test accuracy before and after the
recipe's epochs (the last epoch's model, not the best one: the test split picks nothing; with a
weight average, the average's, then the last step's weights'), the time per epoch, and the bytes
each manifestation keeps for backward in one training step next to plain backprop through the same
manifestation. The recipe that meets the target on all four
(within 0.5 point of the source model, never below the start) at the lowest cost becomes
``odeify.train.finetune.DEFAULT_RECIPE``. Writes benchmarks/results/finetune.md and finetune.png.

    python benchmarks/finetune.py                 # all candidates (10 minutes on 1 thread, quiet machine)
    python benchmarks/finetune.py --only default  # the default recipe only
    python benchmarks/finetune.py --only default --seeds 8 --output benchmarks/results/finetune_seeds.md
    python benchmarks/finetune.py --only ema --seeds 8 --output benchmarks/results/finetune_ema_seeds.md

Models like the shipped one (the same net trained with another seed by examples/train_digits.py):

    python examples/train_digits.py --seed 1 --out /tmp/digits_seed1.safetensors
    python benchmarks/finetune.py --only default --seeds 4 --model /tmp/digits_seed1.safetensors \
        --output benchmarks/results/finetune_digits_seed1.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from machine import command_line, describe_machine
from matplotlib.figure import Figure
from tables import markdown_table

import odeify
from odeify.core.errors import OdeifyError
from odeify.core.fileio import atomic_path, atomic_write_bytes
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models.checkpoints import read_checkpoint_metadata
from odeify.models.digits import META_DIGITS
from odeify.train.datasets import open_data
from odeify.train.evaluate import evaluate, saved_for_backward
from odeify.train.finetune import DEFAULT_RECIPE, Recipe, finetune

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_GAP = 0.005  # within 0.5 point of the source model's accuracy
MANIFESTATIONS = {
    "Euler, 1 step per stage (checkpoint)": {"steps": 1, "backward": "checkpoint"},
    "rk4, 1 step per stage (reverse)": {"integrator": "rk4", "steps": 1, "backward": "reverse"},
    "reversible Heun, half the steps (reversible)": {
        "integrator": "reversible_heun",
        "steps": "x0.5",
        "backward": "reversible",
    },
    "linear basis, 2 knots, Euler native (reverse)": {"basis": "linear", "knots": 2, "backward": "reverse"},
}
CE = replace(DEFAULT_RECIPE, distill=0.0)
CANDIDATES = {  # label: recipe; all start from the same coarse model and use seed 0
    "issue baseline: Adam 1e-3, no schedule, cross-entropy": Recipe(
        epochs=3, optimizer="adam", lr=1e-3, warmup=0.0, weight_decay=0.0, clip_grad_norm=None, distill=0.0
    ),
    "AdamW 1e-3, warm-up + cosine, cross-entropy": CE,
    "AdamW 3e-4, warm-up + cosine, cross-entropy": replace(CE, lr=3e-4),
    "AdamW 3e-4, warm-up + cosine, cross-entropy, 5 epochs": replace(CE, lr=3e-4, epochs=5),
    "SGD 0.01 + momentum, warm-up + cosine, cross-entropy, 5 epochs": replace(
        CE, optimizer="momentum", lr=1e-2, epochs=5
    ),
    "AdamW 1e-3, warm-up + cosine, half distillation": replace(DEFAULT_RECIPE, distill=0.5),
    "AdamW 3e-4, warm-up + cosine, distillation": replace(DEFAULT_RECIPE, lr=3e-4),
    "default: AdamW 1e-3, warm-up + cosine, distillation": DEFAULT_RECIPE,
    "AdamW 1e-3, warm-up + cosine, distillation, weight EMA (decay <= 0.999)": replace(
        DEFAULT_RECIPE, ema_decay=0.999
    ),
    "AdamW 1e-3, warm-up + cosine, distillation, weight EMA (decay <= 0.9)": replace(
        DEFAULT_RECIPE, ema_decay=0.9
    ),
}
REPEATED = (  # the best recipes, run over --seeds seeds
    "AdamW 1e-3, warm-up + cosine, cross-entropy",
    "default: AdamW 1e-3, warm-up + cosine, distillation",
    "AdamW 1e-3, warm-up + cosine, distillation, weight EMA (decay <= 0.999)",
    "AdamW 1e-3, warm-up + cosine, distillation, weight EMA (decay <= 0.9)",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        choices=["default", "ema", "all"],
        default="all",
        help="which recipes to run: the default, those with a weight average (EMA), or all",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady when busy)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for the repeated recipes")
    parser.add_argument("--output", type=Path, default=RESULTS / "finetune.md", help="Markdown and .png")
    parser.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL_PATH,
        help="the trained digits model to convert (default: the shipped one)",
    )
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    seeds = range(args.seeds)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    try:
        source = odeify.load_model(args.model)
    except OdeifyError as error:
        parser.error(f"--model: {error}")
    native = odeify.convert(str(args.model))
    data = open_data("digits", native)
    source_accuracy = evaluate(source, torch.utils.data.DataLoader(data.val, batch_size=256)).accuracy
    runs = [(label, 0) for label in CANDIDATES] + [(label, seed) for label in REPEATED for seed in seeds[1:]]
    if args.only == "default":
        runs = [(label, seed) for label, seed in runs if CANDIDATES[label] == DEFAULT_RECIPE]
    elif args.only == "ema":
        runs = [(label, seed) for label, seed in runs if CANDIDATES[label].ema]

    results = {}  # (recipe label, seed, manifestation) -> history
    for recipe_label, seed in runs:
        for label, settings in MANIFESTATIONS.items():
            model = odeify.retarget(native, **settings)  # the teacher is the source network itself
            result = finetune(
                model, data, CANDIDATES[recipe_label], seed=seed, teacher=native, progress=False
            )
            results[recipe_label, seed, label] = history = result.history
            print(f"{recipe_label} | seed {seed} | {label}: {_change(history)}", file=sys.stderr)

    x, y = next(iter(torch.utils.data.DataLoader(data.train, batch_size=64)))
    memory = {
        label: (
            saved_for_backward(odeify.retarget(native, **settings), x, y),
            saved_for_backward(odeify.retarget(native, **{**settings, "backward": "backprop"}), x, y),
        )
        for label, settings in MANIFESTATIONS.items()
    }
    lines = report(
        results, memory, source_accuracy, time.perf_counter() - started, seeds, args.output, args.model
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.output, ("\n".join(lines) + "\n").encode())
    plot(results, source_accuracy, args.output.with_suffix(".png"))
    print("\n".join(lines))


def _training_seed(path: Path) -> int | None:
    """The training seed ``examples/train_digits.py`` recorded in a digits model's metadata."""
    return json.loads(read_checkpoint_metadata(path).get(META_DIGITS, "{}")).get("train_seed")


def _after(history: list) -> str:
    """The accuracy after training; with a weight average, the last step's weights' in parentheses."""
    last = history[-1]
    raw = "" if last.val_accuracy_raw is None else f" (last step {100 * last.val_accuracy_raw:.2f})"
    return f"{100 * last.val_accuracy:.2f}{raw}"


def _change(history: list) -> str:
    return f"{100 * history[0].val_accuracy:.2f} -> {_after(history)}"


def _meets(history: list, source_accuracy: float) -> bool:
    after, before = history[-1].val_accuracy, history[0].val_accuracy
    return after >= source_accuracy - TARGET_GAP and after >= before


def report(
    results: dict,
    memory: dict,
    source_accuracy: float,
    seconds: float,
    seeds: range,
    output: Path,
    model: Path,
) -> list[str]:
    source_story = f"`examples/train_digits.py --seed {_training_seed(model)}`"
    if model == DEFAULT_MODEL_PATH:
        source_story = f"the shipped model, {source_story}"
    command = command_line(__file__)
    recipes = list(dict.fromkeys(label for label, _, _ in results))
    lines = [
        "# Fine-tuning recipe: recovering coarse manifestations of the digits model",
        "",
        f"Command: `{command}` ({seconds / 60:.0f} min)  ",
        f"Machine: {describe_machine()}",
        "",
        f"Source model: `{model.name}` ({source_story}), {100 * source_accuracy:.2f}% on the 359 "
        "held-out test digits. Target: every manifestation ends at >= "
        f"{100 * (source_accuracy - TARGET_GAP):.2f}% (within 0.5 point; one test digit is 0.28 point) "
        "and never below where it started. 'after' is the last epoch's model, not the best one (the test "
        "split selects nothing). Each run starts from the same coarse model, trains with "
        "`odeify.train.finetune.finetune` (the loop of `odeify finetune`), batch 64, and distills, where the "
        "recipe does, from the converted model at native depth (the source network, exactly). With a "
        "weight average (EMA), 'after' is the average's accuracy, which is the model the run returns and "
        "saves; the last step's weights' follows in parentheses (the same training as the recipe without "
        "EMA).",
        "",
        "## Candidates (seed 0)",
        "",
    ]
    rows = []
    for recipe_label in recipes:
        histories = [results[recipe_label, 0, label] for label in MANIFESTATIONS]
        met = all(_meets(h, source_accuracy) for h in histories)
        cells = [_change(h) for h in histories]
        rows.append((recipe_label, str(CANDIDATES[recipe_label].epochs), *cells, "yes" if met else "no"))
    lines += markdown_table(("recipe", "epochs", *MANIFESTATIONS, "target met"), rows, text_columns=1)
    lines += ["", f"## Seeds: the best recipes over {len(seeds)} seeds (batch order and initial RNG)", ""]
    rows = []
    for recipe_label in REPEATED:
        for seed in seeds:
            if (recipe_label, seed, next(iter(MANIFESTATIONS))) not in results:
                continue
            histories = [results[recipe_label, seed, label] for label in MANIFESTATIONS]
            met = all(_meets(h, source_accuracy) for h in histories)
            cells = [_after(h) for h in histories]
            rows.append((recipe_label, str(seed), *cells, "yes" if met else "no"))
    lines += markdown_table(("recipe", "seed", *MANIFESTATIONS, "target met"), rows, text_columns=1)
    timed = next((r for r in recipes if CANDIDATES[r] == DEFAULT_RECIPE), recipes[0])
    lines += ["", f"## Time per epoch ({timed}, seed 0; 22 batches of 64)", ""]
    rows = []
    for label in MANIFESTATIONS:
        history = results.get((timed, 0, label))
        if history:
            rows.append((label, f"{statistics.median(h.seconds for h in history[1:]):.1f}"))
    lines += markdown_table(("manifestation", "s/epoch (median)"), rows, text_columns=1)
    lines += [
        "",
        "## Memory kept for backward (one training step, batch 64)",
        "",
        *markdown_table(
            ("manifestation", "memory-free mode", "backprop, same manifestation", "ratio"),
            (
                (label, f"{free / 2**20:.2f} MiB", f"{full / 2**20:.2f} MiB", f"{free / full:.2f}")
                for label, (free, full) in memory.items()
            ),
            text_columns=1,
        ),
        "",
        "Each memory-free mode is set for the whole model (one `backward=` setting), so the stem, the "
        "downsampling block and the head are recomputed in backward too: a step keeps the inputs of the "
        "stages and of the segments between them. How this scales with depth: `make demo` (section 4) and "
        "benchmarks/results/adjoint_memory.md.",
        "",
        f"![validation accuracy per epoch]({output.with_suffix('.png').name})",
        "",
    ]
    return lines


def plot(results: dict, source_accuracy: float, path: Path) -> None:
    """Test accuracy per epoch (seed 0), one panel per manifestation, one line per recipe."""
    recipes = list(dict.fromkeys(label for label, _, _ in results))
    fig = Figure(figsize=(5 * len(MANIFESTATIONS), 4.6))
    axes = fig.subplots(1, len(MANIFESTATIONS), squeeze=False)[0]
    for ax, label in zip(axes, MANIFESTATIONS, strict=True):
        for recipe_label in recipes:
            history = results[recipe_label, 0, label]
            style = {"linewidth": 2.5, "color": "black"} if CANDIDATES[recipe_label] == DEFAULT_RECIPE else {}
            accuracies = [100 * h.val_accuracy for h in history]
            ax.plot([h.epoch for h in history], accuracies, "o-", label=recipe_label, markersize=3, **style)
        ax.axhline(100 * source_accuracy, color="0.3", linestyle="--", label="source model")
        ax.axhline(100 * (source_accuracy - TARGET_GAP), color="0.6", linestyle=":", label="target")
        ax.set(title=label, xlabel="epoch (0 = before)", ylabel="test accuracy (%)", ylim=(90, 100))
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


if __name__ == "__main__":
    main()
