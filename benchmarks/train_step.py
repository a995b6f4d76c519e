"""Benchmark: one whole-model training step, timm against odeify's backward modes.

resnet50 and resnet152 (``--models``: resnet18 and two transformers too) with random non-trivial
weights (``make_test_model``: no zero-initialised branches, randomised BN statistics), a batch of 8
224x224 images (``--batch``, ``--img-size``), fp32, cross-entropy, on the CPU.
Rows: timm plain and with ``set_grad_checkpointing(True)`` (both in train mode, as a user trains),
and the converted model trained with backprop / checkpoint / reverse (Euler) and reversible:
reversible Heun (on the default piecewise-constant weight path, and on a linear one, where
consecutive steps share a field evaluation) and ALF (MALI's asynchronous leapfrog: one evaluation
per step, strictly inside it; v_0 = 0, the default, and v_0 = F(t_0, z_0), one more evaluation per
stage), at native steps and at 4x steps. The memory-free modes run with the whole-model memory
plan: the parts between stages are checkpointed (``odeify.passes.segments``).

Compiled rows (``--rows``, none by default: inductor takes a minute or more per model on a small
CPU): each row's name with ``+ torch.compile`` appended is ``torch.compile(model)`` with inductor's
defaults, as timm's ``train.py --torchcompile`` runs it; with ``+ torch.compile, no layout
optimization`` the same with ``torch._inductor.config.layout_optimization = False`` (otherwise
inductor makes channels_last copies of convolution inputs and weights, and saves them for backward).

Each configuration runs in a fresh process: build and convert, a first step (builds the step
graphs, allocates the gradients; a compiled row compiles here), one measured step; then
``--repeats`` timed steps, taken in turns with the other configurations of its model and steps,
whose processes are alive together (each round steps each of them once, in order); then one step
whose peak is counted. A change of the machine's speed during the run then moves timm plain's
steps and the other rows' alike: one process after another, timm plain's own median moved
1.67 -> 2.19 s on resnet50 between two runs 16 minutes apart on the shared 2-core machine, and its
ratios with it. Columns:

- saved: bytes autograd saves for backward during the forward, once per storage, parameters
  excluded (``benchmarks/memory.py``);
- step peak: the most bytes the CPU allocator held at once during one step over what it held at
  the step's start (gradients allocated before it), from the allocation events of
  ``torch.profiler(profile_memory=True)``: every CPU tensor's storage, a compiled graph's buffers
  included, not oneDNN's own scratch memory. Not :class:`odeify.inspection.TensorPeak`: under a
  ``TorchDispatchMode`` dynamo runs the compiled model eagerly, so that count is eager's;
- RSS peak (``--rss-peak``): the process's peak resident memory during one step over its resident
  memory before it, in another fresh process that returns freed blocks to the system at once
  (``mallopt(M_MMAP_THRESHOLD, 64 KiB)``), after two steps (a compiled row's compile included);
- first step: the first step's wall time, a compiled row's cold compile included (each compiled
  row compiles into an empty inductor cache, as a user's first run does);
- recompiles (compiled rows): frames dynamo compiled after the first step, over every later step
  (the measured, timed and peak steps); graphs and graph breaks: what the first step compiled;
- step time: median wall time of the timed steps (spread: the fastest and the slowest of them), as
  a ratio to timm plain on the same model in the same run (and the same for process CPU time, less
  sensitive to a busy machine);
- grad err: relative error of all parameter gradients (one vector) against eager backprop of the
  same manifestation (same integrator, basis and steps; timm's own eager model for timm compiled),
  computed in the same process after timing;
- fp32 band (reversible rows, native steps, more than one thread): that backprop run on one thread
  against itself on all threads: how far apart two correct fp32 gradients of this model already are;
- vs fp64, backprop vs fp64 (those rows and every compiled row): this row's gradients and eager fp32
  backprop's against eager backprop of the same model in float64 (the exact gradient, to
  round-off): whether the memory-free or compiled gradient is as accurate as the one the user would
  otherwise get;
- fallbacks: backward passes that could not stay memory-free (reverse: reconstruction failed;
  reversible: the state could not be kept exactly), out of all passes the process ran.

``--models vit_small_patch16_224`` adds a ViT: its 12 blocks become one split stage
(attention and MLP sub-fields, Lie-Trotter); ``swin_tiny_patch4_window7_224`` a Swin (stages 3 and 4
split stages of period 4 and 2, stages 1 and 2 a stage of one block per half). Their reversible rows
run the reversible splittings (``alf``, ``reversible_heun``: every sub-step a reversible step), all
but ALF with v0 = F(t0, z0), which split stages refuse.

``--profile`` adds where the time goes: one more step of some rows under ``torch.profiler``.
Writes benchmarks/results/train_step.md and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch._inductor.config
import torch.nn.functional as F
from child import SteppedChild, report_to_parent, requests, run_child
from machine import command_line, describe_machine, provenance, save_figure, write_results
from memory import SavedBytes, reset_peak_rss, rss
from tables import bullets, markdown_table, print_table
from torch import nn
from torch._dynamo.utils import counters
from torch.autograd import DeviceType

import odeify
from odeify.models._testing import make_test_model
from odeify.numerics.schemes import AsyncLeapfrog
from odeify.passes.segments import has_segments

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ["resnet50", "resnet152"]
VIT = "vit_small_patch16_224"
SWIN = "swin_tiny_patch4_window7_224"
MODEL_CHOICES = [*MODELS, "resnet18", VIT, SWIN]
SPLIT_MODELS = (VIT, SWIN)
"""Models whose runs become split stages (a ViT's attention and MLP halves; a Swin's four sub-fields,
window attention, MLP, shifted-window attention, MLP, in stages 3 and 4): Euler means
Lie-Trotter there (the network at native steps), ``alf`` and ``reversible_heun`` their Lie-Trotter
reversible splittings; ALF with v0 = F(t0, z0) is refused there, so that row is not run."""
STEPS = ["native", "x4"]
BATCH, SIZE, CLASSES = 8, 224, 1000
MB = 2**20


@dataclass(frozen=True)
class Row:
    """One way to train: timm's model, or the converted one with a backward mode."""

    integrator: str | AsyncLeapfrog | None = None  # None: timm's own model
    backward: str | None = None
    basis: str = "constant"
    grad_checkpointing: bool = False
    compiled: bool = False  # torch.compile(model), inductor
    layout_optimization: bool = True  # inductor's channels_last copies (compiled rows)


ROWS = {
    "timm": Row(),
    "timm + grad checkpointing": Row(grad_checkpointing=True),
    "odeify backprop": Row("euler", "backprop"),
    "odeify checkpoint": Row("euler", "checkpoint"),
    "odeify reverse": Row("euler", "reverse"),
    "odeify reversible": Row("reversible_heun", "reversible"),
    "odeify reversible, linear path": Row("reversible_heun", "reversible", basis="linear"),
    "odeify reversible ALF": Row("alf", "reversible"),
    "odeify reversible ALF, v0 = F(t0, z0)": Row(AsyncLeapfrog("field"), "reversible"),
}
COMPILED = " + torch.compile"
NO_LAYOUT = " + torch.compile, no layout optimization"
ALL_ROWS = {
    **ROWS,
    **{name + COMPILED: replace(row, compiled=True) for name, row in ROWS.items()},
    **{
        name + NO_LAYOUT: replace(row, compiled=True, layout_optimization=False) for name, row in ROWS.items()
    },
}
"""``ROWS`` (eager, what the other benchmarks build) and each compiled: ``--rows`` names any of them."""


def eager_twin(name: str) -> str:
    """The eager row a compiled row compiles (``name`` itself for an eager row)."""
    return name.removesuffix(NO_LAYOUT).removesuffix(COMPILED)


PROFILED = [
    "timm",
    "timm + grad checkpointing",
    "odeify backprop",
    "odeify checkpoint",
    "odeify reversible",
    "odeify reversible, linear path",
    "odeify reversible ALF",
    "odeify reversible ALF, v0 = F(t0, z0)",
]
REVERSIBLE_ROWS = (
    "odeify reversible",
    "odeify reversible, linear path",
    "odeify reversible ALF",
    "odeify reversible ALF, v0 = F(t0, z0)",
)


@dataclass
class Result:
    """One (model, row, steps) measurement: bytes, seconds."""

    model: str
    row: str
    steps: str
    saved: int
    peak: int  # the CPU allocator's, over the step's start
    first_step: float
    times: list[float]
    cpu_times: list[float]
    rss_peak: int | None = None  # --rss-peak: in a process of its own
    recompiles: int | None = None  # compiled rows: frames compiled after the first step
    graphs: int = 0  # compiled rows: graphs the first step compiled
    graph_breaks: int = 0
    grad_error: float = math.nan
    band: float = math.nan  # fp32 backprop on 1 thread against itself on all threads
    truth_error: float = math.nan  # this row's gradients against fp64 backprop
    backprop_truth_error: float = math.nan  # fp32 backprop's against fp64 backprop
    fallbacks: int = 0
    passes: int = 0
    profile: dict[str, float] = field(default_factory=dict)

    @property
    def time(self) -> float:
        return statistics.median(self.times)

    @property
    def cpu_time(self) -> float:
        return statistics.median(self.cpu_times)


# -- the child: one configuration in a fresh process ----------------------------------------------
WEIGHTS = ("random", "trained-like")
TRAINED_LIKE_BRANCH_SCALE = 0.2
"""``--weights trained-like``: every residual branch's last norm gain (what timm's ``zero_init_last``
zeroes) times this, so in [0.1, 0.3] instead of ``make_test_model``'s [0.5, 1.5]. Random branches at
full strength compound over a deep stage as no trained network's do: resnet152's 36-block layer3
multiplies its input's magnitude by 2^30 (activations of 4e11), past any exact lattice, so every
reversible pass falls back. Trained branches are weak: the corpus's briefly trained resnet18 and
resnet26d have last-BN gains of median 0.002..0.09 per block (benchmarks/corpus.py); at 0.2 times
the random gains resnet152's layer3 grows its input 2^2.1-fold, inside the 2^4.4 of the corpus's
trained stages (results/lattice_range.md). Only the fallbacks depend on the weights' values."""


def weights_phrase(weights: str) -> str:
    """What a results file adds to its model description for ``--weights``: nothing for random."""
    if weights != "trained-like":
        return ""
    return (
        f", every residual branch's last-norm gain scaled by {TRAINED_LIKE_BRANCH_SCALE} (`--weights "
        "trained-like`: a trained network's branch strength, see benchmarks/train_step.py)"
    )


def _weaken_branches(model: nn.Module, scale: float) -> None:
    """Scale, in place, every parameter a block's ``zero_init_last`` would zero (timm's last-norm gains)."""
    with torch.no_grad():
        for module in model.modules():
            if not callable(getattr(module, "zero_init_last", None)):
                continue
            before = {name: p.clone() for name, p in module.named_parameters()}
            module.zero_init_last()
            for name, p in module.named_parameters():
                zeroed = not p.any() and before[name].any()
                p.copy_(before[name] * scale if zeroed else before[name])


def build(model_name: str, row: Row, steps: str, weights: str = "random", size: int = SIZE) -> nn.Module:
    """``model_name`` with test weights (``weights``) as ``row`` trains it at ``size`` x ``size`` images."""
    model = make_test_model(model_name)
    if weights == "trained-like":
        _weaken_branches(model, TRAINED_LIKE_BRANCH_SCALE)
    return as_row(model, row, steps, size)


def as_row(model: nn.Module, row: Row, steps: str, size: int = SIZE) -> nn.Module:
    """``model`` (timm, eval or train) as ``row`` trains it, at ``size`` x ``size`` images, in train mode."""
    if row.integrator is None:
        model.set_grad_checkpointing(row.grad_checkpointing)
        return model.train()
    gm = odeify.convert(
        model, integrator=row.integrator, basis=row.basis, steps=steps, input_size=(1, 3, size, size)
    )
    if row.backward != "backprop":
        odeify.set_backward(gm, row.backward)  # one mode for the whole model: segments checkpointed too
        assert has_segments(gm)
    return gm.train()


def child(args: argparse.Namespace) -> None:
    """One configuration, in this process, compiling into an inductor cache of its own."""
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # empty: a cold compile, as a user's first run's
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """Build, step and report to the parent: its timed steps on its turns, then the :class:`Result`;
    with ``--part rss`` only the RSS peak."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part == "rss":
        return_freed_memory()
    row = ALL_ROWS[args.row]
    model = build(args.model, row, args.steps, args.weights, args.img_size)
    run = compiled(model, row) if row.compiled else model
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=g)
    labels = torch.randint(0, CLASSES, (args.batch,), generator=g)
    saved = SavedBytes(model.parameters())

    def step(
        net: nn.Module = run, count: bool = False, inputs: torch.Tensor = x, keep_grads: bool = False
    ) -> tuple[float, float]:
        model.zero_grad(set_to_none=not keep_grads)  # kept: allocated before the step, not in its peak
        wall, cpu = time.perf_counter(), time.process_time()
        with saved.counting() if count else contextlib.nullcontext():
            loss = F.cross_entropy(net(inputs), labels)
        loss.backward()
        return time.perf_counter() - wall, time.process_time() - cpu

    warnings.filterwarnings("ignore", "odeify: stage", RuntimeWarning)  # fallbacks are counted below
    first, _ = step()
    frames, graphs, graph_breaks = dynamo_counts()
    if args.part == "rss":
        report_to_parent({"rss_peak": rss_peak(step)})
        return
    step(count=True)
    report_to_parent({"ready": True})
    timings = []
    for _ in requests():  # the parent's turns: one timed step each
        timings.append(step())
        report_to_parent({"wall": timings[-1][0]})
    peak = allocator_peak(lambda: step(keep_grads=True))
    stages = odeify.converted_stages(model) if row.integrator else []
    result = Result(
        model=args.model,
        row=args.row,
        steps=args.steps,
        saved=saved.total,
        peak=peak,
        first_step=first,
        times=[t for t, _ in timings],
        cpu_times=[c for _, c in timings],
        recompiles=dynamo_counts()[0] - frames if row.compiled else None,
        graphs=graphs,
        graph_breaks=graph_breaks,
        fallbacks=sum(s.adjoint_stats.fallbacks for s in stages),
        passes=sum(s.adjoint_stats.backward_passes for s in stages),
    )
    if args.profile:
        result.profile = profile(step)
    if row.compiled or (row.integrator and row.backward != "backprop"):
        check_gradients(result, model, row, step, x)
    report_to_parent(result)


def compiled(model: nn.Module, row: Row) -> nn.Module:
    """``torch.compile(model)`` as timm's ``train.py --torchcompile`` runs it: inductor, default mode."""
    if not row.layout_optimization:
        torch._inductor.config.layout_optimization = False
    return torch.compile(model)


def dynamo_counts() -> tuple[int, int, int]:
    """Frames dynamo has compiled in this process (recompilations included), the graphs they made and
    the graph breaks they met (``torch._dynamo``'s counters)."""
    return (
        counters["frames"]["total"],
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
    )


def allocator_peak(step: Callable[[], object]) -> int:
    """The most bytes the CPU allocator held at once during ``step()`` over what it held before it.

    From the allocation events of ``torch.profiler(profile_memory=True)``, which see every CPU
    storage, a compiled graph's buffers included. A block allocated before and freed during the step
    is not seen (its event carries no size), so a peak can only be over-counted.
    """
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        step()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory() -> None:
    """Have glibc return every freed block of 64 KiB or more to the system at once (as
    ``MALLOC_MMAP_THRESHOLD_=65536`` does), so that resident memory follows the tensors alive."""
    if not ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 65536):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the RSS peak needs glibc")


def rss_peak(step: Callable[..., object]) -> int:
    """Peak resident bytes of one step over those before it, after a second step (the first compiled)."""
    step()
    before = rss("VmRSS")
    reset_peak_rss()
    step(keep_grads=True)
    return rss("VmHWM") - before


def check_gradients(
    result: Result, model: nn.Module, row: Row, step: Callable[..., object], x: torch.Tensor
) -> None:
    """The last step's gradients against eager backprop's (fp32, and fp64 where asked), into ``result``."""
    got = [p.grad.detach().clone() for p in model.parameters()]
    if row.integrator and row.backward != "backprop":
        odeify.set_backward(model, "backprop")  # in place; inlines the segments too
    step(net=model)
    want = [p.grad.detach().clone() for p in model.parameters()]
    result.grad_error = relative_error(got, want)
    exact = row.backward == "reversible" and result.steps == "native"
    threads = torch.get_num_threads()
    if exact and threads > 1:
        torch.set_num_threads(1)  # other kernels, other summation order: fp32's own spread
        step(net=model)
        torch.set_num_threads(threads)
        result.band = relative_error([p.grad for p in model.parameters()], want)
    if not (exact or row.compiled):
        return
    model.double()  # the exact gradient, to round-off: both fp32 methods measured against it
    step(net=model, inputs=x.double())
    truth = [p.grad.detach() for p in model.parameters()]
    result.truth_error = relative_error(got, truth)
    result.backprop_truth_error = relative_error(want, truth)


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(got, want, strict=True))
    return math.sqrt(diff / sum(float(b.double().square().sum()) for b in want))


FUNCTIONS = ("CheckpointAdjoint", "ReverseAdjoint", "LatticeAdjoint")
"""The memory-saving autograd Functions (``odeify.runtime.stage.MEMORY_SAVING``), by profiler name."""


def profile(step) -> dict[str, float]:
    """Seconds of one profiled step by category (self times of the ops, on the calling thread)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        wall, _ = step()
    self_time: dict[str, float] = {}
    total_time: dict[str, float] = {}
    for event in prof.key_averages():
        self_time[event.key] = event.self_cpu_time_total / 1e6
        total_time[event.key] = event.cpu_time_total / 1e6
    aten = {k: v for k, v in self_time.items() if k.startswith("aten::")}
    conv_bwd = sum(v for k, v in aten.items() if "convolution_backward" in k)
    conv_fwd = sum(v for k, v in aten.items() if "convolution" in k and "backward" not in k)
    lattice = total_time.get("odeify.lattice", 0.0)

    def inclusive(*names: str) -> float:
        return sum(total_time.get(n, 0.0) for n in names)

    return {
        "step": wall,
        "conv forward": conv_fwd,
        "conv backward": conv_bwd,
        "lattice arithmetic": lattice,
        "other tensor ops": sum(aten.values()) - conv_fwd - conv_bwd - lattice,
        "outside tensor ops": wall - sum(aten.values()),
        "stage forwards": inclusive(*FUNCTIONS),
        "stage backwards": inclusive(*(f"{name}Backward" for name in FUNCTIONS)),
        "segments (forward + recompute)": inclusive("odeify.segment"),
    }


# -- the parent: one process per configuration, steps taken in turns -------------------------------
Configuration = tuple[str, str, str]  # (model, row, steps)


def measure_together(
    group: list[Configuration], repeats: dict[str, int], profiled: set[Configuration], options: list[str]
) -> tuple[list[Result], list[str]]:
    """Run ``group``'s configurations in fresh processes that are alive together, and read their results.

    Each process is built, takes its first step (compiles) and is measured (saved bytes) while the
    others wait; then the timed steps go round: every round steps each configuration once, in order.
    ``options``: the child arguments every configuration shares. Returns the results in ``group``'s
    order and one line per configuration that failed (the others go on).
    """
    children: dict[Configuration, SteppedChild] = {}
    failures: list[str] = []

    def failed(config: Configuration, error: RuntimeError) -> None:
        failures.append(failure(error))
        children.pop(config, None)

    for config in group:
        model, row, steps = config
        arguments = [
            "--model", model, "--row", row, "--steps", steps, *options,
            *(["--profile"] if config in profiled else []),
        ]  # fmt: skip
        try:
            children[config] = SteppedChild(__file__, arguments, f"{model} / {row} / {steps}")
        except RuntimeError as error:
            failed(config, error)
    try:
        for turn in range(max(repeats[steps] for _, _, steps in group)):
            for config, child in list(children.items()):
                if turn < repeats[config[2]]:
                    try:
                        child.step()
                    except RuntimeError as error:
                        failed(config, error)
        results = []
        for config, child in list(children.items()):  # one at a time: the gradient checks are heavy
            try:
                results.append(Result(**child.finish()))
            except RuntimeError as error:
                failed(config, error)
    finally:
        for child in children.values():
            child.kill()
    return results, failures


def failure(error: RuntimeError) -> str:
    """A failed child's line (its first and last), printed as it happens."""
    line = str(error).splitlines()[0] + " " + str(error).splitlines()[-1]
    print(f"  {line}", file=sys.stderr, flush=True)
    return line


def add_rss_peaks(results: list[Result], options: list[str]) -> list[str]:
    """Each result's RSS peak, from a fresh process of its own (one at a time); the failures' lines."""
    failures = []
    for r in results:
        arguments = ["--model", r.model, "--row", r.row, "--steps", r.steps, *options, "--part", "rss"]
        try:
            r.rss_peak = run_child(__file__, arguments, f"{r.model} / {r.row} / {r.steps} RSS")["rss_peak"]
        except RuntimeError as error:
            failures.append(failure(error))
    return failures


def groups(configs: list[Configuration]) -> list[list[Configuration]]:
    """``configs`` by (model, steps), in order: the configurations whose times are compared step by
    step (every row against timm plain at native steps, ALF against reversible Heun at 4x)."""
    keyed: dict[tuple[str, str], list[Configuration]] = {}
    for config in configs:
        keyed.setdefault((config[0], config[2]), []).append(config)
    return list(keyed.values())


FLAT_ROWS = ("odeify reverse", *REVERSIBLE_ROWS)
"""The rows whose memory should not grow with steps: the ones resnet152 runs at 4x steps by default."""


def configurations(
    models: list[str], rows: list[str], steps: list[str], every_deep: bool
) -> list[tuple[str, str, str]]:
    """(model, row, steps) to run: timm rows once; resnet152 at 4x steps only the flat rows unless asked."""
    chosen = []
    for model in models:
        for row in rows:
            for s in steps if ALL_ROWS[row].integrator else ["native"]:
                if model in SPLIT_MODELS and eager_twin(row) == "odeify reversible ALF, v0 = F(t0, z0)":
                    continue
                if s == "native" or every_deep or model == MODELS[0] or eager_twin(row) in FLAT_ROWS:
                    chosen.append((model, row, s))
    return chosen


# -- reporting ------------------------------------------------------------------------------------
HEADERS = (
    "model", "row", "steps", "saved MiB", "saved vs timm", "step peak MiB", "peak vs timm", "RSS peak MiB",
    "first step s", "step s", "spread s", "time vs timm", "CPU time vs timm", "recompiles", "grad err",
    "fp32 band", "vs fp64", "backprop vs fp64", "fallbacks",
)  # fmt: skip


def baseline(result: Result, results: list[Result]) -> Result:
    return next(r for r in results if r.model == result.model and r.row == "timm")


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MB:.1f}"


def error(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1e}"


def cells(r: Result, results: list[Result]) -> tuple[str, ...]:
    base = baseline(r, results)
    return (
        r.model,
        r.row,
        r.steps if ALL_ROWS[r.row].integrator else "-",
        f"{r.saved / MB:.0f}",
        f"{r.saved / base.saved:.2f}",
        mib(r.peak),
        f"{r.peak / base.peak:.2f}",
        mib(r.rss_peak),
        f"{r.first_step:.2f}",
        f"{r.time:.3f}",
        f"{min(r.times):.3f}..{max(r.times):.3f}",
        f"{r.time / base.time:.2f}x",
        f"{r.cpu_time / base.cpu_time:.2f}x",
        "-" if r.recompiles is None else str(r.recompiles),
        error(r.grad_error),
        error(r.band),
        error(r.truth_error),
        error(r.backprop_truth_error),
        f"{r.fallbacks}/{r.passes}" if r.passes else "-",
    )


COMPILED_HEADERS = (
    "model", "row", "steps", "eager step s", "compiled step s", "compiled vs eager", "first step s",
    "compile s", "eager peak MiB", "compiled peak MiB", "peak vs eager", "eager RSS MiB",
    "compiled RSS MiB", "recompiles", "graphs", "graph breaks",
)  # fmt: skip


def compiled_pairs(results: list[Result]) -> list[tuple[Result, Result]]:
    """(eager, compiled) for every compiled result whose eager row ran beside it."""
    eager = {(r.model, r.row, r.steps): r for r in results if not ALL_ROWS[r.row].compiled}
    return [
        (eager[(r.model, eager_twin(r.row), r.steps)], r)
        for r in results
        if ALL_ROWS[r.row].compiled and (r.model, eager_twin(r.row), r.steps) in eager
    ]


def round_ratios(r: Result, eager: Result) -> list[float]:
    """``r``'s timed steps over ``eager``'s, round by round: the two stepped in turns, so each ratio
    pairs steps taken moments apart (a busy machine's slow spell moves both)."""
    return [mine / theirs for mine, theirs in zip(r.times, eager.times, strict=True)]


def compiled_cells(eager: Result, r: Result) -> tuple[str, ...]:
    """One compiled row beside its eager twin: step, compile (first step over a steady one), peaks."""
    ratios = round_ratios(r, eager)
    return (
        r.model,
        r.row,
        r.steps if ALL_ROWS[r.row].integrator else "-",
        f"{eager.time:.3f}",
        f"{r.time:.3f} ({min(r.times):.3f}..{max(r.times):.3f})",
        f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f})",
        f"{r.first_step:.1f}",
        f"{r.first_step - r.time:.1f}",
        mib(eager.peak),
        mib(r.peak),
        f"{r.peak / eager.peak:.2f}x",
        mib(eager.rss_peak),
        mib(r.rss_peak),
        str(r.recompiles),
        str(r.graphs),
        str(r.graph_breaks),
    )


def verdict(met: bool) -> str:
    return "met" if met else "not met"


def targets(results: list[Result]) -> list[str]:
    """The issue's targets, each with what was measured."""

    def find(model: str, row: str, steps: str = "native") -> Result | None:
        return next((r for r in results if (r.model, r.row, r.steps) == (model, row, steps)), None)

    lines = []
    for row in FLAT_ROWS:
        for model, other, limit, what in [
            ("resnet50", "timm + grad checkpointing", 0.5, "timm's gradient checkpointing"),
            ("resnet152", "timm", 0.1, "timm plain"),
        ]:
            mine, theirs, deep = find(model, row), find(model, other), find(model, row, "x4")
            if mine and theirs:
                ratio = mine.saved / theirs.saved
                lines.append(
                    f"{model}, {row}: saves {mine.saved / MB:.0f} MiB = {ratio:.2f} of {what}'s "
                    f"{theirs.saved / MB:.0f} MiB (target <= {limit}: {verdict(ratio <= limit)})"
                )
            if mine and deep:
                growth = deep.saved / mine.saved
                lines.append(
                    f"{model}, {row}: saved bytes x{growth:.2f} from native to 4x steps "
                    f"(target: flat within 10%: {verdict(growth <= 1.1)})"
                )
    for row in REVERSIBLE_ROWS:
        limit = 1.5 if "ALF" in row else 1.8  # the issues' targets: ALF (issue 22), reversible Heun
        for model in MODELS:
            mine, plain = find(model, row), find(model, "timm")
            if mine and plain:
                ratio = mine.time / plain.time
                lines.append(
                    f"{model}, {row}: step time {ratio:.2f}x timm plain at native steps (CPU time "
                    f"{mine.cpu_time / plain.cpu_time:.2f}x; target <= {limit}x: {verdict(ratio <= limit)})"
                )
    lines += _alf_against_heun(find)
    lines += _split_stage_rows(find)
    errors = [r.grad_error for r in results if "reversible" in r.row and not math.isnan(r.grad_error)]
    if errors:
        lines.append(
            f"reversible gradients vs backprop of the same manifestation: at most {max(errors):.1e} (fp32)"
        )
    for r in results:
        if not math.isnan(r.truth_error) and not ALL_ROWS[r.row].compiled:
            ratio = r.truth_error / r.backprop_truth_error
            lines.append(
                f"{r.model}, {r.row}: gradients {r.truth_error:.1e} from fp64 backprop, fp32 backprop "
                f"{r.backprop_truth_error:.1e} (ratio {ratio:.2f})"
            )
    for eager, r in compiled_pairs(results):
        lines += _compiled_targets(eager, r, find(r.model, "odeify backprop", r.steps))
    return lines


TIMED_COMPILED = ("odeify checkpoint", "odeify reversible ALF")
"""The rows whose compiled step is to be no slower than their eager one (issue 58)."""
PEAK_TOLERANCE = 1.05
"""A compiled step keeps its mode's peak when it is at most this multiple of the eager step's (set
before any compiled run: another fusion may hold a temporary more or less)."""
GRADIENT_FACTOR = 4.0
"""A compiled gradient is as accurate as eager fp32's when its distance from fp64 is at most this
multiple of eager fp32 backprop's: tests/test_compile.py's bound for inductor."""


def _compiled_targets(eager: Result, r: Result, backprop: Result | None) -> list[str]:
    """A compiled row against its eager twin: step time, peak, recompilations, gradients; verdicts
    where the issue sets a target (time: checkpoint and ALF; peak: the memory-saving modes;
    gradients: every odeify mode), the figures alone for the others."""
    name, row = f"{r.model}, {r.row}", ALL_ROWS[r.row]
    memory_saving = row.integrator is not None and row.backward != "backprop"
    ratio, peak = statistics.median(round_ratios(r, eager)), r.peak / eager.peak
    beside = f", eager odeify backprop {backprop.peak / MB:.1f}" if backprop and memory_saving else ""
    lines = [
        f"{name}: step {r.time:.3f} s, eager {eager.time:.3f} s (per round {ratio:.2f}x"
        f"{judged('no slower', ratio <= 1, eager.row in TIMED_COMPILED)}); the first step "
        f"{r.first_step:.1f} s (eager's {eager.first_step:.1f} s)",
        f"{name}: step peak {r.peak / MB:.1f} MiB, eager {eager.peak / MB:.1f}{beside} ({peak:.2f}x "
        f"eager's{judged(f'its mode peak, <= {PEAK_TOLERANCE}x', peak <= PEAK_TOLERANCE, memory_saving)})",
        f"{name}: {r.recompiles} frames compiled after the first step "
        f"(target 0: {verdict(r.recompiles == 0)})",
    ]
    if not math.isnan(r.truth_error):
        accuracy = r.truth_error / r.backprop_truth_error
        odeify_row = row.integrator is not None
        lines.append(
            f"{name}: gradients {r.truth_error:.1e} from fp64, eager fp32 backprop "
            f"{r.backprop_truth_error:.1e} ({accuracy:.2f}x"
            f"{judged(f'<= {GRADIENT_FACTOR}x', accuracy <= GRADIENT_FACTOR, odeify_row)})"
        )
    return lines


def judged(target: str, met: bool, asked: bool) -> str:
    """'; target ...: met' after a figure where a target is ``asked`` for, else nothing."""
    return f"; target {target}: {verdict(met)}" if asked else ""


def _split_stage_rows(find) -> list[str]:
    """Issue 23's ViT rows: each memory-free row's saved bytes and step time beside both timm rows."""
    lines = []
    for model in SPLIT_MODELS:
        plain, checkpointed = find(model, "timm"), find(model, "timm + grad checkpointing")
        for row in ("odeify backprop", "odeify checkpoint", "odeify reverse", *REVERSIBLE_ROWS[:3]):
            mine = find(model, row)
            if mine and plain and checkpointed:
                lines.append(
                    f"{model}, {row} (split stages): saves {mine.saved / MB:.0f} MiB, timm "
                    f"{plain.saved / MB:.0f}, timm's checkpointing {checkpointed.saved / MB:.0f}; step time "
                    f"{mine.time / plain.time:.2f}x timm plain (CPU {mine.cpu_time / plain.cpu_time:.2f}x), "
                    f"timm's checkpointing {checkpointed.time / plain.time:.2f}x"
                )
    return lines


def _alf_against_heun(find) -> list[str]:
    """ALF's targets against reversible Heun: no slower at 4x steps; saved bytes no more, at any depth."""
    lines = []
    for model in MODELS:
        deep_alf, deep_heun = (
            find(model, "odeify reversible ALF", "x4"),
            find(model, "odeify reversible", "x4"),
        )
        if deep_alf and deep_heun:
            ratio = deep_alf.time / deep_heun.time
            lines.append(
                f"{model}, ALF at 4x steps: {ratio:.2f}x reversible Heun's step time (CPU time "
                f"{deep_alf.cpu_time / deep_heun.cpu_time:.2f}x; target <= 1: {verdict(ratio <= 1)})"
            )
        for steps in STEPS:
            alf, heun = find(model, "odeify reversible ALF", steps), find(model, "odeify reversible", steps)
            if alf and heun:
                lines.append(
                    f"{model}, ALF at {steps} steps: saves {alf.saved / MB:.0f} MiB, reversible Heun "
                    f"{heun.saved / MB:.0f} MiB (target: no more: {verdict(alf.saved <= heun.saved)})"
                )
    return lines


def profile_table(results: list[Result]) -> list[str]:
    rows = [r for r in results if r.profile]
    if not rows:
        return []
    keys = list(rows[0].profile)
    lines = [
        "## Where the time goes",
        "",
        "One more step of each row below under `torch.profiler` (resnet50, native steps), in seconds:",
        "self times of the tensor ops on the calling thread, grouped; 'outside tensor ops' is the",
        "step's wall time minus all tensor ops' self time (Python, autograd bookkeeping, waiting for",
        "a busy CPU). The last three columns are inclusive times of regions (they overlap the op",
        "columns): the stages' autograd Functions and the checkpointed segments. The profiler itself",
        "slows each op a little.",
        "",
        *markdown_table(["row", *keys], ([r.row, *(f"{r.profile[k]:.2f}" for k in keys)] for r in rows), 1),
        "",
    ]
    return lines


NOTES = """Reading the numbers:

- What each odeify row keeps between forward and backward: the input image (the first segment's
  input), every segment's input (the output of the stage before it), and per stage what its
  mode keeps: checkpoint every step's state; reverse the stage input (its output is kept by the
  next segment); reversible its output's lattice residual (int8 counts) and z - y (int32
  counts), 1.25 fp32 states beside the output. odeify backprop keeps every activation of the
  converted model, which has BatchNorm folded (timm's model keeps BN's inputs too).
- reverse cannot rebuild the states of a ReLU ResNet with Euler steps (stepping Euler backward
  through a kink is not an inverse): its passes fall back to exact checkpointing from the stage
  input ('fallbacks'), which is why its gradients are exact and its time includes the failed
  attempt. The bytes saved are the same either way: the fallback's states live during backward
  only (the step peak shows them).
- reversible Heun evaluates the field twice per step. On the default piecewise-constant weight
  path the two evaluations at a step boundary use different knots, so a native-depth stage costs
  twice the blocks' convolutions in forward, and again in backward; on a linear path consecutive
  steps share one evaluation (steps + 1 per stage).
- Why reversible misses the 1.8x time target at native steps: on the default piecewise-constant
  path a step evaluates the field twice in forward, and backward evaluates each again with grad
  and takes its vector-Jacobian product (about two evaluations' work): 8 block evaluations' work
  per block against timm's 3 (forward 1, backward 2), 2.7x on the stages before any overhead. On
  a linear path consecutive steps share one evaluation: 4 against 3 (1.33x), plus the lattice's
  float64 arithmetic (the profile's 'lattice arithmetic', where --profile gives one) and the
  segments' recompute.
- resnet152's random-weight layer3 (35 blocks, so 35 reversible-Heun steps of size 1) grows the
  reversible state to 2^40 times its input at native steps, past the lattice's exact range (2^26
  for fp32 inputs): those passes fall back to recomputing the states from the stage input, exactly
  and with the same saved bytes ('fallbacks': 5 of 20), which adds to their time.
- Step times come from a shared 2-core machine; the load average at the start of the run is
  recorded below. Ratios to timm plain are from the same run, the rows of one model and steps
  stepping in turns, so a change of the machine's speed moves them alike (the 4x rows' ratios to
  timm plain are across two such groups); CPU-time ratios are less sensitive to other processes
  than wall-time ratios."""


COMPILED_NOTE = """Each compiled row beside the eager row it compiles, from the table above.
'compiled vs eager': the median (and range) of the two rows' step-time ratios round by round, each
pairing steps taken moments apart. 'first step s' is the compiled row's first step, its cold
compile included (an empty inductor cache per process); 'compile s' that first step less its median
step. The peaks are the CPU allocator's (every storage a step allocates, a compiled graph's buffers
included; not odeify.inspection.TensorPeak, under whose dispatch mode dynamo runs the model
eagerly) and, where given, the RSS peak of a fresh process that hands freed blocks back at once.
'recompiles': frames dynamo compiled after the first step, over all later steps of the row's
process."""


def compiled_section(results: list[Result]) -> list[str]:
    """The compiled rows beside their eager twins, when the run has any."""
    pairs = compiled_pairs(results)
    if not pairs:
        return []
    table = markdown_table(COMPILED_HEADERS, (compiled_cells(e, r) for e, r in pairs), text_columns=3)
    return ["## Compiled rows", "", COMPILED_NOTE, "", *table, ""]


def markdown(
    results: list[Result],
    args: argparse.Namespace,
    command: str,
    png: str,
    load_before: str,
    failures: list[str],
) -> str:
    weakened = weights_phrase(args.weights)
    lines = [
        "# Whole-model training step: timm against odeify's backward modes",
        "",
        f"Random-weight timm models (non-zero branches, randomised BN statistics{weakened}), batch "
        f"{args.batch} of {args.img_size}x{args.img_size} images, fp32, cross-entropy, CPU. One process "
        "per configuration, those of one model and steps alive together; 'step s' is the median wall "
        f"time of {args.repeats} steps ({args.repeats_x4} at 4x steps) after a first and a measured step, "
        "taken in turns (every round steps each configuration of the model and steps once). See the "
        "script's docstring for the columns.",
        "",
        *markdown_table(HEADERS, (cells(r, results) for r in results), text_columns=3),
        "",
        *compiled_section(results),
        *(bullets("Failed configurations:", failures) if failures else []),
        *bullets("Targets:", targets(results)),
        *profile_table(results),
        NOTES,
        "",
        f"![step peak and step time per row]({png})",
        "",
        *provenance(
            command, f"{describe_machine()}; load average (1, 5, 15 min) at the start: {load_before}"
        ),
    ]
    return "\n".join(lines)


def plot(results: list[Result], path: Path, batch: int, size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in results))
    fig, axes = plt.subplots(2, len(models), figsize=(7 * len(models), 8), squeeze=False)
    for column, model in enumerate(models):
        mine = [r for r in results if r.model == model]
        base = baseline(mine[0], results)
        rows = list(dict.fromkeys(r.row for r in mine))
        for k, steps in enumerate(STEPS):
            found = {r.row: r for r in mine if r.steps == steps}
            if not found:
                continue
            positions = [i + 0.4 * k for i, row in enumerate(rows) if row in found]
            label = f"{steps} steps" if k else "native steps (timm: its model)"
            shown = [found[row] for row in rows if row in found]
            axes[0][column].bar(positions, [r.peak / MB for r in shown], 0.4, label=label)
            spread = [
                [(r.time - min(r.times)) / base.time for r in shown],
                [(max(r.times) - r.time) / base.time for r in shown],
            ]
            axes[1][column].bar(positions, [r.time / base.time for r in shown], 0.4, yerr=spread, label=label)
        for ax, ylabel in (
            (axes[0][column], "step peak, CPU allocator (MiB)"),
            (axes[1][column], "step time / timm plain"),
        ):
            ax.set_xticks([i + 0.2 for i in range(len(rows))])
            ax.set_xticklabels(rows, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_title(model)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0][column].legend(fontsize=8)
        axes[1][column].axhline(1.8, color="gray", linestyle="--", linewidth=1)
    fig.suptitle(f"one training step, batch {batch}, {size}x{size}, fp32, CPU")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="compiled rows beside eager ones: python benchmarks/train_step.py --models resnet18 "
        "--batch 8 --img-size 160 --steps native --rows timm 'timm + torch.compile' 'odeify checkpoint' "
        "'odeify checkpoint + torch.compile' --repeats 7",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODEL_CHOICES,
        default=MODELS,
        help=f"models to run (default: the ResNets; {VIT}, {SWIN}: a ViT and a Swin, split stages)",
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=list(ALL_ROWS),
        default=list(ROWS),
        metavar="ROW",
        help=f"ways to train (default: every eager one: {', '.join(map(repr, ROWS))}); a row's name "
        f"with '{COMPILED}' or '{NO_LAYOUT}' appended compiles it",
    )
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=STEPS, help="manifestations")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps at native steps (median)")
    parser.add_argument("--repeats-x4", type=int, default=1, help="timed steps at 4x steps (median)")
    parser.add_argument(
        "--every-deep",
        action="store_true",
        help="every odeify row at 4x steps on every model (default: resnet152 only reverse and reversible)",
    )
    parser.add_argument("--profile", action="store_true", help="add a profile of resnet50's native rows")
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="random",
        help="random: make_test_model's, every branch at full strength (default); trained-like: "
        "residual branches' last-norm gains scaled to a trained network's strength",
    )
    parser.add_argument("--batch", type=int, default=BATCH, help=f"images per step (default {BATCH})")
    parser.add_argument("--img-size", type=int, default=SIZE, help=f"image side in pixels (default {SIZE})")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per process (default: torch's own choice)"
    )
    parser.add_argument(
        "--rss-peak",
        action="store_true",
        help="also each row's RSS peak, in one more fresh process per row (compiled rows compile again)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "train_step.md", help="Markdown record")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODEL_CHOICES, help=argparse.SUPPRESS)
    parser.add_argument("--row", choices=list(ALL_ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=["time", "rss"], default="time", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.steps = args.steps[0] if isinstance(args.steps, list) else args.steps
        child(args)
        return 0
    if min(args.repeats, args.repeats_x4, args.batch, args.img_size) < 1 or args.threads < 0:
        parser.error("--repeats, --repeats-x4, --batch and --img-size must be at least 1; --threads >= 0")
    if "timm" not in args.rows:
        parser.error("the ratios need the 'timm' row")
    if args.threads:
        torch.set_num_threads(args.threads)  # the results file's machine line names the children's
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    start = time.perf_counter()
    options = [
        "--weights", args.weights, "--batch", str(args.batch), "--img-size", str(args.img_size),
        "--threads", str(args.threads),
    ]  # fmt: skip
    results: list[Result] = []
    failures: list[str] = []
    repeats = {"native": args.repeats, "x4": args.repeats_x4}
    configs = configurations(args.models, args.rows, args.steps, args.every_deep)
    profiled = {
        (model, row, steps)
        for model, row, steps in configs
        if args.profile and model == "resnet50" and steps == "native" and row in PROFILED
    }
    for group in groups(configs):
        done, failed = measure_together(group, repeats, profiled, options)
        results += done
        failures += failed + (add_rss_peaks(done, options) if args.rss_peak else [])
        for r in done:
            print(
                f"  {r.model} {r.row:48s} {r.steps:6s} {r.peak / MB:7.1f} MiB {r.time:7.3f} s",
                file=sys.stderr,
                flush=True,
            )
    order = {config: i for i, config in enumerate(configs)}
    results.sort(key=lambda r: order[(r.model, r.row, r.steps)])

    rows = (cells(r, results) for r in results)
    print_table("one training step", "; ".join(targets(results)), HEADERS, rows, text_columns=3, width=200)

    command = command_line(__file__, argv)
    png = args.output.with_suffix(".png")
    text = markdown(results, args, command, png.name, load_before, failures)
    write_results(args.output, text)
    plot(results, png, args.batch, args.img_size)
    print(f"wrote {png}; {time.perf_counter() - start:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
