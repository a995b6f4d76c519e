"""A benchmark's results file: the machine it ran on, the command that ran it, and writing it.

One place for all benchmark scripts.
"""

from __future__ import annotations

import io
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from odeify.core.fileio import atomic_write_bytes


def machine_info() -> dict[str, str]:
    """nproc, CPU model, torch's CPU kernels, torch version and threads, Python version and the load
    average. The kernels (``torch.backends.cpu.get_cpu_capability()``: AVX2, AVX512, ...) are named
    because float32 results, and the weights a training run ends with, depend on them."""
    cpu = platform.processor() or "unknown"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        cpu = models[0] if models else cpu
    except OSError:
        pass
    return {
        "nproc": str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
        "cpu": cpu,
        "kernels": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a",
    }


def describe_machine(device: str = "cpu", with_load: bool = True) -> str:
    """One sentence: CPUs (and GPU when ``device`` is cuda), torch, threads, Python, load."""
    info = machine_info()
    gpu = f", GPU {torch.cuda.get_device_name()}" if device == "cuda" else ""
    text = (
        f"{info['nproc']} CPUs (nproc; {info['cpu']}, {info['kernels']} kernels){gpu}, torch {info['torch']} "
        f"with {info['threads']} threads, Python {info['python']}"
    )
    return f"{text}; load average (1, 5, 15 min) at the end: {info['load']}" if with_load else text


def command_line(script: str, argv: list[str] | None = None) -> str:
    """How to rerun a benchmark: ``python benchmarks/<script's name>`` and its arguments, shell-quoted.

    ``script`` is the benchmark's ``__file__``; ``argv`` None means the process's own arguments.
    """
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"benchmarks/{Path(script).name}", *map(shlex.quote, args)])


def provenance(command: str, machine: str | None = None) -> list[str]:
    """A results file's closing lines: the command that wrote it and the machine it ran on
    (``machine``, or :func:`describe_machine`'s sentence for the CPU)."""
    return [f"Command: `{command}`", "", f"Machine: {machine or describe_machine()}.", ""]


def save_figure(fig: object, path: Path, dpi: int = 110) -> None:
    """Lay out a matplotlib figure and write it as a PNG atomically, as :func:`write_results` writes
    the results file beside it (a failed run leaves the previous picture intact)."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())


def write_results(path: Path, text: str) -> None:
    """Write a results file atomically (a failed run leaves the previous one intact) and say so."""
    atomic_write_bytes(path, text.encode())
    print(f"wrote {path}", file=sys.stderr)
