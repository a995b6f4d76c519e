"""``odeify demo`` (and ``make demo``): the whole tour on the shipped digits model, as a report.

Writes ``OUT/report.md`` with its pictures, every number measured in this run:

1. conversion check: the native manifestation against the source model on the digits test split;
2. sweep before fine-tuning: accuracy against field evaluations for euler, heun and rk4;
3. memory-free fine-tuning of a coarse manifestation (2 linear knots per stage, reversible Heun,
   2 steps, ``backward='reversible'``) with the default recipe: the curves;
4. bytes kept for backward against depth (4 -> 64 steps per stage) per backward mode;
5. the weight path over depth of the fine-tuned model;

plus the converted and the fine-tuned model as files ``odeify.load`` reads.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

import odeify
from odeify.core.errors import ConfigError, FallbackWarning
from odeify.core.fileio import atomic_write_bytes, is_temp_of
from odeify.core.lock import LOCK_FILE
from odeify.inspection.plots import (
    plot_conversion_check,
    plot_history,
    plot_memory,
    plot_sweep,
    plot_weight_path,
)
from odeify.inspection.report import markdown_table
from odeify.models import DEFAULT_MODEL_PATH
from odeify.train.datasets import open_data
from odeify.train.evaluate import evaluate, field_evaluations, saved_for_backward
from odeify.train.finetune import DEFAULT_RECIPE, finetune, recipe_for
from odeify.train.progress import LOGGER, bar_wanted
from odeify.train.state import RUN_FILES
from odeify.train.sweep import sweep, sweep_markdown

COARSE = {
    "integrator": "reversible_heun",
    "steps": 2,
    "knots": 2,
    "basis": "linear",
    "backward": "reversible",
}
COARSE_LABEL = "reversible Heun, 2 steps, 2 linear knots per stage, backward='reversible'"
SWEEP_INTEGRATORS = ("euler", "heun", "rk4")
SWEEP_STEPS = (1, 2, 4, "native", "x2")
MEMORY_STEPS = (4, 8, 16, 32, 64)
MEMORY_MODES = {  # label: manifestation settings (steps added per point)
    "backprop (Euler)": {"integrator": "euler", "backward": "backprop"},
    "checkpoint (Euler)": {"integrator": "euler", "backward": "checkpoint"},
    "reverse (Euler)": {"integrator": "euler", "backward": "reverse"},
    "reversible (reversible Heun)": {"integrator": "reversible_heun", "backward": "reversible"},
    "reversible (ALF)": {"integrator": "alf", "backward": "reversible"},
}
MEMORY_BATCH = 16


DEMO_THREADS = 1
"""The digits model's tensors are small: one torch thread is as fast as two, and on a busy 2-core
machine two threads oversubscribe it (a training step measured 25x slower at a load average of 5)."""


def run_demo(out: Path, epochs: int | None = None) -> Path:
    """Run the tour, write ``out/report.md`` and its files; returns the report's path."""
    threads = torch.get_num_threads()
    torch.set_num_threads(DEMO_THREADS)
    try:
        return _tour(out, epochs)
    finally:
        torch.set_num_threads(threads)


def _tour(out: Path, epochs: int | None) -> Path:
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    recipe = replace(DEFAULT_RECIPE, epochs=epochs) if epochs else DEFAULT_RECIPE
    source = odeify.load_model(DEFAULT_MODEL_PATH)
    native = odeify.convert(str(DEFAULT_MODEL_PATH))
    odeify.save(native, out / "digits_ode.safetensors")
    data = open_data("digits", native)
    test = DataLoader(data.val, batch_size=256)
    sections = [
        "# odeify demo: the shipped digits model, converted, swept, fine-tuned memory-free",
        "",
        f"Model: `{DEFAULT_MODEL_PATH.name}` (a timm ResNet trained on scikit-learn's digits), test split of "
        f"{len(data.val)} digits. Every number below was measured by this run.",
        "",
    ]
    steps = [
        ("conversion check", lambda: _conversion(source, native, test, out)),
        ("sweep", lambda: _sweep(native, test, out)),
        ("fine-tuning", lambda: _finetune(native, data, test, recipe, out)),
        ("memory", lambda: _memory(native, data, out)),
    ]
    with tqdm(steps, desc="demo", unit="part", disable=not bar_wanted()) as bar:
        for number, (label, step) in enumerate(bar, start=1):
            bar.set_postfix_str(label)
            if bar.disable:  # a log file or a pipe: a line per part instead of the bar's redraws
                LOGGER.info(f"demo part {number}/{len(steps)}: {label}")
            sections += step()
    sections += [
        f"Total time: {time.perf_counter() - started:.0f} s. Machine: {_machine()}. Reproduce with "
        "`make demo` or `odeify demo`.",
        "",
    ]
    report = out / "report.md"
    atomic_write_bytes(report, "\n".join(sections).encode())
    return report


def _machine() -> str:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), torch {torch.__version__} "
        f"with {torch.get_num_threads()} thread(s), Python {platform.python_version()}, load average {load}"
    )


def _conversion(source: torch.nn.Module, native: torch.nn.Module, test: DataLoader, out: Path) -> list[str]:
    x, _ = next(iter(DataLoader(test.dataset, batch_size=len(test.dataset))))
    with torch.no_grad():
        expected, actual = source(x), native(x)
    relative = ((actual - expected).abs().max() / expected.abs().max()).item()
    before, after = evaluate(source, test).accuracy, evaluate(native, test).accuracy
    plot_conversion_check(
        expected, actual, out / "conversion_check.png", f"converted (Euler, native depth) vs source: all "
        f"{expected.numel()} test logits\nmax relative error {relative:.2e}"
    )  # fmt: skip
    stages = odeify.converted_stages(native)
    return [
        "## 1. Conversion check",
        "",
        f"`odeify.convert` turned {len(stages)} runs of identity blocks ("
        + ", ".join(f"{s.stage_name}: {s.depth} blocks" for s in stages)
        + ") into ODE stages. At native depth (Euler, one step and one knot per block) the converted model "
        f"reproduces the source on the whole test split: max relative logit error {relative:.2e} (fp32 "
        f"round-off), accuracy {100 * before:.2f}% -> {100 * after:.2f}%.",
        "",
        "![converted vs source logits](conversion_check.png)",
        "",
    ]


def _sweep(native: torch.nn.Module, test: DataLoader, out: Path) -> list[str]:
    points = sweep(native, lambda: test, SWEEP_INTEGRATORS, SWEEP_STEPS)
    plot_sweep(points, out / "sweep.png", title="accuracy vs NFE before fine-tuning (digits test split)")
    return [
        "## 2. Other manifestations before fine-tuning",
        "",
        "The same continuous model run with other integrators and step counts (knots unchanged): no "
        "training, only `odeify.retarget`. NFE counts field (block) evaluations per forward pass.",
        "",
        *sweep_markdown(points),
        "",
        "![accuracy vs NFE](sweep.png)",
        "",
    ]


def _finetune(native: torch.nn.Module, data, test: DataLoader, recipe, out: Path) -> list[str]:
    coarse = odeify.retarget(native, **COARSE)
    retargeted = evaluate(coarse, test).accuracy  # finetune calibrates first: the start it improves
    recipe = recipe_for(coarse, recipe)  # the peak finetune trains it at, for the report
    run, previous = out / "finetune", out / "finetune.previous"
    for folder in (run, previous):
        _check_demo_run(folder)
    if previous.exists():  # a killed demo's: its run is the last complete one, restore it
        if run.exists():
            shutil.rmtree(run)
        previous.rename(run)
    if run.exists():
        run.rename(previous)  # the last demo's run, kept until this one is done
    try:
        result = finetune(
            coarse, data, recipe, out=run, teacher=native, progress=False
        )  # its epoch lines go to the odeify logger, which the command line prints
    except BaseException:
        if previous.exists():
            shutil.rmtree(run, ignore_errors=True)
            previous.rename(run)
        raise
    if previous.exists():
        shutil.rmtree(previous)
    history = result.history
    plot_history({COARSE_LABEL: history}, out / "finetune.png", title="memory-free fine-tuning")
    plot_weight_path(
        result.model, out / "weight_path.png", title="fine-tuned coarse model: weight path over depth"
    )
    rows = [
        (
            str(r.epoch),
            "-" if r.train_loss is None else f"{r.train_loss:.4f}",
            f"{100 * r.val_accuracy:.2f}",
            "-" if r.seconds is None else f"{r.seconds:.1f}",
        )
        for r in history
    ]
    return [
        "## 3. Memory-free fine-tuning of a coarse manifestation",
        "",
        f"{COARSE_LABEL}: {field_evaluations(coarse)} field evaluations instead of "
        f"{field_evaluations(native)}, fewer knots, and a backward pass that keeps no step states yet "
        "gives exact gradients. Trained with the default recipe (`odeify.train.finetune.DEFAULT_RECIPE`: "
        f"{recipe.optimizer}, lr {recipe.lr:g}, {recipe.warmup:.0%} warm-up then cosine, weight decay "
        f"{recipe.weight_decay:g}, {recipe.epochs} epochs of batch {recipe.batch_size}, distilling from "
        "the converted model at native depth, i.e. the source network; docs/finetuning.md has the "
        "measurements behind it), after fitting the coarse stages to the source on the training images "
        f"(`odeify.calibrate`, which `finetune` runs first on a coarse model): {100 * retargeted:.2f}% as "
        f"retargeted, {100 * history[0].val_accuracy:.2f}% calibrated (epoch 0). "
        f"Checkpoints: `{out / 'finetune'}/` (try `odeify eval "
        f"{out / 'finetune' / 'best.safetensors'} --data digits`).",
        "",
        *markdown_table(("epoch", "train loss", "test accuracy %", "seconds"), rows, text_columns=1),
        "",
        "![fine-tuning curves](finetune.png)",
        "",
        "The fine-tuned model's weights over depth: each knot tensor's norm (dots) and the linear basis "
        "between them.",
        "",
        "![weight path](weight_path.png)",
        "",
    ]


def _check_demo_run(folder: Path) -> None:
    """A rerun of the demo replaces its last fine-tuning run, and nothing else: ``folder`` must be
    absent or a folder holding only a run's files (raises ConfigError naming what else is there)."""
    if not folder.exists() and not folder.is_symlink():
        return
    if folder.is_symlink() or not folder.is_dir():
        others = [folder]
    else:
        others = [p for p in folder.iterdir() if not _is_run_file(p)]
    if others:
        raise ConfigError(
            f"the demo writes its fine-tuning run to {folder}, which holds what the demo did not write "
            f"({', '.join(p.name for p in others[:3])}): move it away, or run the demo with another --out"
        )


def _is_run_file(path: Path) -> bool:
    """A regular file a fine-tuning run writes: an output, its lock, or an output's temporary (a write
    that was killed)."""
    if path.is_symlink() or not path.is_file():
        return False
    if path.name in (*RUN_FILES, LOCK_FILE):
        return True
    return any(is_temp_of(path.name, Path(name)) for name in RUN_FILES)


def _memory(native: torch.nn.Module, data, out: Path) -> list[str]:
    x, y = next(iter(DataLoader(data.train, batch_size=MEMORY_BATCH)))
    saved: dict[str, list[tuple[int, int]]] = {}
    fell_back = passes = 0  # backward='reverse': passes redone exactly, of all its stage passes
    with warnings.catch_warnings():
        # the report counts the fallbacks below; a warning per stage and depth would only bury the
        # progress bar (each depth is a new model, so each warns once more)
        warnings.simplefilter("ignore", FallbackWarning)
        for label, settings in MEMORY_MODES.items():
            for steps in MEMORY_STEPS:
                model = odeify.retarget(native, steps=steps, **settings)
                saved.setdefault(label, []).append((steps, saved_for_backward(model, x, y)))
                if settings["backward"] == "reverse":
                    stats = [stage.adjoint_stats for stage in odeify.converted_stages(model)]
                    fell_back += sum(s.fallbacks for s in stats)
                    passes += sum(s.backward_passes for s in stats)
    plot_memory(saved, out / "memory.png", title=f"bytes kept for backward, batch {MEMORY_BATCH}")
    rows = [
        (label, *(f"{b / 2**20:.2f}" for _, b in pairs), f"{pairs[-1][1] / pairs[0][1]:.2f}x")
        for label, pairs in saved.items()
    ]
    headers = (
        "backward mode",
        *(f"{s} steps" for s in MEMORY_STEPS),
        f"{MEMORY_STEPS[-1]} vs {MEMORY_STEPS[0]}",
    )
    return [
        "## 4. Memory kept for backward against depth",
        "",
        f"One training step (batch {MEMORY_BATCH}) per backward mode and depth (steps per stage, native "
        "knots). MiB of activations autograd keeps between forward and backward (every saved tensor once "
        "per storage, parameters excluded):",
        "",
        *markdown_table(headers, rows, text_columns=1),
        "",
        "Each memory-saving mode here is set for the whole model (`backward='checkpoint'` etc.), so the "
        "parts between the stages (stem, downsampling block, head) are recomputed in backward too. "
        "backprop keeps every intermediate and checkpoint every step's state: both grow with depth. "
        "reverse and reversible keep what the stages and segments take in and give out: flat in depth. "
        f"reverse rebuilt the states by stepping Euler backward; in {fell_back} of its {passes} stage "
        "backward passes the rebuilt states missed the tolerance and the pass was redone exactly from the "
        "stage input (more compute in backward, the same memory between forward and backward).",
        "",
        "![memory vs depth](memory.png)",
        "",
    ]
