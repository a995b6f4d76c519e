"""Benchmark: calibration at a real image size, its peak memory and the time outside its fit.

resnet50 from timm with random weights (``make_test_model``: every residual branch does something,
its last-norm gains scaled as a trained network's, ``train_step.py --weights trained-like``),
converted and retargeted to half its steps, calibrated with ``odeify.calibrate``'s defaults (50 Adam
steps per stage unless ``--iterations`` says otherwise, batches of 64, the output objective) on
``--images`` synthetic random images at ``--size``: the images' content does not change what is
held or how long a pass takes.

Each row runs in a fresh process (a source tree given by ``--before`` imports that tree's odeify:
the same script measures the code before a change), and reports

- the conversion's peak resident memory (``VmHWM`` after converting), and calibration's: the peak
  during ``odeify.calibrate`` alone (``VmHWM`` restarted before it) and the process's over both;
- the calibration's wall time, the time in its stages' fits (``StageFit.seconds`` summed: each
  stage's residuals before and after and its Adam steps), and the time outside them (reading the
  images, the copies of the model, the passes that take the activations).

Writes benchmarks/results/calibration_memory.md and .csv.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HERE = Path(__file__).resolve().parent
MIB = 2**20
HEADER = [
    "code", "images", "size", "conversion peak MiB", "calibration peak MiB", "process peak MiB",
    "calibration s", "fit s", "outside fit s", "outside / fit", "mean residual after",
]  # fmt: skip


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(args: argparse.Namespace) -> None:
    """One row, in this process: build, convert, calibrate; one JSON line on stdout."""
    import torch
    from train_step import TRAINED_LIKE_BRANCH_SCALE, _weaken_branches

    import odeify
    from odeify.models._testing import make_test_model

    warnings.filterwarnings("ignore")
    model = make_test_model("resnet50")
    _weaken_branches(model, TRAINED_LIKE_BRANCH_SCALE)
    converted = odeify.convert(model, input_size=(1, 3, args.size, args.size))
    half = odeify.retarget(converted, steps="x0.5")
    del model
    x = torch.randn(args.images, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    conversion_peak = _status("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # restart VmHWM here: calibration's own peak
    started = time.perf_counter()
    _, report = odeify.calibrate(half, x, seed=0, iterations=args.iterations, progress=False)
    seconds = time.perf_counter() - started
    calibration_peak = _status("VmHWM")
    fit = sum(stage.seconds for stage in report.stages)
    after = [stage.after for stage in report.stages if stage.after is not None]
    print(json.dumps({
        "conversion_peak": conversion_peak / MIB,
        "calibration_peak": calibration_peak / MIB,
        "process_peak": max(conversion_peak, calibration_peak) / MIB,
        "seconds": seconds,
        "fit": fit,
        "outside": seconds - fit,
        "residual": sum(after) / len(after),
        "report": str(report),
    }), flush=True)  # fmt: skip


def _commit(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return out.stdout.strip() + (" + uncommitted changes" if dirty else "")


def measure(tree: Path | None, args: argparse.Namespace) -> dict:
    """A row in a fresh process, importing odeify from ``tree`` (None: the installed one)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), str(HERE)])
    command = [sys.executable, __file__, "--child", "--images", str(args.images), "--size", str(args.size),
               "--iterations", str(args.iterations)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE)
    if done.returncode != 0:
        raise RuntimeError(f"the row failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    code = _commit(tree or HERE.parent)
    row["code"] = f"before ({code})" if tree is not None else f"this tree ({code})"
    return row


def csv_rows(rows: list[dict], args: argparse.Namespace) -> list[list[str]]:
    return [
        [
            r["code"],
            str(args.images),
            str(args.size),
            f"{r['conversion_peak']:.0f}",
            f"{r['calibration_peak']:.0f}",
            f"{r['process_peak']:.0f}",
            f"{r['seconds']:.1f}",
            f"{r['fit']:.1f}",
            f"{r['outside']:.1f}",
            f"{r['outside'] / r['fit']:.2f}",
            f"{r['residual']:.4f}",
        ]  # fmt: skip
        for r in rows
    ]


def markdown(rows: list[dict], args: argparse.Namespace, argv: list[str]) -> str:
    from machine import command_line
    from tables import results_document

    prose = [
        "# Calibration at a real image size: peak memory and the time outside the fit",
        "",
        f"resnet50 (timm, random weights, residual branches at a trained network's strength), converted and "
        f"retargeted to half its steps, `odeify.calibrate` with its defaults on {args.images} synthetic "
        f"images at {args.size}x{args.size}; each row in a fresh process. Peaks are resident memory "
        "(`VmHWM`): the conversion's, calibration's own (restarted before it) and the process's. The fit "
        "is the stages' `StageFit.seconds` summed; outside it: reading the images, copies of the model "
        "and the passes that take the activations. The machine's 2 cores were shared with the other "
        "engineers' jobs (see the load average): times move between runs, the peaks do not.",
    ]
    after = ["Calibration reports:", ""]
    for row in rows:
        after += [f"{row['code']}:", "", "```", row["report"], "```", ""]
    return results_document(
        prose, HEADER, csv_rows(rows, args), command_line(__file__, argv), text_columns=1, after=after
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument(
        "--iterations", type=int, default=50, help="Adam steps per stage (calibrate's default)"
    )
    parser.add_argument("--before", type=Path, help="a source tree of the code before a change: a row for it")
    parser.add_argument("--out", default=str(RESULTS / "calibration_memory"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    rows = []
    for tree in [args.before, None] if args.before else [None]:
        rows.append(measure(tree, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "report"}), flush=True)
    from odeify.core.fileio import atomic_write_bytes

    out = Path(args.out)
    raw = sys.argv[1:] if argv is None else argv
    atomic_write_bytes(out.with_suffix(".md"), markdown(rows, args, raw).encode())
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(HEADER)
    writer.writerows(csv_rows(rows, args))
    atomic_write_bytes(out.with_suffix(".csv"), buffer.getvalue().encode())
    print(f"wrote {out.with_suffix('.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
