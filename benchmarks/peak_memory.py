"""Benchmark: the peak memory of one training step, and what is alive at that peak, per training mode.

Rows, each in fresh processes: timm plain, timm with ``set_grad_checkpointing(True)``, the timm model
under ``torch.compile`` with an activation memory budget (``--compile-budget``; what a PyTorch 2 user
tries first), and the converted model with odeify checkpoint, reversible ALF and reversible Heun
(the whole-model memory plan: the parts between stages checkpointed). Random non-trivial weights with
every residual branch's last-norm gain scaled as a trained network's (``train_step.py --weights
trained-like``), fp32, cross-entropy, train mode.

Per row: a warm-up step (gradients allocated), then

- tensor peak: the most bytes of tensors alive at once during one step over those alive before it
  (:class:`odeify.inspection.TensorPeak`: deterministic, the same step gives the same bytes
  anywhere; blind to what a compiled graph allocates inside its kernels, so not given for the
  compiled row);
- RSS peak: the process's peak resident memory during one step over its resident memory before it,
  in a second process with ``MALLOC_MMAP_THRESHOLD_`` set so that freed blocks go back to the system
  at once; on CUDA ``torch.cuda.max_memory_allocated`` over what was allocated before;
- step time: the median of ``--repeats`` steps (spread: fastest and slowest), and its ratio to timm
  plain's; a model's rows are alive together and step in turns, so a change of the machine's speed
  during the run moves them alike (``benchmarks/child.py``);
- at the peak (odeify rows): the largest groups of tensors alive, by the op that made them.

Writes benchmarks/results/peak_memory.md, .csv and .png (peak against step time, one point per row).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from child import SteppedChild, report_to_parent, requests
from machine import command_line, describe_machine, save_figure
from memory import reset_peak_rss, rss
from tables import markdown_table
from train_step import ROWS, Row, as_row, build

from odeify.core.fileio import atomic_write_bytes
from odeify.inspection.tensor_peak import TensorPeak
from odeify.models.loading import load_model

RESULTS = Path(__file__).resolve().parent / "results"
MB = 2**20
SIZE, CLASSES = 224, 1000
BATCHES = {
    "resnet50": 16,
    "resnet152": 8,
    "vit_small_patch16_224": 16,
    "convnext_tiny": 16,
    "swin_tiny_patch4_window7_224": 8,
}
MODES = {
    "timm": "timm",
    "timm checkpointing": "timm + grad checkpointing",
    "timm compiled, memory budget": "timm",
    "odeify checkpoint": "odeify checkpoint",
    "odeify reversible ALF": "odeify reversible ALF",
    "odeify reversible Heun": "odeify reversible",
}
DEFAULT_MODES = [m for m in MODES if m != "timm compiled, memory budget"]
ODEIFY_MODES = [m for m in MODES if m.startswith("odeify")]


def child(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    device = torch.device(args.device)
    row: Row = ROWS[MODES[args.mode]]
    if args.checkpoint:
        model = as_row(load_model(args.checkpoint), row, args.steps, args.img_size).to(device)
    else:
        model = build(args.model, row, args.steps, "trained-like").to(device)
    classes = getattr(model, "num_classes", None) or CLASSES
    if args.mode == "timm compiled, memory budget":
        torch._functorch.config.activation_memory_budget = args.compile_budget
        model = torch.compile(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=g).to(device)
    labels = torch.randint(0, classes, (args.batch,), generator=g).to(device)

    def step() -> float:
        model.zero_grad(set_to_none=False)
        start = time.perf_counter()
        F.cross_entropy(model(x), labels).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    warnings.filterwarnings("ignore", "odeify: stage")
    step()
    if args.part == "time":  # a stepped child: timed steps on the parent's turns, then the tensor peak
        report_to_parent({"ready": True})
        times = []
        for _ in requests():
            times.append(step())
            report_to_parent({"wall": times[-1]})
        result = {"times": times, "tensor_peak": None, "breakdown": []}
        if args.mode != "timm compiled, memory budget":
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            with TensorPeak(before=[*model.parameters(), *model.buffers(), *grads, x, labels]) as peak:
                step()
            result["tensor_peak"] = peak.peak
            result["breakdown"] = peak.breakdown(8) if args.mode in ODEIFY_MODES else []
        report_to_parent(result)
        return
    if device.type == "cuda":
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        resident = torch.cuda.max_memory_allocated() - before
    else:
        before = rss("VmRSS")
        reset_peak_rss()
        step()
        resident = rss("VmHWM") - before
    report_to_parent({"resident": resident})


def child_arguments(model: str, mode: str, steps: str, args: argparse.Namespace) -> list[str]:
    batch = BATCHES[model] if args.batch is None else args.batch
    user = ["--checkpoint", args.checkpoint] if args.checkpoint else []
    return [
        "--model", model, "--mode", mode, "--steps", steps, "--batch", str(batch),
        "--device", args.device, "--compile-budget", str(args.compile_budget),
        "--img-size", str(args.img_size), *user,
    ]  # fmt: skip


def _last_line(error: Exception | str) -> str:
    return (str(error).strip().splitlines() or ["no output"])[-1][:200]


def measure_model(model: str, rows: list[tuple[str, str]], args: argparse.Namespace) -> list[dict]:
    """One model's rows: their time processes alive together, stepping in turns (a change of the
    machine's speed moves every row alike), each then counting its tensor peak; then each row's
    resident memory in a process of its own, with freed blocks handed back at once
    (``MALLOC_MMAP_THRESHOLD_``; not while timing: each large allocation would then cost fresh
    pages, which no user's process pays)."""
    results = {row: {"model": model, "mode": row[0], "steps": row[1]} for row in rows}
    children = {}
    for row in rows:
        try:
            arguments = [*child_arguments(model, *row, args), "--part", "time"]
            children[row] = SteppedChild(__file__, arguments, f"{model} / {row[0]} / {row[1]}")
        except RuntimeError as error:
            results[row]["error"] = _last_line(error)
    try:
        for _ in range(args.repeats):
            for row, child in list(children.items()):
                try:
                    child.step()
                except RuntimeError as error:
                    results[row]["error"] = _last_line(error)
                    children.pop(row)
        for row, child in list(children.items()):
            try:
                results[row].update(child.finish())
            except RuntimeError as error:
                results[row]["error"] = _last_line(error)
    finally:
        for child in children.values():
            child.kill()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for row in rows:
        if "error" in results[row]:
            continue
        command = [
            sys.executable,
            __file__,
            "--child",
            *child_arguments(model, *row, args),
            "--part",
            "memory",
        ]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            results[row]["error"] = _last_line(done.stderr)
        else:
            results[row].update(json.loads(lines[-1]))
    return list(results.values())


def ratio(value: float | None, base: float | None) -> str:
    return "" if value is None or not base else f"{value / base:.2f}x"


def rows_for(results: list[dict]) -> list[list[str]]:
    table = []
    for r in results:
        if "error" in r:
            table.append([r["model"], r["mode"], r["steps"], "failed: " + r["error"], "", "", "", ""])
            continue
        base = {
            (b["model"], b["mode"]): b
            for b in results
            if "error" not in b and b["mode"] in ("timm", "timm checkpointing")
        }
        plain, ckpt = base.get((r["model"], "timm")), base.get((r["model"], "timm checkpointing"))
        median = statistics.median(r["times"])
        spread = f"{min(r['times']):.2f}-{max(r['times']):.2f}"
        peak = r["tensor_peak"]
        table.append(
            [
                r["model"],
                r["mode"],
                r["steps"],
                "" if peak is None else f"{peak / MB:.0f}",
                ratio(peak, ckpt and ckpt["tensor_peak"]),
                f"{r['resident'] / MB:.0f}",
                f"{median:.2f} ({spread})",
                ratio(median, plain and statistics.median(plain["times"])),
            ]
        )
    return table


HEADER = [
    "model",
    "mode",
    "steps",
    "tensor peak MiB",
    "vs timm ckpt",
    "RSS / CUDA peak MiB",
    "step s (spread)",
    "vs timm plain",
]


def markdown(results: list[dict], argv: list[str], args: argparse.Namespace) -> str:
    models = dict.fromkeys(r["model"] for r in results)
    batch, size = args.batch, args.img_size
    weights = (
        f"the user's trained weights in {args.checkpoint}"
        if args.checkpoint
        else "random weights, every residual branch's last-norm gain scaled as a trained network's"
    )
    lines = [
        "# Peak memory of one training step",
        "",
        f"`{command_line(__file__, argv)}`",
        "",
        f"Machine: {describe_machine(args.device)}. Batch per model: "
        + ", ".join(f"{m} {BATCHES[m] if batch is None else batch}" for m in models)
        + f", {size}x{size}, fp32, {weights}; "
        + f"{results and len(results[0].get('times', [])) or 0} timed steps per row.",
        "",
        "Tensor peak: the most bytes of tensors alive at once during the step over those alive before "
        "(odeify.inspection.TensorPeak, deterministic); RSS peak: peak resident memory during the step "
        "over that before it (CUDA: max allocated). A model's rows step in turns, each in its own process; "
        "the RSS peak in another (MALLOC_MMAP_THRESHOLD_=65536).",
        "",
        *markdown_table(HEADER, rows_for(results)),
        "",
        "## What is alive at the peak (odeify rows)",
        "",
    ]
    for r in results:
        if r.get("breakdown"):
            lines.append(
                f"- {r['model']}, {r['mode']}, {r['steps']} steps: "
                + "; ".join(f"{n / MB:.1f} MiB {what}" for n, what in r["breakdown"][:6])
            )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for r in results:
            if r["model"] != model or "error" in r:
                continue
            y = (r["tensor_peak"] if r["tensor_peak"] is not None else r["resident"]) / MB
            ax.scatter(statistics.median(r["times"]), y)
            ax.annotate(f"{r['mode']} ({r['steps']})", (statistics.median(r["times"]), y), fontsize=7)
        ax.set_title(model)
        ax.set_xlabel("step time, s")
        ax.set_ylabel("peak MiB (tensor peak; compiled: RSS)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=list(BATCHES), help=f"timm names (default: {' '.join(BATCHES)})"
    )
    parser.add_argument(
        "--checkpoint",
        help="a user's trained model (timm train.py checkpoint, HF-style folder) instead of random "
        "trained-like weights; --models then names it (its architecture) and --batch is needed",
    )
    parser.add_argument("--img-size", type=int, default=SIZE, help="image side in pixels (default 224)")
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    parser.add_argument("--steps", nargs="+", default=["native"], help="native and/or x4 (odeify rows)")
    parser.add_argument("--batch", type=int, default=None, help="one batch for every model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile-budget", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=str(RESULTS / "peak_memory"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=["time", "memory"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.steps = args.steps[0]
        child(args)
        return 0
    unknown = [m for m in args.models if m not in BATCHES]
    if args.checkpoint and (len(args.models) != 1 or args.batch is None):
        parser.error("--checkpoint measures one model: give its architecture in --models and a --batch")
    if unknown and args.batch is None:
        parser.error(f"no batch known for {', '.join(unknown)}: pass --batch, or one of {', '.join(BATCHES)}")
    results = []
    for model in args.models:
        rows = [(m, steps) for m in args.modes for steps in (args.steps if m in ODEIFY_MODES else ["native"])]
        for result in measure_model(model, rows, args):
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "breakdown"}), flush=True)
    out = Path(args.out)
    raw_argv = sys.argv[1:] if argv is None else argv
    atomic_write_bytes(out.with_suffix(".md"), markdown(results, raw_argv, args).encode())
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(HEADER)
    writer.writerows(rows_for(results))
    atomic_write_bytes(out.with_suffix(".csv"), buffer.getvalue().encode())
    plot(results, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
