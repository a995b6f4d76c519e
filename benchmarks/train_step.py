"""Benchmark: one whole-model training step, timm against odeify's backward modes.

resnet50 and resnet152 with random non-trivial weights (``make_test_model``: no zero-initialised
branches, randomised BN statistics), a batch of 8 224x224 images, fp32, cross-entropy, on the CPU.
Rows: timm plain and with ``set_grad_checkpointing(True)`` (both in train mode, as a user trains),
and the converted model trained with backprop / checkpoint / reverse (Euler) and reversible:
reversible Heun (on the default piecewise-constant weight path, and on a linear one, where
consecutive steps share a field evaluation) and ALF (MALI's asynchronous leapfrog: one evaluation
per step, strictly inside it; v_0 = 0, the default, and v_0 = F(t_0, z_0), one more evaluation per
stage), at native steps and at 4x steps. The memory-free modes run with the whole-model memory
plan: the parts between stages are checkpointed (``odeify.passes.segments``).

Each configuration runs in a fresh process: build and convert, a warm-up step (builds the step
graphs, allocates the gradients), one measured step; then ``--repeats`` timed steps, taken in turns
with the other configurations of its model and steps, whose processes are alive together (each
round steps every one of them once, in order). A change of the machine's speed during the run then
moves timm plain's steps and the other rows' alike: one process after another, timm plain's own
median moved 1.67 -> 2.19 s on resnet50 between two runs 16 minutes apart on the shared 2-core
machine, and its ratios with it. Columns:

- saved: bytes autograd saves for backward during the forward, once per storage, parameters
  excluded (``benchmarks/memory.py``);
- RSS growth: the process's peak resident memory during the measured step over its resident
  memory before it;
- step time: median wall time of the timed steps (spread: the fastest and the slowest of them), as
  a ratio to timm plain on the same model in the same run (and the same for process CPU time, less
  sensitive to a busy machine);
- grad err: relative error of all parameter gradients (one vector) against backprop of the same
  manifestation (same integrator, basis and steps), computed in the same process after timing;
- fp32 band (reversible rows, native steps): that backprop run on one thread against itself on
  all threads: how far apart two correct fp32 gradients of this model already are;
- vs fp64, backprop vs fp64 (the same rows): this row's gradients and fp32 backprop's against
  backprop of the same model in float64 (the exact gradient, to round-off): whether the memory-free
  gradient is as accurate as the one the user would otherwise get;
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
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from child import SteppedChild, report_to_parent, requests
from machine import command_line, describe_machine, provenance, save_figure, write_results
from memory import SavedBytes, reset_peak_rss, rss
from tables import bullets, markdown_table, print_table
from torch import nn

import odeify
from odeify.models._testing import make_test_model
from odeify.numerics.schemes import AsyncLeapfrog
from odeify.passes.segments import has_segments

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ["resnet50", "resnet152"]
VIT = "vit_small_patch16_224"
SWIN = "swin_tiny_patch4_window7_224"
MODEL_CHOICES = [*MODELS, VIT, SWIN]
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
    rss_growth: int
    warmup: float
    times: list[float]
    cpu_times: list[float]
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


def build(model_name: str, row: Row, steps: str, weights: str = "random") -> nn.Module:
    model = make_test_model(model_name)
    if weights == "trained-like":
        _weaken_branches(model, TRAINED_LIKE_BRANCH_SCALE)
    return as_row(model, row, steps)


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
    row = ROWS[args.row]
    model = build(args.model, row, args.steps, args.weights)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=g)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
    saved = SavedBytes(model.parameters())

    def step(count: bool = False, inputs: torch.Tensor = x) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), time.process_time()
        with saved.counting() if count else contextlib.nullcontext():
            loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        return time.perf_counter() - wall, time.process_time() - cpu

    warnings.filterwarnings("ignore", "odeify: stage", RuntimeWarning)  # fallbacks are counted below
    warmup, _ = step()
    before = rss("VmRSS")
    reset_peak_rss()
    step(count=True)
    growth = rss("VmHWM") - before
    report_to_parent({"ready": True})
    timings = []
    for _ in requests():  # the parent's turns: one timed step each
        timings.append(step())
        report_to_parent({"wall": timings[-1][0]})
    stages = odeify.converted_stages(model) if row.integrator else []
    result = Result(
        model=args.model,
        row=args.row,
        steps=args.steps,
        saved=saved.total,
        rss_growth=growth,
        warmup=warmup,
        times=[t for t, _ in timings],
        cpu_times=[c for _, c in timings],
        fallbacks=sum(s.adjoint_stats.fallbacks for s in stages),
        passes=sum(s.adjoint_stats.backward_passes for s in stages),
    )
    if args.profile:
        result.profile = profile(step)
    if row.integrator and row.backward != "backprop":
        got = [p.grad.detach().clone() for p in model.parameters()]
        odeify.set_backward(model, "backprop")  # in place; inlines the segments too
        step()
        want = [p.grad.detach().clone() for p in model.parameters()]
        result.grad_error = relative_error(got, want)
        if row.backward == "reversible" and args.steps == "native":
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # other kernels, other summation order: fp32's own spread
            step()
            torch.set_num_threads(threads)
            result.band = relative_error([p.grad for p in model.parameters()], want)
            model.double()  # the exact gradient, to round-off: both fp32 methods measured against it
            step(inputs=x.double())
            truth = [p.grad.detach() for p in model.parameters()]
            result.truth_error = relative_error(got, truth)
            result.backprop_truth_error = relative_error(want, truth)
    report_to_parent(result)


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
    group: list[Configuration], repeats: dict[str, int], profiled: set[Configuration], weights: str
) -> tuple[list[Result], list[str]]:
    """Run ``group``'s configurations in fresh processes that are alive together, and read their results.

    Each process is built, warmed up and measured (saved bytes, RSS growth) while the others wait;
    then the timed steps go round: every round steps each configuration once, in order. Returns the
    results in ``group``'s order and one line per configuration that failed (the others go on).
    """
    children: dict[Configuration, SteppedChild] = {}
    failures: list[str] = []

    def failed(config: Configuration, error: RuntimeError) -> None:
        failures.append(str(error).splitlines()[0] + " " + str(error).splitlines()[-1])
        print(f"  {failures[-1]}", file=sys.stderr, flush=True)
        children.pop(config, None)

    for config in group:
        model, row, steps = config
        arguments = [
            "--model", model, "--row", row, "--steps", steps, "--weights", weights,
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
            for s in steps if ROWS[row].integrator else ["native"]:
                if model in SPLIT_MODELS and row == "odeify reversible ALF, v0 = F(t0, z0)":
                    continue
                if s == "native" or every_deep or model == MODELS[0] or row in FLAT_ROWS:
                    chosen.append((model, row, s))
    return chosen


# -- reporting ------------------------------------------------------------------------------------
HEADERS = (
    "model", "row", "steps", "saved MiB", "saved vs timm", "RSS growth MiB", "step s",
    "spread s", "time vs timm", "CPU time vs timm", "grad err", "fp32 band", "vs fp64", "backprop vs fp64",
    "fallbacks",
)  # fmt: skip


def baseline(result: Result, results: list[Result]) -> Result:
    return next(r for r in results if r.model == result.model and r.row == "timm")


def cells(r: Result, results: list[Result]) -> tuple[str, ...]:
    base = baseline(r, results)
    return (
        r.model,
        r.row,
        r.steps if ROWS[r.row].integrator else "-",
        f"{r.saved / MB:.0f}",
        f"{r.saved / base.saved:.2f}",
        f"{r.rss_growth / MB:.0f}",
        f"{r.time:.2f}",
        f"{min(r.times):.2f}..{max(r.times):.2f}",
        f"{r.time / base.time:.2f}x",
        f"{r.cpu_time / base.cpu_time:.2f}x",
        "-" if math.isnan(r.grad_error) else f"{r.grad_error:.1e}",
        "-" if math.isnan(r.band) else f"{r.band:.1e}",
        "-" if math.isnan(r.truth_error) else f"{r.truth_error:.1e}",
        "-" if math.isnan(r.backprop_truth_error) else f"{r.backprop_truth_error:.1e}",
        f"{r.fallbacks}/{r.passes}" if r.passes else "-",
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
        if not math.isnan(r.truth_error):
            ratio = r.truth_error / r.backprop_truth_error
            lines.append(
                f"{r.model}, {r.row}: gradients {r.truth_error:.1e} from fp64 backprop, fp32 backprop "
                f"{r.backprop_truth_error:.1e} (ratio {ratio:.2f})"
            )
    return lines


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
  only (the RSS growth shows them).
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


def markdown(
    results: list[Result],
    command: str,
    repeats: tuple[int, int],
    png: str,
    load_before: str,
    failures: list[str],
    weights: str = "random",
) -> str:
    weakened = weights_phrase(weights)
    lines = [
        "# Whole-model training step: timm against odeify's backward modes",
        "",
        f"Random-weight timm models (non-zero branches, randomised BN statistics{weakened}), batch "
        f"{BATCH} of {SIZE}x{SIZE} images, fp32, cross-entropy, CPU. One process per configuration, "
        "those of one model and steps alive together; 'step s' is the median wall time of "
        f"{repeats[0]} steps ({repeats[1]} at 4x steps) after a warm-up and a measured step, taken in "
        "turns (every round steps each configuration of the model and steps once). See the script's "
        "docstring for the columns.",
        "",
        *markdown_table(HEADERS, (cells(r, results) for r in results), text_columns=3),
        "",
        *(bullets("Failed configurations:", failures) if failures else []),
        *bullets("Targets:", targets(results)),
        *profile_table(results),
        NOTES,
        "",
        f"![saved bytes and step time per row]({png})",
        "",
        *provenance(
            command, f"{describe_machine()}; load average (1, 5, 15 min) at the start: {load_before}"
        ),
    ]
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
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
            positions = [i + 0.4 * k for i, row in enumerate(rows) if row in found]
            label = f"{steps} steps" if k else "native steps (timm: its model)"
            axes[0][column].bar(
                positions, [found[row].saved / MB for row in rows if row in found], 0.4, label=label
            )
            axes[1][column].bar(
                positions, [found[row].time / base.time for row in rows if row in found], 0.4, label=label
            )
        for ax, ylabel in (
            (axes[0][column], "saved for backward (MiB)"),
            (axes[1][column], "step time / timm plain"),
        ):
            ax.set_xticks([i + 0.2 for i in range(len(rows))])
            ax.set_xticklabels(rows, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_title(model)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0][column].legend(fontsize=8)
        axes[1][column].axhline(1.8, color="gray", linestyle="--", linewidth=1)
    fig.suptitle(f"one training step, batch {BATCH}, {SIZE}x{SIZE}, fp32, CPU")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODEL_CHOICES,
        default=MODELS,
        help=f"models to run (default: the ResNets; {VIT}, {SWIN}: a ViT and a Swin, split stages)",
    )
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="ways to train")
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
    parser.add_argument("--output", type=Path, default=RESULTS / "train_step.md", help="Markdown record")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODEL_CHOICES, help=argparse.SUPPRESS)
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.steps = args.steps[0] if isinstance(args.steps, list) else args.steps
        child(args)
        return 0
    if min(args.repeats, args.repeats_x4) < 1:
        parser.error("--repeats and --repeats-x4 must be at least 1")
    if "timm" not in args.rows:
        parser.error("the ratios need the 'timm' row")
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    start = time.perf_counter()
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
        done, failed = measure_together(group, repeats, profiled, args.weights)
        results += done
        failures += failed
        for r in done:
            print(
                f"  {r.model} {r.row:32s} {r.steps:6s} {r.saved / MB:7.0f} MiB {r.time:7.1f} s",
                file=sys.stderr,
                flush=True,
            )
    order = {config: i for i, config in enumerate(configs)}
    results.sort(key=lambda r: order[(r.model, r.row, r.steps)])

    rows = (cells(r, results) for r in results)
    print_table("one training step", "; ".join(targets(results)), HEADERS, rows, text_columns=3, width=200)

    command = command_line(__file__, argv)
    png = args.output.with_suffix(".png")
    counts = (args.repeats, args.repeats_x4)
    text = markdown(results, command, counts, png.name, load_before, failures, args.weights)
    write_results(args.output, text)
    plot(results, png)
    print(f"wrote {png}; {time.perf_counter() - start:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
