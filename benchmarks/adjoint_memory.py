"""Benchmark: memory, time and gradient error of one training step per backward mode, vs depth.

The stage is resnet50's layer3 (5 bottleneck blocks) with random non-trivial weights, read with a
linear basis and refined to N knots and N steps (N = 8, 16, 32, 64), run on its native input for
224x224 images, (batch, 1024, 14, 14). Each (N, mode) trains one step (forward, backward of
<y, fixed cotangent>) in a fresh process, which reports

- bytes saved for backward: every tensor packed by ``saved_tensors_hooks`` during the forward,
  once per storage, parameter storages excluded (they exist anyway);
- peak RSS of the process during the step, and its growth over the RSS after setup (loading
  the stage, building its step graphs);
- step time (forward + backward), median of ``--repeats`` steps after the measured one;
- relative error of the knot gradient against backprop through the same integrator, in the
  same dtype and (fp32 runs) in float64, which shows how accurate the fp32 gradient can be;
- with ``--device cuda``: the step's peak GPU memory over what the stage and input occupy.

Modes: odeify's backprop / checkpoint / reverse (Euler) and reversible (reversible Heun and ALF,
each against backprop of the same integrator), ``torch.utils.checkpoint`` around each Euler step
of the unrolled stage, and torchdiffeq's ``odeint_adjoint`` (Euler, the same N-step grid, the same
field).
Writes benchmarks/results/adjoint_memory.md and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from baselines import torchdiffeq_euler_adjoint
from child import report_to_parent, run_child
from machine import command_line, describe_machine, provenance, save_figure, write_results
from memory import SavedBytes, reset_peak_rss, rss
from tables import bullets, markdown_table, print_table

import odeify
from odeify.codegen.emit import delta_graph
from odeify.models._testing import make_test_model
from odeify.runtime.reversible import compile_program

RESULTS = Path(__file__).resolve().parent / "results"
STAGE = "layer3"
CHANNELS = 1024
MODES = {  # name: (integrator, odeify backward mode or external method, reference mode)
    "backprop": ("euler", "backprop", "backprop"),
    "checkpoint": ("euler", "checkpoint", "backprop"),
    "reverse": ("euler", "reverse", "backprop"),
    "torch.utils.checkpoint": ("euler", "backprop", "backprop"),
    "torchdiffeq adjoint": ("euler", "backprop", "backprop"),
    "backprop (rev. Heun)": ("reversible_heun", "backprop", "backprop (rev. Heun)"),
    "reversible": ("reversible_heun", "reversible", "backprop (rev. Heun)"),
    "backprop (ALF)": ("alf", "backprop", "backprop (ALF)"),
    "reversible (ALF)": ("alf", "reversible", "backprop (ALF)"),
}
REVERSIBLE = {"reversible": "backprop (rev. Heun)", "reversible (ALF)": "backprop (ALF)"}
"""The reversible rows and the backprop each is measured against."""
NOTES = """Reading the numbers:

- 'saved' is the activation memory a mode keeps for backward: the input and output (reverse) or
  the output, its lattice residual (int8) and z - y (int32) (reversible: 2.25 fp32 states' bytes)
  at any N; every step's state (checkpoint, torch.utils.checkpoint); every intermediate (backprop).
- backprop runs the stage's unrolled graph, the one a converted model runs; on this continuous
  (linear) weight path reversible Heun shares one field evaluation between consecutive steps.
- The peaks also hold the knots and their gradients, which grow with the knot count (knots =
  steps here, 4.5 MB each): that is why the memory-free modes' peaks rise with N too. Re-run
  steps take only the knot rows they read, so backward builds no all-knot buffer per step.
- This test model (random weights, randomized BN statistics) is strongly expansive across the
  stage. Stepping Euler backward cannot rebuild its states, so `reverse` falls back to exact
  checkpointing on every pass (its time includes the failed attempt), and torchdiffeq's
  continuous adjoint, which integrates x backward with the same Euler steps, is far off
  (benchmarks/gradient_error.py measures it on trained fields: about 25% at 16 steps).
- reversible rebuilds every state bit for bit ('worst recon. err' is the gap between the rebuilt
  y_0 and z_0, which start equal). Its gradient still differs from fp32 backprop's because this
  stage's fp32 gradient is only accurate to about 1e-3 whichever way it is computed: see 'err vs
  fp64', where fp32 backprop errs as much. Against fp64 references, and on the well-conditioned
  stages of tests/test_adjoint.py, reversible agrees with backprop to round-off.
- Step times on a shared machine vary between runs; the load average is recorded below."""
FULL = {"batch": 8, "size": 14}
QUICK = {"batch": 2, "size": 14}


@dataclass
class Result:
    """One (steps, mode) measurement; memory in bytes, time in seconds."""

    steps: int
    mode: str
    saved: int
    peak_rss: int
    setup_rss: int
    time: float
    cpu_time: float
    fallbacks: int
    worst_error: float
    gpu_peak: int = 0
    grad_error: float = math.nan
    truth_error: float = math.nan
    thread_error: float = math.nan  # a reference mode against itself run on one thread


# -- the child: one training step in a fresh process ---------------------------------------------
def run_forward(stage: odeify.ODEStage, mode: str, x: torch.Tensor) -> torch.Tensor:
    """The stage's output, with the graph that ``mode`` keeps for backward."""
    if mode == "torch.utils.checkpoint":
        # each knot stack is unbound once and a step takes views of the rows it reads, so that a
        # step's backward does not build a gradient the size of the whole stack
        state, rows = stage.initial_state(x), [k.unbind(0) for k in stage.knot_tensors()]
        for n in range(stage.steps):
            graph = stage.step_graph(n)
            knots = [_stacked(r[graph.knot_window]) for r in rows]
            state = torch.utils.checkpoint.checkpoint(graph, *state, *knots, use_reentrant=False)
        return state[0]
    if mode == "torchdiffeq adjoint":
        return torchdiffeq_euler_adjoint(stage, x)
    return stage(x)


def _stacked(rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Knot rows as one stack: a view for a single row, a copy otherwise."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)


def build_graphs(stage: odeify.ODEStage) -> None:
    """Build (and cache) every graph the modes run: graph building is a one-time cost, not a step's."""
    stage.unrolled_graph()
    if stage.backward == "reversible":  # the field graphs its lattice program evaluates
        for t, left in compile_program(stage).field_times():
            delta_graph(stage, t, left)
        return
    for n in range(stage.steps):
        stage.step_graph(n)
        if stage.backward == "reverse":
            stage.step_graph(n, "reverse")


def child(args: argparse.Namespace) -> None:
    """Measure one training step of ``args.mode`` on the stage saved at ``args.stage``; print JSON."""
    integrator, backward, _ = MODES[args.mode]
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    stage = torch.load(args.stage, weights_only=False).to(device, dtype)
    stage.configure(integrator=integrator, backward=backward)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, CHANNELS, args.size, args.size, generator=g).relu().to(device, dtype)
    cotangent = torch.randn(x.shape, generator=g).to(device, dtype)
    cuda = device.type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    build_graphs(stage)
    saved = SavedBytes(stage.parameters())

    def train_step(measure: bool) -> tuple[float, float]:
        stage.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), time.process_time()
        with saved.counting() if measure else contextlib.nullcontext():
            y = run_forward(stage, args.mode, x)
        (y * cotangent).sum().backward()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - wall, time.process_time() - cpu

    setup_rss, setup_gpu = rss("VmRSS"), torch.cuda.memory_allocated(device) if cuda else 0
    reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    wall, cpu = train_step(measure=True)
    peak, gpu_peak = rss("VmHWM"), torch.cuda.max_memory_allocated(device) - setup_gpu if cuda else 0
    torch.save([p.grad.cpu() for p in stage.parameters()], args.grads)
    timings = [train_step(measure=False) for _ in range(args.repeats)] or [(wall, cpu)]
    stats = stage.adjoint_stats
    result = Result(
        steps=stage.steps,
        mode=args.mode,
        saved=saved.total,
        peak_rss=peak,
        setup_rss=setup_rss,
        time=statistics.median(t for t, _ in timings),
        cpu_time=statistics.median(c for _, c in timings),
        fallbacks=stats.fallbacks,
        worst_error=stats.worst_error,
        gpu_peak=gpu_peak,
    )
    report_to_parent(result)


# -- the parent: build stages, spawn children, compare gradients, report -------------------------
def build_stages(steps: list[int], folder: Path) -> dict[int, Path]:
    """resnet50's layer3 on a linear weight path, refined to N knots and N steps, saved per N."""
    gm = odeify.convert(make_test_model("resnet50"), input_size=(1, 3, 224, 224))
    gm = odeify.retarget(gm, basis="linear")
    paths = {}
    for n in steps:
        refined = odeify.retarget(gm, knots={STAGE: n}, steps={STAGE: n})
        stage = next(s for s in odeify.converted_stages(refined) if s.stage_name == STAGE).standalone()
        paths[n] = folder / f"stage{n}.pt"
        torch.save(stage, paths[n])
    return paths


def measure(path: Path, mode: str, sizes: dict, repeats: int, grads: Path) -> Result:
    arguments = [
        "--stage", str(path), "--mode", mode, "--grads", str(grads), "--batch", str(sizes["batch"]),
        "--size", str(sizes["size"]), "--repeats", str(repeats), "--device", sizes["device"],
        "--dtype", sizes["dtype"], "--threads", str(sizes.get("threads", 0)),
    ]  # fmt: skip
    return Result(**run_child(__file__, arguments, f"{mode} on {path.name}"))


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = sum(float((g.double() - w.double()).square().sum()) for g, w in zip(got, want, strict=True))
    norm = sum(float(w.double().square().sum()) for w in want)
    return math.sqrt(diff / norm)


def run_all(steps: list[int], modes: list[str], sizes: dict, repeats: int) -> list[Result]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = build_stages(steps, folder)
        for n in steps:
            files = {}
            for mode in modes:
                files[mode] = folder / f"grads_{n}_{len(files)}.pt"
                result = measure(paths[n], mode, sizes, repeats, files[mode])
                results.append(result)
                print(f"  N={n:3d} {mode:24s} {result.time:7.2f} s", file=sys.stderr, flush=True)
            # an fp32 run's references again in float64 (what fp32 round-off costs) and on one
            # thread (other kernels, other summation order: how reproducible the fp32 gradient is)
            truth, threads = {}, {}
            if sizes["dtype"] == "float32":
                for reference in dict.fromkeys(MODES[m][2] for m in modes):
                    truth[reference] = folder / f"truth_{n}_{len(truth)}.pt"
                    measure(paths[n], reference, {**sizes, "dtype": "float64"}, 0, truth[reference])
                    threads[reference] = folder / f"thread_{n}_{len(threads)}.pt"
                    measure(paths[n], reference, {**sizes, "threads": 1}, 0, threads[reference])
                    print(f"  N={n:3d} {reference} in float64 and on 1 thread", file=sys.stderr, flush=True)
            for result in (r for r in results if r.steps == n):
                reference = MODES[result.mode][2]
                got = torch.load(files[result.mode])
                if reference in files:
                    result.grad_error = relative_error(got, torch.load(files[reference]))
                if reference in truth:
                    result.truth_error = relative_error(got, torch.load(truth[reference]))
                if result.mode in threads:
                    result.thread_error = relative_error(torch.load(threads[result.mode]), got)
            for file in [*files.values(), *truth.values(), *threads.values()]:
                file.unlink()
            paths[n].unlink()
    return results


# -- reporting ------------------------------------------------------------------------------------
HEADERS = (
    "steps", "mode", "saved MB", "peak RSS MB", "RSS over setup MB", "step s",
    "vs backprop", "grad rel. err", "err vs fp64", "fallbacks", "worst recon. err",
)  # fmt: skip


def headers(results: list[Result]) -> tuple[str, ...]:
    gpu = any(r.gpu_peak for r in results)
    truth = any(not math.isnan(r.truth_error) for r in results)
    names = HEADERS[:3] + ("GPU peak MB",) * gpu + HEADERS[3:]
    return names if truth else tuple(h for h in names if h != "err vs fp64")


def cells(r: Result, results: list[Result]) -> tuple[str, ...]:
    base = next(x for x in results if x.steps == r.steps and x.mode == MODES[r.mode][2])
    mb = 2**20
    gpu = (f"{r.gpu_peak / mb:.0f}",) if any(x.gpu_peak for x in results) else ()
    truth = () if all(math.isnan(x.truth_error) for x in results) else (f"{r.truth_error:.1e}",)
    return (
        str(r.steps),
        r.mode,
        f"{r.saved / mb:.1f}",
        *gpu,
        f"{r.peak_rss / mb:.0f}",
        f"{(r.peak_rss - r.setup_rss) / mb:.0f}",
        f"{r.time:.2f}",
        f"{r.time / base.time:.2f}x",
        "-" if math.isnan(r.grad_error) or r.mode == base.mode else f"{r.grad_error:.1e}",
        *truth,
        str(r.fallbacks) if r.mode == "reverse" or r.mode in REVERSIBLE else "-",
        f"{r.worst_error:.1e}" if r.mode == "reverse" or r.mode in REVERSIBLE else "-",
    )


def targets(results: list[Result], dtype: str) -> list[str]:
    """The targets from the issue, each with what was measured."""

    def of(mode: str) -> list[Result]:
        return sorted((r for r in results if r.mode == mode), key=lambda r: r.steps)

    lines = []
    for mode in ("reverse", *REVERSIBLE, "backprop"):
        rows = of(mode)
        if len(rows) >= 2:
            growth = rows[-1].saved / rows[0].saved
            lines.append(
                f"{mode}: saved bytes x{growth:.2f} from {rows[0].steps} to {rows[-1].steps} steps"
                + (" (target: flat within 10%)" if mode != "backprop" else " (linear would be x"
                   f"{rows[-1].steps / rows[0].steps:.0f})")
            )  # fmt: skip
    for mode, reference in REVERSIBLE.items():
        lines += _reversible_targets(of(mode), of(reference), mode, dtype)
    errors = {r.steps: r.grad_error for r in of("torchdiffeq adjoint")}
    if errors:
        lines.append(
            "torchdiffeq adjoint (the continuous adjoint of this random-weight stage, no target): grad rel. "
            "error "
            + ", ".join(f"{e:.0%} at {n} steps" for n, e in sorted(errors.items()))
            + "; on the trained digits stage, benchmarks/results/gradient_error.md"
        )
    return lines


def _reversible_targets(rev: list[Result], base: list[Result], mode: str, dtype: str) -> list[str]:
    """A reversible row's gradient error (against its backprop, fp64 backprop, and fp32 backprop's own
    spread across threads) and step time against its backprop."""
    if not rev:
        return []
    worst = max(r.grad_error for r in rev)
    lines = [f"{mode}: worst grad rel. error {worst:.1e} vs {dtype} backprop (target <= 1e-5)"]
    floor = [r.truth_error for r in base if not math.isnan(r.truth_error)]
    if floor:
        mine = max(r.truth_error for r in rev)
        lines.append(
            f"against fp64 backprop: {mode} errs up to {mine:.1e}, fp32 backprop itself "
            f"{min(floor):.1e}..{max(floor):.1e}: the stage's fp32 gradient is only that accurate"
        )
    again = [r.thread_error for r in base if not math.isnan(r.thread_error)]
    if again:
        lines.append(
            f"fp32 {base[0].mode} on 1 thread differs from itself on {torch.get_num_threads()} threads by "
            f"{min(again):.1e}..{max(again):.1e}: no fp32 method can promise agreement beyond that here"
        )
    by_steps = {r.steps: r for r in base}
    ratios = [r.time / by_steps[r.steps].time for r in rev if r.steps in by_steps]
    if ratios:
        lines.append(
            f"{mode}: step time {min(ratios):.2f}x..{max(ratios):.2f}x {base[0].mode} (target <= 1.8x)"
        )
    return lines


def markdown(results: list[Result], command: str, sizes: dict, quick: bool, repeats: int, png: str) -> str:
    shape = f"({sizes['batch']}, {CHANNELS}, {sizes['size']}, {sizes['size']})"
    lines = [
        "# Backward modes: memory, time and gradient error vs depth",
        "",
        f"Stage: resnet50 `{STAGE}` (5 bottleneck blocks, random non-trivial weights, {sizes['dtype']})",
        f"on a linear weight path refined to N knots, N steps; input {shape} on {sizes['device']}"
        + (" (**--quick**: smaller batch than the full (8, 1024, 14, 14))" if quick else "")
        + ". One training step per (N, mode),",
        "each in a fresh process. 'saved' counts tensors packed for backward during the forward (once",
        "per storage, parameters excluded; torch.utils.checkpoint's inputs are packed too). 'peak RSS'",
        "is the process's peak resident",
        "memory (VmHWM) during the step, 'RSS over setup' its growth over the resident memory after",
        "loading the stage and building its step graphs. 'step s' is the median wall time of",
        f"{repeats} step(s) after the measured one (the first step also pays one-time allocator and",
        "kernel set-up); 'vs backprop' compares with backprop of the same integrator (Euler; reversible",
        "Heun or ALF for the reversible rows), and so does 'grad rel. err' (all knot gradients, one",
        "vector); 'err vs",
        "fp64' compares with that backprop run in float64 (fp32 runs only); the targets also compare",
        "fp32 backprop with itself run on one thread.",
        "",
        *markdown_table(headers(results), (cells(r, results) for r in results)),
        "",
        *bullets("Targets:", targets(results, sizes["dtype"])),
        NOTES,
        "",
        f"![saved bytes and step time vs steps]({png})",
        "",
        *provenance(command, describe_machine(sizes["device"])),
    ]
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, clock) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, mode in enumerate(dict.fromkeys(r.mode for r in results)):
        rows = sorted((r for r in results if r.mode == mode), key=lambda r: r.steps)
        steps = [r.steps for r in rows]
        style = {"marker": "os^vDx+"[i % 7], "linestyle": "-" if i % 2 == 0 else "--", "label": mode}
        mem.plot(steps, [r.saved / 2**20 for r in rows], **style)  # the flat modes overlap: markers differ
        clock.plot(steps, [r.time for r in rows], **style)
    for ax, label in ((mem, "saved for backward (MB)"), (clock, "forward + backward (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("steps (= knots)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    mem.legend(fontsize=8)
    fig.suptitle(f"resnet50 {STAGE} as an ODE stage: one training step per backward mode")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 16, 32, 64], help="knots = steps")
    parser.add_argument(
        "--batch", type=int, help=f"batch size (default {FULL['batch']}, --quick {QUICK['batch']})"
    )
    parser.add_argument(
        "--size", type=int, help="spatial size of the stage input (default 14: 224x224 images)"
    )
    parser.add_argument("--quick", action="store_true", help=f"smaller problem: batch {QUICK['batch']}")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="modes to run")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps after the measured one (median)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the step runs")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="stage precision")
    parser.add_argument("--output", type=Path, default=RESULTS / "adjoint_memory.md", help="Markdown record")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--grads", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    sizes.update({k: v for k, v in (("batch", args.batch), ("size", args.size)) if v is not None})
    sizes["device"], sizes["dtype"] = args.device, args.dtype
    if args.child:
        child(argparse.Namespace(**{**vars(args), **sizes}))
        return 0
    if any(n < 1 for n in args.steps) or args.repeats < 0:
        parser.error("--steps must be positive and --repeats >= 0")
    modes = [m for m in MODES if m in args.modes]
    needed = {MODES[m][2] for m in modes} - set(modes)
    if needed:
        parser.error(f"the gradient references {sorted(needed)} must be among --modes")

    start = time.perf_counter()
    results = run_all(sorted(args.steps), modes, sizes, args.repeats)
    caption = "; ".join(targets(results, sizes["dtype"]))
    rows = (cells(r, results) for r in results)
    print_table(
        f"backward modes on resnet50 {STAGE}", caption, headers(results), rows, text_columns=2, width=200
    )

    command = command_line(__file__, argv)
    png = args.output.with_suffix(".png")
    text = markdown(results, command, sizes, args.quick, args.repeats, png.name)
    write_results(args.output, text)
    plot(results, png)
    print(f"wrote {png}; {time.perf_counter() - start:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
