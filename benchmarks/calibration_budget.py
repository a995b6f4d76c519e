"""Benchmark: how much calibration is enough? Its budget against one fine-tuning epoch's time.

``odeify.calibrate`` fits each stage by ``iterations`` Adam steps on minibatches of ``batch_size``
of its calibration images. This script calibrates the corpus's coarse manifestations (those of
``benchmarks/compression.py``) at several budgets, written ``ITERATIONSxBATCH``, and times one
epoch of the default fine-tuning recipe on the same model in the same run, so the two times are
comparable (the target: a calibration costs at most one epoch); ``:output`` after a budget
calibrates with ``objective="output"``. Reported per model and compression:
the accuracy on the 359 validation images after each budget (seed 0 / seed 1), its wall time, and
its ratio to the epoch's.

    python benchmarks/calibration_budget.py --models digits_seed2,resnetv2_18,vit6
    python benchmarks/calibration_budget.py --report
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from compression import _accuracy, _calibration_data, _per_stage, compressions
from finetune import CORPUS, RESULTS, native_model
from machine import command_line, describe_machine, write_results
from tables import markdown_table

BUDGETS = ("50x64", "30x64", "50x32", "30x32")
CACHE = Path(__file__).resolve().parents[1] / "out" / "calibration_budget" / "runs.jsonl"


def _budget(text: str) -> dict[str, Any]:
    """``ITERATIONSxBATCH``, then optionally ``@LR`` and ``:OBJECTIVE``, as calibrate's keyword arguments."""
    text, _, objective = text.partition(":")
    size, _, lr = text.partition("@")
    iterations, _, batch = size.partition("x")
    return {
        "iterations": int(iterations),
        "batch_size": int(batch),
        **({"lr": float(lr)} if lr else {}),
        **({"objective": objective} if objective else {}),
    }


def _epoch_seconds(model, native, data) -> tuple[float, float]:
    """Wall and CPU time of one epoch of the default recipe (validation included), distilling from
    ``native``."""
    from odeify.train.finetune import DEFAULT_RECIPE, finetune

    model = copy.deepcopy(model)  # fine-tuning trains the model it is given, in place
    started, cpu = time.perf_counter(), time.process_time()
    finetune(
        model, data, replace(DEFAULT_RECIPE, epochs=1), seed=0, teacher=native, progress=False,
        calibrate_first=False,
    )  # fmt: skip
    return time.perf_counter() - started, time.process_time() - cpu


def sweep(args: argparse.Namespace) -> None:
    """For each model and compression: one epoch's time, then each budget and seed calibrated."""
    import odeify

    args.cache.parent.mkdir(parents=True, exist_ok=True)
    for model_name in args.models:
        native, data, _ = native_model(model_name, args.corpus, "as trained")
        for compression, settings in compressions(model_name).items():
            if args.compressions and compression not in args.compressions:
                continue
            coarse = odeify.retarget(native, **_per_stage(native, settings))
            entry: dict[str, Any] = {"model": model_name, "compression": compression}
            entry["start"] = _accuracy(coarse, data)
            epochs = [_epoch_seconds(coarse, native, data)]  # timed before and after the budgets
            entry["budgets"] = {}
            for budget in args.budgets:
                runs = []
                for seed in range(args.seeds):
                    started, cpu = time.perf_counter(), time.process_time()
                    calibrated, _ = odeify.calibrate(
                        coarse, _calibration_data(model_name, args.corpus), **_budget(budget), seed=seed,
                        progress=False,
                    )  # fmt: skip
                    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
                    accuracy = _accuracy(calibrated, data)
                    runs.append({"seed": seed, "seconds": seconds, "cpu_s": cpu, "accuracy": accuracy})
                entry["budgets"][budget] = runs
                print(
                    f"{model_name} | {compression} | {budget}: "
                    + " / ".join(f"{r['accuracy']:.2f} in {r['cpu_s']:.1f} CPU s" for r in runs)
                    + f" (epoch {epochs[0][1]:.1f} CPU s)",
                    flush=True,
                )
            epochs.append(_epoch_seconds(coarse, native, data))
            entry["epoch_s"] = statistics.mean(wall for wall, _ in epochs)
            entry["epoch_cpu_s"] = statistics.mean(cpu for _, cpu in epochs)
            with args.cache.open("a") as handle:
                handle.write(json.dumps(entry) + "\n")


def report(args: argparse.Namespace, argv: list[str] | None) -> None:
    entries = [json.loads(line) for line in args.cache.read_text().splitlines() if line.strip()]
    budgets = list(dict.fromkeys(b for e in entries for b in e["budgets"]))
    rows = []
    for e in entries:
        row = [e["model"], e["compression"], f"{e['start']:.2f}", f"{e['epoch_cpu_s']:.1f}"]
        for budget in budgets:
            runs = e["budgets"].get(budget)
            if not runs:
                row.append("")
                continue
            accuracy = " / ".join(f"{r['accuracy']:.2f}" for r in runs)
            seconds = statistics.median(r["cpu_s"] for r in runs)
            row.append(f"{accuracy} ({seconds / e['epoch_cpu_s']:.2f}x)")
        rows.append(row)
    header = ["model", "compression", "start", "epoch CPU s", *budgets]
    text = "\n\n".join(
        [
            "# Calibration budget against one fine-tuning epoch",
            f"Command: `{command_line(__file__, argv)}`  \nMachine: {describe_machine()}",
            "Each budget is `iterations x batch size` per stage (256 images; `@lr`: a learning rate "
            'other than the default 1e-3; `:output`: calibrated with `objective="output"`). A cell: '
            "accuracy on the 359 validation images after "
            "calibrating, seed 0 / seed 1, and in brackets the calibration's CPU time (median of the "
            "seeds; one thread, so the work done whatever the machine's load) over one epoch's of the "
            "default fine-tuning recipe on the same model, timed in the same run (the mean of one epoch "
            "before the budgets and one after). `start` is the accuracy before calibrating.",
            "\n".join(markdown_table(header, rows)),
        ]
    )
    write_results(args.output, text + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="digits_seed2,resnetv2_18,resnet50,vit6")
    parser.add_argument("--compressions", default=None, help="';'-separated names (default: all)")
    parser.add_argument(
        "--budgets",
        default=",".join(BUDGETS),
        help="ITERATIONSxBATCH[@LR][:OBJECTIVE], ','-separated (30x64:output: 30 steps, output objective)",
    )
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--output", type=Path, default=RESULTS / "calibration_budget.md")
    parser.add_argument("--report", action="store_true", help="only write the results file from the cache")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the corpus and compression benchmarks: deterministic, comparable
    args.models = args.models.split(",")
    args.budgets = args.budgets.split(",")
    args.compressions = args.compressions.split(";") if args.compressions else None
    if not args.report:
        sweep(args)
    report(args, argv)


if __name__ == "__main__":
    main()
