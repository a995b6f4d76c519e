"""Benchmark: the timm zoo sweep, what odeify does with every family of timm models.

The models: the smallest model (fewest parameters, counted on the meta device) of every timm model
module (``timm.list_modules()``; a family here is a module), plus :data:`COMMON` (the names users
try first); ``--models`` restricts the sweep to a list. Each model runs in a fresh Python process with
a wall-time limit (``--timeout``) and a resident-memory limit (``--memory-gib``, watched by the
parent; a single allocation far past it is refused by an address-space limit in the child), so a
model that hangs, dies or grows past the limit is one row of the results, never the end of the sweep.

Per model, in the child (random weights from ``make_test_model``, seed 0, eval mode, batch 1 at the
model's default input size from timm's pretrained cfg unless ``--img-size``, one seeded input), each
phase timed, and each phase's exception caught so that the others still report:

- build: the test model; trace: the residual adds of the fx trace (adds of two tensors of the
  sum's shape, both computed from the input); analyze: ``odeify.analyze``'s blocks and runs;
- convert: ``odeify.convert`` with its own verification (fp32); the outcome is ``converted``,
  ``refused`` (an OdeifyError: class and first line) or ``traceback`` (any other exception). A
  VerificationError is recorded and the model converted again with ``verify=False``, to measure it;
- fp32 / fp64: the converted model's max-abs difference from the eager source, relative to the
  output's scale (max |out|) and to the source's own fp32 round-off (the fp32 source's max-abs
  distance from its float64 copy on the same input); fp64 converts the float64 copy;
- retarget: ``odeify.retarget(steps="x0.5")`` and a forward; save: ``odeify.save`` then
  ``odeify.load`` and the loaded model's output against the saved one's.

The fp64 conversion runs last, after the float32 models are gone (the source turned into float64 in
place; each dropped converted model collected at once, a GraphModule and its graph being a reference
cycle), so that the child holds about as much as one convert does: a 412M-parameter ViT fits 8 GiB.

``--out OUT`` writes OUT.csv, OUT.md and OUT_models.json (the zoo's choice, kept for the timm version
that made it: choosing builds every timm model on meta, minutes). The parent appends each row to the
CSV as it comes (an interrupted sweep keeps what it measured; ``--resume`` skips the models already
there) and rewrites the Markdown summary after each model.

    python benchmarks/zoo.py --list
    python benchmarks/zoo.py --models resnet18,vit_small_patch16_224 --out /tmp/zoo_try
    python benchmarks/zoo.py                       # the whole zoo: 1-2 hours on 2 cores
    python benchmarks/zoo.py --resume              # go on with an interrupted sweep
    python benchmarks/zoo.py --models qwen3_vit_88m --replace   # sweep again, replace its row
    python benchmarks/zoo.py --readme-table        # the README's family table, from the CSV
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime
import gc
import io
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import timm
import torch
from machine import command_line, describe_machine, write_results
from tables import bullets, markdown_table

import odeify
from odeify.compiler.analysis import trace_and_annotate
from odeify.compiler.conversion import converted_stages
from odeify.compiler.verification import VerificationError
from odeify.core.errors import OdeifyError
from odeify.core.fileio import atomic_write_bytes
from odeify.ir.plan import Run
from odeify.models._testing import make_test_model
from odeify.models.timm_interface import default_input_size
from odeify.passes.graph_utils import data_nodes, is_add_join
from odeify.passes.tracing import node_shape

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "zoo"
COMMON = (
    "resnet18", "resnet50", "resnetv2_50", "seresnext26d_32x4d", "convnext_tiny", "efficientnet_b0",
    "mobilenetv3_large_100", "regnety_016", "vit_small_patch16_224", "deit_tiny_patch16_224",
    "swin_tiny_patch4_window7_224", "eva02_small_patch14_224", "vit_small_patch16_dinov3",
    "resmlp_12_224", "mixer_b16_224", "poolformer_s12", "edgenext_small", "levit_128",
    "coat_lite_tiny", "efficientformer_l1", "maxvit_tiny_tf_224",
)  # fmt: skip
"""The names users try first, swept beside each module's smallest model."""
FALSE_ALARM = 1e-9
"""A VerificationError is false when the float64 conversion agrees with the source to this (relative)."""
GIB = 2**30
IMPORT_HEADROOM_GIB = 8
"""The child's address-space limit is ``--memory-gib`` plus this: importing torch alone reserves about
3.7 GiB of address space (3 GiB fails to import it), most of it never resident."""
POLL_S = 0.2
"""Seconds between the parent's looks at a child's resident memory and time."""
MEMORY_MESSAGES = ("can't allocate memory", "Cannot allocate memory", "MemoryError")
"""What torch's CPU allocator, the system (errno 12) and Python say when an allocation is refused."""
PHASES = ("build", "trace", "analyze", "convert", "fp32", "fp64", "retarget", "save")
FIELDS = [
    "model", "family", "params_m", "input_size", "outcome", "phase", "error", "stage_depths", "stages",
    "deepest", "blocks", "runs", "not_lifted", "residual_adds", "adds_in_stages", "verify",
    "verify_rel", "fp32_rel", "fp32_vs_roundoff", "fp64_rel", "roundoff_rel", "retarget", "save_load",
    "phase_errors", "peak_rss_mib", "seconds", *(f"t_{phase}" for phase in PHASES),
]  # fmt: skip
"""The CSV's columns: docs in :func:`markdown`'s prose."""
OUTCOMES = ("converted", "refused", "traceback", "timeout", "memory", "died")

Row = dict[str, Any]


# ---------------------------------------------------------------------------------------------------
# The model list


def families() -> dict[str, str]:
    """Every timm model name: its module (the family)."""
    return {name: module for module in timm.list_modules() for name in timm.list_models(module=module)}


def count_on_meta(name: str) -> int:
    """The parameters of timm model ``name``, built on the meta device (no memory, no init)."""
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = timm.create_model(name)
    return sum(p.numel() for p in model.parameters())


def zoo_models(cache: Path | None = None) -> tuple[list[tuple[str, str, int | None]], dict[str, str]]:
    """The sweep's models as (name, family, parameters), and the names that failed to build on meta
    with why: each module's smallest model, then :data:`COMMON`.

    Building every timm model on meta takes minutes: the choice is kept in ``cache`` (JSON, with
    the timm version it was made with) and read from there while timm's version is the same.
    """
    if cache is not None and cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("timm") == timm.__version__:
            return [tuple(m) for m in saved["models"]], saved["skipped"]
    chosen: dict[str, tuple[str, str, int]] = {}
    sizes: dict[str, int] = {}
    skipped: dict[str, str] = {}
    modules = timm.list_modules()
    for i, module in enumerate(modules):
        print(f"choosing models: {module} ({i + 1}/{len(modules)})", file=sys.stderr, flush=True)
        for name in timm.list_models(module=module):
            try:
                sizes[name] = count_on_meta(name)
            except Exception as exc:  # any failure to build is a name to skip, with its reason
                skipped[name] = first_line(exc)
                continue
            if module not in chosen or sizes[name] < chosen[module][2]:
                chosen[module] = (name, module, sizes[name])
    family = families()
    models = list(chosen.values())
    for name in COMMON:
        if name not in {m[0] for m in models}:
            models.append((name, family.get(name, "?"), sizes.get(name)))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(
            json.dumps({"timm": timm.__version__, "models": models, "skipped": skipped}, indent=1)
        )
    return models, skipped


def params_or_none(name: str) -> int | None:
    """:func:`count_on_meta`, None where the name does not build (its child will say why)."""
    try:
        return count_on_meta(name)
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------------
# The child: one model, phase by phase


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def is_memory_error(exc: BaseException) -> bool:
    """Python's MemoryError, or torch's CPU allocator or the system refusing (the address-space limit)."""
    return isinstance(exc, MemoryError) or any(s in str(exc) for s in MEMORY_MESSAGES)


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (VmHWM), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def relative(diff: float, scale: float) -> float | None:
    """``diff / scale``; None for a zero scale."""
    return diff / scale if scale > 0 else None


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, computed in float64."""
    return (a.double() - b.double()).abs().max().item()


def build(name: str, img_size: int | None) -> torch.nn.Module:
    """The test model (seed 0); with ``img_size``, built for that size where its constructor takes one
    (a ViT's position embedding fixes its size; a ResNet's constructor has no img_size, any size fits)."""
    if img_size is not None:
        try:
            return make_test_model(name, seed=0, img_size=img_size)
        except Exception as exc:
            if "img_size" not in f"{exc} {exc.__cause__}":
                raise
    return make_test_model(name, seed=0)


def residual_adds(model: torch.nn.Module, shape: tuple[int, ...]) -> set[str]:
    """The names of the adds in the fx trace of two tensors of the sum's shape, both computed from the
    input: the graph ``odeify.analyze`` reads (traced, shapes, a residual on part of a stream made
    whole), so its blocks name the same nodes."""
    gm = trace_and_annotate(model, shape)
    data = data_nodes(gm.graph)
    found = set()
    for node in gm.graph.nodes:
        if node.name not in data or not is_add_join(node):
            continue
        shapes = {node_shape(arg) for arg in node.args}
        if all(arg.name in data for arg in node.args) and shapes == {node_shape(node)} and None not in shapes:
            found.add(node.name)
    return found


def adds_inside(adds: set[str], runs: Sequence[Run]) -> int:
    """How many of ``adds`` lie in the runs' blocks: their joins, and adds inside their branches (a
    rotary embedding's ``q * cos + rotate(q) * sin``), which a stage integrates with its block."""
    nodes = {name for run in runs for block in run.blocks for name in (*block.nodes, block.join)}
    return len(adds & nodes)


class Child:
    """One model's measurements: a row that grows phase by phase, reported to the parent after each."""

    def __init__(self, report: Callable[[Row], None]) -> None:
        self.row: Row = {"phase": "", "error": "", "phase_errors": ""}
        self.report = report

    @contextmanager
    def phase(self, name: str, errors: str = "phase_errors") -> Iterator[None]:
        """Time phase ``name`` into ``t_<name>`` and catch its exception, recorded in column ``errors``.

        ``errors="error"``: the phase decides the outcome (build, convert): a failure is ``refused``
        (an OdeifyError of convert) or ``traceback``. A memory error is the outcome ``memory`` and
        ends the model (raised on)."""
        self.row["phase"] = name
        self.report(self.row)
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:
            if is_memory_error(exc):
                self.row.update(outcome="memory", error=f"{name}: {first_line(exc)}")
                raise
            refused = isinstance(exc, OdeifyError)
            note = first_line(exc) if refused else f"{first_line(exc)} [{where(exc)}]"
            if errors == "error":
                self.row["outcome"] = "refused" if refused and name == "convert" else "traceback"
            if errors == "phase_errors":
                note = f"{name}: {note}"
            self.row[errors] = "; ".join(filter(None, [self.row.get(errors, ""), note]))
        finally:
            self.row[f"t_{name}"] = round(time.perf_counter() - start, 3)
            self.row["peak_rss_mib"] = round(peak_rss_mib())

    def run(self, name: str, img_size: int | None) -> Row:
        """Every phase on timm model ``name``; the row (also reported after each phase). ``phase``
        stays the phase that ran out of memory, else it is emptied."""
        try:
            self._measure(name, img_size)
        except Exception as exc:
            if not is_memory_error(exc):
                raise
        if self.row.get("outcome") != "memory":
            self.row["phase"] = ""
        self.report(self.row)
        return self.row

    def _measure(self, name: str, img_size: int | None) -> None:
        row = self.row
        with self.phase("build", errors="error"):
            model = build(name, img_size)
            shape = default_input_size(model)
            if img_size is not None:
                shape = (*shape[:2], img_size, img_size)
            row["input_size"] = "x".join(map(str, shape[1:]))
            x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        if row.get("outcome"):
            return
        adds: set[str] = set()
        with self.phase("trace"):
            adds = residual_adds(model, shape)
            row["residual_adds"] = len(adds)
        plan = None
        with self.phase("analyze"):
            plan = odeify.analyze(model, input_size=shape)
            row["blocks"] = len(plan.blocks)
            row["runs"] = " ".join(
                f"{r.length}x{r.period}" if r.period > 1 else str(r.length) for r in plan.runs
            )
        with self.phase("convert", errors="error"):
            converted = self._convert(model, shape, plan, adds)
        if row.get("outcome") != "converted":
            return
        with self.phase("fp32"):
            with torch.no_grad():
                source_out, converted_out = model(x), converted(x)
                source64 = copy.deepcopy(model).double()(x.double())  # the copy goes at once: memory
            scale = source_out.abs().max().item()
            roundoff = max_abs(source_out, source64)
            diff = max_abs(converted_out, source_out)
            row["fp32_rel"] = relative(diff, scale)
            row["roundoff_rel"] = relative(roundoff, scale)
            row["fp32_vs_roundoff"] = relative(diff, roundoff)
        if "fp32_rel" not in row:
            return
        with self.phase("retarget", errors="retarget"):
            half = odeify.retarget(converted, steps="x0.5")
            with torch.no_grad():
                half(x)
            row["retarget"] = "ok"
            del half
            gc.collect()  # a GraphModule and its graph refer to each other: only the collector frees them
        with tempfile.TemporaryDirectory() as folder, self.phase("save", errors="save_load"):
            path = Path(folder) / "model.safetensors"
            try:
                odeify.save(converted, path)
            finally:  # its output is kept: one model fewer while the loaded one is checked and in fp64
                del converted
                gc.collect()
            loaded = odeify.load(path)
            with torch.no_grad():
                loaded_out = loaded(x)
            del loaded
            gc.collect()
            diff = max_abs(loaded_out, converted_out)
            row["save_load"] = (
                "ok" if torch.equal(loaded_out, converted_out) or diff <= roundoff else f"{diff:.1e}"
            )
        row["save_load"] = row["save_load"].replace(folder, "<folder>")  # the same text in every run
        with self.phase("fp64"):
            model64 = model.double()  # in place: the float32 source is not needed after this phase
            converted64 = odeify.convert(model64, input_size=shape, verify=False)
            with torch.no_grad():
                row["fp64_rel"] = relative(max_abs(converted64(x.double()), source64), scale)

    def _convert(
        self, model: torch.nn.Module, shape: tuple[int, ...], plan: Any, adds: set[str]
    ) -> torch.nn.Module:
        """convert with its verification (a VerificationError recorded, then convert unverified);
        the stages, their depths and the residual adds inside them."""
        row = self.row
        try:
            converted = odeify.convert(model, input_size=shape)
            check = converted.meta["odeify"]["verification"]
            row["verify"] = "passed" if check is not None else "skipped"
        except VerificationError as exc:
            row["verify"], check = "raised", exc.verification
            converted = odeify.convert(model, input_size=shape, verify=False)
        row["verify_rel"] = check.relative_error if check is not None else None
        row["outcome"] = "converted"
        stages = converted_stages(converted)
        depths = [stage.depth for stage in stages]
        row.update(
            stage_depths=",".join(map(str, depths)), stages=len(stages), deepest=max(depths, default=0)
        )
        not_lifted = converted.meta["odeify"]["not_lifted"]
        row["not_lifted"] = "; ".join(f"{run}: {why}" for run, why in not_lifted.items())
        if plan is not None:
            lifted = {stage.stage_name for stage in stages}
            row["adds_in_stages"] = adds_inside(adds, [run for run in plan.runs if run.name in lifted])
        return converted


def where(exc: BaseException) -> str:
    """The innermost frame of a traceback inside odeify (file:line), else the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/odeify/" in f.filename or "/passes/" in f.filename] or frames
    return f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""


def child_main(args: argparse.Namespace) -> None:
    """In the child process: measure ``args.model`` and report the row after each phase."""
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # models' and odeify's warnings would flood a sweep's log
    Child(report_to_parent).run(args.model, args.img_size)


def report_to_parent(row: Row) -> None:
    print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------------
# The parent: one child per model, watched


def child_command(name: str, args: argparse.Namespace) -> list[str]:
    """The command that measures ``name`` in a fresh Python."""
    flags = ["--threads", str(args.threads)] if args.threads else []
    size = ["--img-size", str(args.img_size)] if args.img_size else []
    return [sys.executable, __file__, "--child", "--model", name, *size, *flags]


def resident_mib(pid: int) -> float:
    """A process's resident memory now (VmRSS), MiB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def address_space_limit(memory_gib: float) -> Callable[[], None]:
    """For Popen's preexec_fn: the child's address space capped at ``memory_gib`` plus
    :data:`IMPORT_HEADROOM_GIB`, so a single allocation far past the limit is refused at once."""
    limit = int((memory_gib + IMPORT_HEADROOM_GIB) * GIB)

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def watch(process: subprocess.Popen, deadline: float, memory_mib: float) -> tuple[str, float]:
    """Wait for ``process`` to end, looking at its resident memory every :data:`POLL_S` seconds; the
    limit it passed (``timeout`` past ``deadline`` on the perf_counter clock, ``memory`` past
    ``memory_mib`` resident; "" when it ended on its own) and its largest resident memory seen (MiB)."""
    peak = 0.0
    while process.poll() is None:
        peak = max(peak, resident_mib(process.pid))
        if peak > memory_mib:
            return "memory", peak
        if time.perf_counter() > deadline:
            return "timeout", peak
        try:
            process.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
    return "", peak


def run_model(command: list[str], timeout: float, memory_gib: float) -> Row:
    """Run one child to its end, its time-out or its memory limit; the last row it reported, with
    its outcome (``timeout`` / ``memory`` / ``died`` when it did not finish) and its wall time."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            command, stdout=out, stderr=err, text=True, preexec_fn=address_space_limit(memory_gib)
        )
        try:
            killed, peak = watch(process, start + timeout, memory_gib * 1024)
        finally:  # the parent stopped (Ctrl-C) or a limit passed: the child goes too
            if process.poll() is None:
                process.kill()
                process.wait()
        out.seek(0)
        err.seek(0)
        reports = [line for line in out.read().splitlines() if line.startswith("{")]
        stderr = err.read()
    row: Row = json.loads(reports[-1]) if reports else {"phase": "start"}
    row["seconds"] = round(time.perf_counter() - start, 1)
    row["peak_rss_mib"] = round(max(peak, float(row.get("peak_rss_mib") or 0)))
    if killed == "timeout":
        row.update(outcome="timeout", error=f"past {timeout:g} s in {row['phase']}")
    elif killed == "memory":
        row.update(outcome="memory", error=f"past {memory_gib:g} GiB resident in {row['phase']}")
    elif process.returncode != 0:
        tail = (stderr.strip().splitlines() or ["no output"])[-1][:200]
        memory = any(message in stderr for message in MEMORY_MESSAGES)
        row.update(
            outcome="memory" if memory else "died",
            error=f"exit {process.returncode} in {row['phase']}: {tail}",
        )
    elif "outcome" not in row:
        row.update(outcome="died", error="the child ended without a result")
    return row


# ---------------------------------------------------------------------------------------------------
# The results: CSV rows, the Markdown summary, the README's table


def csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def append_row(path: Path, row: Row) -> None:
    """Append one row to the CSV (its header first when the file is new), flushed to disk."""
    new = not path.is_file() or path.stat().st_size == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({key: csv_value(row.get(key)) for key in FIELDS})
        f.flush()
        os.fsync(f.fileno())


def read_rows(path: Path) -> list[Row]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def number(row: Row, key: str) -> float | None:
    try:
        return float(row.get(key) or "")
    except ValueError:
        return None


def sci(row: Row, key: str, digits: int = 1) -> str:
    value = number(row, key)
    return "" if value is None else f"{value:.{digits}e}"


def false_alarm(row: Row) -> bool:
    """convert's verification raised while the float64 conversion agrees with the source."""
    fp64 = number(row, "fp64_rel")
    return row.get("verify") == "raised" and fp64 is not None and fp64 <= FALSE_ALARM


def staged(row: Row) -> bool:
    """A converted model with at least one ODE stage (convert may lift no run and still return)."""
    return row["outcome"] == "converted" and (number(row, "stages") or 0) > 0


def counted(rows: list[Row], key: str) -> int:
    """The sum of a count column over ``rows``."""
    return sum(int(number(r, key) or 0) for r in rows)


def share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "n/a"


def failures(rows: list[Row], key: str) -> str:
    """``n of m`` rows whose ``key`` is not ``ok``, with each failure's model and figure or error."""
    tried = [r for r in rows if r.get(key)]
    failed = [f"{r['model']} ({r[key]})" for r in tried if r[key] != "ok"]
    return f"{len(failed)} of {len(tried)}" + (f": {'; '.join(failed)}" if failed else "")


def totals(rows: list[Row]) -> list[str]:
    """The totals section's bullets."""
    count = {outcome: sum(r["outcome"] == outcome for r in rows) for outcome in OUTCOMES}
    converted = [r for r in rows if r["outcome"] == "converted"]
    with_stages = [r for r in converted if staged(r)]
    stageless = [r["model"] for r in converted if not staged(r)]
    deep = [r for r in converted if (number(r, "deepest") or 0) > 1]
    adds, blocks = counted(converted, "residual_adds"), counted(converted, "blocks")
    inside = counted(converted, "adds_in_stages")
    raised = [r["model"] for r in rows if r.get("verify") == "raised"]
    false = [r["model"] for r in rows if false_alarm(r)]
    worst = max(converted, key=lambda r: number(r, "fp32_vs_roundoff") or 0, default=None)
    items = [
        f"models: {len(rows)}; " + ", ".join(f"{outcome} {count[outcome]}" for outcome in OUTCOMES),
        f"converted with no ODE stage (no run lifted): {len(stageless)}"
        + (f" ({', '.join(stageless)})" if stageless else ""),
        f"converted models with a stage deeper than one block: {len(deep)} of {len(converted)}",
        f"residual adds inside stages, in the converted models: {inside} of the {adds} residual adds of "
        f"their traces ({share(inside, adds)}), in the {blocks} residual blocks odeify found (an add inside "
        "a block's branch, a rotary embedding's, counts inside its stage and is no block)",
        f"VerificationErrors: {len(raised)}"
        + (f" ({', '.join(raised)})" if raised else "")
        + f"; false (the fp64 conversion agrees to {FALSE_ALARM:.0e}): {len(false)}"
        + (f" ({', '.join(false)})" if false else ""),
        f"save -> load round trips failed (models with stages): {failures(with_stages, 'save_load')}",
        f"retarget x0.5 failed (models with a stage deeper than one block): {failures(deep, 'retarget')}; "
        f"refused as changing nothing (one-block stages only): {len(with_stages) - len(deep)}",
    ]
    if worst is not None and number(worst, "fp32_vs_roundoff") is not None:
        items.append(
            f"largest fp32 difference from the source: {number(worst, 'fp32_vs_roundoff'):.1f}x the source's "
            f"own fp32 round-off ({worst['model']})"
        )
    return items


def family_rows(rows: list[Row]) -> list[list[str]]:
    """One line per family: models, outcomes, the deepest stage and the adds inside stages."""
    table = []
    for family in sorted({r["family"] for r in rows}):
        members = [r for r in rows if r["family"] == family]
        converted = [r for r in members if r["outcome"] == "converted"]
        deepest = max(converted, key=lambda r: number(r, "deepest") or 0, default=None)
        adds = [counted(converted, key) for key in ("adds_in_stages", "blocks", "residual_adds")]
        other = [f"{r['model']}: {r['outcome']}" for r in members if r["outcome"] != "converted"]
        table.append([
            family,
            ", ".join(r["model"] for r in members),
            f"{len(converted)} of {len(members)}",
            f"{deepest['deepest']} ({deepest['model']})" if deepest else "",
            " / ".join(map(str, adds)) if converted else "",
            "; ".join(other),
        ])  # fmt: skip
    return table


def cell(text: str, width: int = 160) -> str:
    """Text for a Markdown table cell: cut at ``width`` characters, pipes escaped."""
    text = text if len(text) <= width else text[: width - 3] + "..."
    return text.replace("|", "\\|")


def errors_of(row: Row) -> str:
    """The model's error, then the other phases' errors that do not repeat it."""
    error = row.get("error") or ""
    others = [e for e in (row.get("phase_errors") or "").split("; ") if e and e.split(": ", 1)[-1] != error]
    return "; ".join(filter(None, [error, *others]))


def model_rows(rows: list[Row]) -> list[list[str]]:
    """The full table's rows, one per model."""
    table = []
    for r in rows:
        ratio = number(r, "fp32_vs_roundoff")
        adds = [r.get(key) or "-" for key in ("adds_in_stages", "blocks", "residual_adds")]
        table.append([
            r["model"], r["family"], r["outcome"], r.get("stage_depths", ""),
            " / ".join(adds), r.get("verify", ""), cell(r.get("retarget", "")),
            cell(r.get("save_load", "")), cell(errors_of(r)),
            sci(r, "fp32_rel"), "" if ratio is None else f"{ratio:.2g}", sci(r, "fp64_rel"),
            r.get("peak_rss_mib", ""), r.get("seconds", ""),
        ])  # fmt: skip
    return table


FAMILY_HEADERS = [
    "family", "models", "converted", "deepest stage", "adds: in stages / blocks / trace", "not converted",
]  # fmt: skip
MODEL_HEADERS = [
    "model", "family", "outcome", "stage depths", "adds: in stages / blocks / trace", "verify",
    "retarget x0.5",
    "save -> load", "errors", "fp32 rel", "fp32 / round-off", "fp64 rel", "peak MiB", "s",
]  # fmt: skip


def markdown(rows: list[Row], args: argparse.Namespace, command: str, skipped: dict[str, str]) -> str:
    """The results file: what was measured, the totals, a line per family, every model."""
    which = (
        "The models named by --models"
        if args.models and not args.replace
        else "The smallest model (by parameters) of every timm model module, and common names"
    )
    threads = args.threads or f"torch's default ({torch.get_num_threads()})"
    size = f"{args.img_size}x{args.img_size}" if args.img_size else "its default size (timm's pretrained cfg)"
    lines = [
        "# The timm zoo: what odeify converts",
        "",
        f"{datetime.date.today().isoformat()}, timm {timm.__version__}. {which}; each in a fresh process",
        f"limited to {args.timeout:g} s and {args.memory_gib:g} GiB resident. Random weights from",
        "`make_test_model` (seed 0: norm statistics, LayerScales and zero-init gains redrawn as a",
        f"trained model's), eval mode, batch 1 at {size}, one seeded input;",
        f"torch threads per model: {threads}.",
        "",
        "Outcome: `converted`, `refused` (an OdeifyError: a refusal), `traceback` (any other exception, in",
        "convert or in building the model), `timeout`, `memory`, `died` (the process ended without a",
        "result; the CSV's `phase` says where it stopped). Stage depths: blocks per ODE stage (periods",
        "of a split stage). Adds: the residual joins inside stages (the lifted runs' blocks), the residual",
        "blocks odeify found, and the trace's residual adds (adds of two tensors of the sum's shape, both",
        "computed from the input; rotary embeddings and relative-position terms add so too). verify:",
        'convert\'s own check (fp32). retarget x0.5: `retarget(steps="x0.5")` and a forward. save -> load:',
        "the loaded model's output against the saved one's, `ok` when equal or within the source's fp32",
        "round-off, else the difference. fp32 rel and fp64 rel: max |converted - source| / max |source| at",
        "native depth; fp32 / round-off: the same difference over the fp32 source's own distance from its",
        "float64 copy. Every phase's time and the full errors are in the CSV beside this file.",
        "",
        *bullets("## Totals", totals(rows)),
        "## Families",
        "",
        *markdown_table(FAMILY_HEADERS, family_rows(rows), text_columns=6),
        "",
        "## Models",
        "",
        *markdown_table(MODEL_HEADERS, model_rows(rows), text_columns=9),
        "",
    ]
    if skipped:
        lines += bullets(
            f"## Names not built on the meta device ({len(skipped)}), left out of the choice",
            [f"{name}: {why}" for name, why in sorted(skipped.items())],
        )
    return "\n".join([*lines, f"Command: `{command}`", "", f"Machine: {describe_machine()}.", ""])


def readme_table(rows: list[Row]) -> str:
    """The README's "Bring your model" family table: the families, grouped by what their models get
    (a stage deeper than one block, one-block stages only, no stage), each with its deepest stage."""
    groups: dict[str, list[str]] = {"deep": [], "one-block": [], "none": []}
    for family in sorted({r["family"] for r in rows}):
        members = [r for r in rows if r["family"] == family and staged(r)]
        deepest = max((int(number(r, "deepest") or 0) for r in members), default=0)
        group = "deep" if deepest > 1 else "one-block" if deepest == 1 else "none"
        groups[group].append(f"{family} ({deepest})" if deepest > 1 else family)
    titles = {
        "deep": "a stage deeper than one block (its depth)",
        "one-block": "one-block stages only: exact, no depth to change",
        "none": "no stage: refused, or failed in this sweep",
    }
    lines = ["| what the family's models get | families |", "|---|---|"]
    for key, names in groups.items():
        if names:
            lines.append(f"| {titles[key]}: {len(names)} | {', '.join(names)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# The command line


def progress_line(i: int, total: int, row: Row, elapsed: float, done: int) -> str:
    """One line per model, with an estimate of the time left (the mean so far times the models left)."""
    parts = [row["outcome"]]
    if row.get("stage_depths"):
        parts.append(f"stages {row['stage_depths']}")
    if row.get("adds_in_stages") is not None and row.get("residual_adds") is not None:
        parts.append(f"adds {row['adds_in_stages']}/{row['residual_adds']}")
    if row.get("fp32_vs_roundoff") is not None:
        parts.append(f"fp32 {row['fp32_vs_roundoff']:.2g}x round-off")
    if row.get("error"):
        parts.append(str(row["error"])[:120])
    left = (total - i) * elapsed / max(done, 1)
    return (
        f"[{i}/{total}] {row['model']} ({row['family']}): {', '.join(parts)}; {row['seconds']:.0f} s; "
        f"about {left / 60:.0f} min left"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (``--child`` and ``--model``: a child's, not a user's)."""
    parser = argparse.ArgumentParser(
        description="Sweep timm's model zoo through odeify: build, convert (with its verification), "
        "compare with the source in fp32 and fp64, retarget to half depth, save and load each model, "
        "each in a fresh process with a time and a memory limit. Writes OUT.csv (a row per model, "
        "appended as it comes) and OUT.md (totals, a line per family, every model), and prints a "
        "line per model.",
        epilog="The zoo is each timm module's smallest model and common names; choosing it builds "
        "every timm model on the meta device (minutes), so the choice is kept in OUT_models.json for "
        "the timm version that made it.",
    )
    parser.add_argument("--models", help="comma-separated timm names to sweep instead of the zoo")
    parser.add_argument("--list", action="store_true", help="print the models (name, family, size) and exit")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="results path without suffix (default: %(default)s)"
    )
    parser.add_argument(
        "--img-size", type=int, help="input height and width (default: each model's, from timm's cfg)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="wall seconds per model (default: 600)")
    parser.add_argument(
        "--memory-gib", type=float, default=8, help="resident memory per model in GiB (default: 8)"
    )
    parser.add_argument("--threads", type=int, help="torch threads per model (default: torch's)")
    parser.add_argument("--resume", action="store_true", help="skip the models already in OUT.csv")
    parser.add_argument(
        "--replace",
        action="store_true",
        help="with --models: sweep them again and replace their rows in OUT.csv, keeping the others",
    )
    parser.add_argument(
        "--readme-table", action="store_true", help="print the README's family table from OUT.csv and exit"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.img_size is not None and args.img_size < 1:
        parser.error("--img-size must be >= 1")
    if args.replace and (not args.models or args.resume):
        parser.error("--replace takes --models (the rows to sweep again) and not --resume")
    if args.timeout <= 0 or args.memory_gib <= 0:
        parser.error("--timeout and --memory-gib must be positive")
    return args


def replace_rows(csv_path: Path, md_path: Path, names: list[str], command: str) -> tuple[str, dict[str, str]]:
    """For ``--replace``: OUT.csv rewritten without the rows of ``names`` (atomically), which are swept
    again and appended; returns the results' command (the sweep's, from OUT.md, then this one) and the
    names the zoo's choice left out (from OUT_models.json), for a Markdown file that still describes
    the whole sweep."""
    kept = [row for row in read_rows(csv_path) if row["model"] not in names]
    text = io.StringIO()
    writer = csv.DictWriter(text, FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(kept)
    atomic_write_bytes(csv_path, text.getvalue().encode())
    previous = re.search(r"^Command: `(.*)`", md_path.read_text(), re.M) if md_path.is_file() else None
    if previous:
        command = f"{previous.group(1)}`, its rows of {', '.join(names)} replaced by `{command}"
    cache = csv_path.with_name(csv_path.stem + "_models.json")
    skipped = json.loads(cache.read_text())["skipped"] if cache.is_file() else {}
    return command, skipped


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    csv_path, md_path = (args.out.with_name(args.out.name + suffix) for suffix in (".csv", ".md"))
    if args.readme_table:
        print(readme_table(read_rows(csv_path)))
        return 0
    if args.models:
        family = families()
        models = [
            (name, family.get(name, "?"), params_or_none(name)) for name in args.models.split(",") if name
        ]
        skipped: dict[str, str] = {}
    else:
        models, skipped = zoo_models(args.out.with_name(args.out.name + "_models.json"))
    if args.list:
        for name, family_name, params in models:
            print(f"{name}\t{family_name}\t{'' if params is None else f'{params / 1e6:.2f}M'}")
        return 0
    done = read_rows(csv_path) if args.resume else []
    command = command_line(__file__, None if argv is None else list(argv))
    if args.replace:
        command, skipped = replace_rows(csv_path, md_path, [m[0] for m in models], command)
    elif not args.resume and csv_path.exists():
        csv_path.unlink()
    todo = [m for m in models if m[0] not in {r["model"] for r in done}]
    start = time.perf_counter()
    for i, (name, family_name, params) in enumerate(todo, 1):
        row = run_model(child_command(name, args), args.timeout, args.memory_gib)
        row.update(model=name, family=family_name, params_m=None if params is None else params / 1e6)
        append_row(csv_path, row)
        print(progress_line(i, len(todo), row, time.perf_counter() - start, i), flush=True)
        write_results(md_path, markdown(read_rows(csv_path), args, command, skipped))
    if not todo:
        write_results(md_path, markdown(read_rows(csv_path), args, command, skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
