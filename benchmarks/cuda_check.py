"""Benchmark: odeify on a CUDA device: the lattice's bit-exact rebuild and whole-model step ratios.

The reversible backward rebuilds every state from the final one on a fixed-point lattice, which is
exact only if the field returns the same bits when it is re-run (``odeify.runtime.lattice``). CPU
kernels do; this script checks it where users fine-tune, on a GPU, in two parts, one process:

1. Exactness. Each reversible row (reversible Heun, ALF) of resnet50 and resnet152 at native and
   4x steps takes one fp32 training step (TF32 off) with deterministic kernels
   (``torch.use_deterministic_algorithms(True, warn_only=True)``, cuDNN benchmarking off) and once
   more with the defaults (cuDNN benchmarking on). Columns: the largest rebuild gap over the stages
   (0: every state rebuilt bit for bit), fallbacks out of passes, the gradients' relative error
   against backprop of the same manifestation, and against float64 backprop (the exact gradient)
   beside fp32 backprop's own error against it. Weights: ``train_step.py --weights trained-like``.
2. Speed and memory. step_ratios.py's interleaved rounds on the device: every row built in the
   process, each round steps every row once (synchronised), a row's wall time over timm plain's in
   the same round, median and spread; and each row's peak memory allocated during a step beyond
   what was allocated before it (activations and workspaces), over timm plain's. Default settings
   (TF32 convolutions as PyTorch ships them).

Sections are written to the results file as they finish, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode; before CUDA init

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from machine import command_line, write_results  # noqa: E402
from tables import markdown_table  # noqa: E402
from train_step import CLASSES, MODEL_CHOICES, ROWS, SIZE, VIT, build, relative_error  # noqa: E402

import odeify  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
EXACT_MODELS = ["resnet50", "resnet152"]
EXACT_ROWS = ["odeify reversible", "odeify reversible ALF"]
RESNET_ROWS = ["timm", "timm + grad checkpointing", "odeify checkpoint", *EXACT_ROWS]
RATIO_RUNS = ["resnet50:native", "resnet50:x4", "resnet152:native", f"{VIT}:native"]
EXACT_HEADERS = (
    "model",
    "row",
    "steps",
    "kernels",
    "largest rebuild gap",
    "fallbacks / passes",
    "grad err vs backprop",
    "vs fp64",
    "fp32 backprop vs fp64",
)
RATIO_HEADERS = (
    "model",
    "row",
    "steps",
    "wall time vs timm",
    "spread",
    "peak memory vs timm",
    "timm step ms",
)


def inputs(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, SIZE, SIZE, generator=g)
    return x.to(device), torch.randint(0, CLASSES, (batch,), generator=g).to(device)


def train_step(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), labels).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def set_kernels(deterministic: bool) -> None:
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic


def exactness_row(model_name: str, row: str, steps: str, deterministic: bool, batch: int, device) -> tuple:
    """One training step of a reversible row: rebuild gaps, fallbacks, gradient errors."""
    set_kernels(deterministic)
    model = build(model_name, ROWS[row], steps, "trained-like").to(device)
    x, labels = inputs(batch, device)
    got = train_step(model, x, labels)
    stages = odeify.converted_stages(model)
    gap = max(max(s.adjoint_stats.last_errors, default=0.0) for s in stages)
    fallbacks = sum(s.adjoint_stats.fallbacks for s in stages)
    passes = sum(s.adjoint_stats.backward_passes for s in stages)
    odeify.set_backward(model, "backprop")
    want = train_step(model, x, labels)
    model.double()
    truth = train_step(model, x.double(), labels)
    return (
        model_name,
        row,
        steps,
        "deterministic" if deterministic else "default",
        f"{gap:.1e}" if gap else "0 (bit for bit)",
        f"{fallbacks} / {passes}",
        f"{relative_error(got, want):.1e}",
        f"{relative_error(got, truth):.1e}",
        f"{relative_error(want, truth):.1e}",
    )


def ratio_rows(model_name: str, steps: str, rounds: int, batch: int, device) -> list[tuple]:
    """Interleaved steps of every row of one model: wall-time and peak-memory ratios to timm plain."""
    set_kernels(False)
    names = RESNET_ROWS
    models = {row: build(model_name, ROWS[row], steps, "trained-like").to(device) for row in names}
    x, labels = inputs(batch, device)

    def step(model: torch.nn.Module) -> tuple[float, int]:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        F.cross_entropy(model(x), labels).backward()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start, torch.cuda.max_memory_allocated(device) - before

    for model in models.values():  # warm-up: kernels chosen, graphs built, gradients allocated
        step(model), step(model)
    times: dict[str, list[float]] = {row: [] for row in names}
    peaks: dict[str, int] = {}
    for _ in range(rounds):
        for row, model in models.items():
            seconds, peaks[row] = step(model)
            times[row].append(seconds)
    base = times["timm"]
    table = []
    for row in names:
        ratios = [t / b for t, b in zip(times[row], base, strict=True)]
        table.append(
            (
                model_name,
                row,
                steps if ROWS[row].integrator else "-",
                f"{statistics.median(ratios):.2f}x",
                f"{min(ratios):.2f}..{max(ratios):.2f}",
                f"{peaks[row] / peaks['timm']:.2f}x ({peaks[row] / 2**20:.0f} MiB)",
                f"{1e3 * statistics.median(base):.0f}",
            )
        )
    print(f"  {model_name} {steps}: {len(names)} rows, {rounds} rounds", file=sys.stderr, flush=True)
    return table


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def guarded(what: str, job: Callable[[], list[tuple]], failures: list[str]) -> list[tuple]:
    """Run one measurement; on an error record it (the run goes on with the next)."""
    try:
        return job()
    except Exception as error:  # noqa: BLE001 - a device run reports every failure rather than stopping
        failures.append(f"- {what}: {type(error).__name__}: {error}")
        print(failures[-1], file=sys.stderr, flush=True)
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    parser.add_argument("--exact-batch", type=int, default=8, help="batch of the exactness part")
    parser.add_argument("--batch", type=int, default=64, help="batch of the speed and memory part")
    parser.add_argument("--rounds", type=int, default=10, help="rounds: every row steps once per round")
    parser.add_argument(
        "--exact-models",
        nargs="*",
        choices=MODEL_CHOICES,
        default=EXACT_MODELS,
        help="models checked",
    )
    parser.add_argument(
        "--ratio-runs",
        nargs="*",
        default=RATIO_RUNS,
        metavar="MODEL:STEPS",
        help="models timed",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "cuda_check.md", help="Markdown record")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if not is_cuda(device):
        parser.error(f"--device {args.device}: this script measures a CUDA device, and none is available")
    warnings.filterwarnings("ignore", "odeify: stage", RuntimeWarning)  # fallbacks are counted
    warnings.filterwarnings("ignore", ".*does not have a deterministic implementation.*", UserWarning)
    torch.backends.cuda.matmul.allow_tf32 = False
    tf32_convolutions = torch.backends.cudnn.allow_tf32
    failures: list[str] = []
    exact: list[tuple] = []
    ratios: list[tuple] = []
    gpu = torch.cuda.get_device_name(device)

    def write() -> None:
        lines = [
            "# odeify on a CUDA device: the lattice's exact rebuild and whole-model step ratios",
            "",
            f"Device: {gpu}, CUDA {torch.version.cuda}, torch {torch.__version__}, Python "
            f"{sys.version.split()[0]}. Models: random timm weights with every residual branch's last-norm",
            "gain scaled by 0.2 (train_step.py's `--weights trained-like`), fp32, 224x224.",
            "",
            f"## Exactness (batch {args.exact_batch}, TF32 off)",
            "",
            "A rebuild gap of 0 means the reversible backward rebuilt every stage's initial states bit for",
            "bit from the final ones; 'deterministic' is `torch.use_deterministic_algorithms(True,",
            "warn_only=True)` with cuDNN benchmarking off, 'default' PyTorch's settings with",
            "benchmarking on.",
            "",
            *markdown_table(EXACT_HEADERS, exact, text_columns=4),
            "",
            f"## Training-step time and memory against timm plain (batch {args.batch}, {args.rounds} rounds)",
            "",
            "Interleaved rounds; wall time with the device synchronised around each step; peak memory is",
            "the most allocated during a step beyond what was allocated before it. TF32 convolutions",
            f"{'on' if tf32_convolutions else 'off'} (PyTorch's default), TF32 matmuls off.",
            "",
            *markdown_table(RATIO_HEADERS, ratios, text_columns=3),
            "",
            *(["## Failures", "", *failures, ""] if failures else []),
            f"Command: `{command_line(__file__, argv)}`",
            "",
        ]
        write_results(args.output, "\n".join(lines))

    started = time.perf_counter()
    torch.backends.cudnn.allow_tf32 = False
    for deterministic in (True, False):
        for model_name in args.exact_models:
            for row in EXACT_ROWS:
                for steps in ("native", "x4"):
                    what = f"exactness {model_name} {row} {steps} {'det' if deterministic else 'default'}"
                    exact += guarded(
                        what,
                        lambda m=model_name, r=row, s=steps, d=deterministic: [
                            exactness_row(m, r, s, d, args.exact_batch, device)
                        ],
                        failures,
                    )
                    print(f"  {what} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        write()
    torch.backends.cudnn.allow_tf32 = tf32_convolutions
    for model_name, _, steps in (run.partition(":") for run in args.ratio_runs):
        what = f"ratios {model_name} {steps}"
        ratios += guarded(
            what, lambda m=model_name, s=steps: ratio_rows(m, s, args.rounds, args.batch, device), failures
        )
        print(f"  {what} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        write()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
