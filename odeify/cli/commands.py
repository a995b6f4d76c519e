"""What the ``odeify`` commands but finetune do (:mod:`odeify.cli.finetune_command`), once
:mod:`odeify.cli.parser` has parsed their arguments: the library calls, and what they print.

Each ``run_<command>(args)`` returns the exit code. Bad input raises an ``OdeifyError`` subclass
(the CLI prints it as one paragraph, exit code 2). Results go to stdout; tables, progress and
notes go to stderr whenever stdout carries JSON or code. MODEL and its flags are read by
:mod:`odeify.cli.model_flags`, output paths checked by :mod:`odeify.cli.outputs`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn

import odeify
from odeify.cli.calibration import calibrate_with_flags
from odeify.cli.console import note, tables
from odeify.cli.eval_flags import chosen_device, require_data, val_batches
from odeify.cli.model_flags import (
    convert_source,
    in_manifestation,
    leaf_modules,
    load_or_convert,
    manifestation,
    model_source,
    random_timm_weights,
    source_model,
)
from odeify.cli.outputs import checked_output_file, distinct_outputs
from odeify.cli.retarget_report import retarget_changes
from odeify.compiler.verification import VERIFY_SEED, VerificationError
from odeify.core.errors import ConfigError
from odeify.core.fileio import atomic_write_bytes
from odeify.models.inert_scales import TINY_SCALE, inert_scales
from odeify.serialization.io import is_converted_file

if TYPE_CHECKING:
    from odeify.inspection.report import ConversionReport


# -- inspect ---------------------------------------------------------------------------------------
def run_inspect(args: argparse.Namespace) -> int:
    """Plan of a MODEL, or stages of a CONVERTED file; --code, --dot, --json, --plot."""
    converted = is_converted_file(model_source(args))
    dot = checked_output_file(args.dot, "--dot", args)
    plot = checked_output_file(args.plot, "--plot", args)
    also = dot.with_name(f"{dot.stem}.converted{dot.suffix or '.dot'}") if dot and not converted else None
    distinct_outputs(("--dot", dot), ("--plot", plot), ("--dot's converted graph", also))
    if also is not None:
        checked_output_file(str(also), "--dot's converted graph", args)
    if converted:
        path = model_source(args)
        return _inspect_converted(args, odeify.load(path, verify=args.verify), Path(path).name, dot, plot)
    return _inspect_source(args, dot, plot)


def _inspect_source(args: argparse.Namespace, dot: Path | None, plot: Path | None) -> int:
    from odeify.compiler.analysis import analyze_graph, trace_and_annotate
    from odeify.inspection.dot import plan_to_dot
    from odeify.inspection.report import format_discrete_table, format_plan_table

    model, name, shape = source_model(args)
    leaves = leaf_modules(model, args.leaf)
    with torch.no_grad():
        gm = trace_and_annotate(model, shape, leaves)
    plan = analyze_graph(gm, name, shape)
    converted = None
    if dot or plot or args.code:
        converted = odeify.convert(model, input_size=shape, leaf_modules=leaves, verify=args.verify)
    if dot:
        atomic_write_bytes(dot, plan_to_dot(gm, plan).encode())
        converted_dot = dot.with_name(f"{dot.stem}.converted{dot.suffix or '.dot'}")
        _write_converted_dot(converted, name, converted_dot)
        note(
            f"wrote {dot} (traced graph) and {converted_dot} (converted); "
            f"render with: dot -Tsvg {dot} -o graph.svg"
        )
    if plot:
        _plot_weight_path(converted, name, plot)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    console = tables(args)
    console.print(format_plan_table(plan))
    if plan.discrete:
        console.print(format_discrete_table(plan))
    if args.code:
        print(_code_listing(converted))
    return 0


def _inspect_converted(
    args: argparse.Namespace, model: fx.GraphModule, name: str, dot: Path | None, plot: Path | None
) -> int:
    from odeify.inspection.report import describe, format_report_table

    report = describe(model, name=name)
    if dot:
        _write_converted_dot(model, name, dot)
        note(f"wrote {dot}; render with: dot -Tsvg {dot} -o graph.svg")
    if plot:
        _plot_weight_path(model, name, plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    tables(args).print(format_report_table(report))
    if args.code:
        print(_code_listing(model))
    return 0


def _write_converted_dot(model: fx.GraphModule, name: str, path: Path) -> None:
    from odeify.inspection.dot import converted_to_dot

    atomic_write_bytes(path, converted_to_dot(model, name).encode())


def _plot_weight_path(model: fx.GraphModule, name: str, path: Path) -> None:
    from odeify.inspection.plots import plot_weight_path

    plot_weight_path(model, path, title=f"{name}: weight path over depth")
    note(f"wrote {path}")


def _code_listing(model: fx.GraphModule) -> str:
    """The converted model's forward as Python: inlined stages in its code, the others' steps after it."""
    return odeify.model_code(model)


# -- convert, retarget -----------------------------------------------------------------------------
def run_convert(args: argparse.Namespace) -> int:
    """Convert (the library checks the native conversion against the source), save, report; a failed
    check still saves and reports the model, then exits with 1."""
    from odeify.inspection.report import describe, format_report_table

    output = checked_output_file(args.output, "-o", args, model=True)
    model, name, _ = source_model(args)
    try:
        converted = convert_source(args, **manifestation(args))
    except VerificationError as failed:
        converted = failed.converted
    verification = converted.meta["odeify"]["verification"]
    check = verification.to_dict() if verification is not None else None
    if output is not None:
        odeify.save(converted, output)
    report = describe(converted, name=name)
    if args.json:
        out = report.to_dict()
        if check is not None:
            out["verify"] = check
        if output is not None:
            out["output"] = str(output)
        if args.code:
            out["code"] = _code_listing(converted)
        print(json.dumps(out, indent=2))
        _note_multiplier(report)
    else:
        console = tables(args)
        console.print(format_report_table(report))
        if args.code:
            print(_code_listing(converted))
    if check is not None:
        note(_verify_line(check))
        inert = inert_scales(model)
        if inert:
            note(_inert_note(inert, args))
    elif args.verify:
        note(f"verify: skipped: {converted.meta['odeify']['verification_skipped_because']}")
    note(f"wrote {output}" if output is not None else "not saved: pass -o FILE.safetensors to keep the model")
    if check is not None and not check["passed"]:
        note(
            f"odeify: verification failed: relative error {check['relative_error']:.3g} exceeds "
            f"its allowance {check['tolerance']:.3g}. Please report this model (the converted file was still "
            "written)."
        )
        return 1
    return 0


def _note_multiplier(report: ConversionReport) -> None:
    """What a whole-model depth multiplier became, where no table's caption says it."""
    if report.steps_multiplier is not None:
        note(report.steps_multiplier.line())


def _verify_line(check: dict[str, Any]) -> str:
    verdict = "ok" if check["passed"] else "FAILED"
    shape = "x".join(map(str, check["input_shape"]))
    return (
        f"verify: native manifestation vs the source on a random {shape} input (seed "
        f"{VERIFY_SEED}): max relative error {check['relative_error']:.3g} "
        f"(max |diff| {check['max_abs_diff']:.3g}; "
        f"allowance {check['tolerance']:.3g}, from the round-off): {verdict}"
    )


def _inert_note(inert: list[str], args: argparse.Namespace) -> str:
    """Name the source's parameters that silence residual branches: the check says little of those."""
    why = (
        "timm zero-initialises the last norm of each residual branch and starts LayerScales near 0 in "
        "a model built without weights"
        if random_timm_weights(args)
        else "a model trained briefly or not at all keeps timm's initialisation"
    )
    names = ", ".join(inert[:3]) + (f" and {len(inert) - 3} more" if len(inert) > 3 else "")
    return (
        f"note: {len(inert)} scale parameters of the source are zero or at most {TINY_SCALE:g} ({names}; "
        f"{why}): the residual branches they scale output almost nothing, so the check says little "
        "about those; pass --pretrained or a trained checkpoint for a real test."
    )


def run_retarget(args: argparse.Namespace) -> int:
    """Load a converted file, change its manifestation (calibrated with --calibrate DIR), save."""
    from odeify.inspection.report import describe, format_report_table

    output = checked_output_file(args.output, "-o", args, model=True)
    source = Path(args.model)
    if not is_converted_file(source):
        what = (
            "does not exist" if not source.exists() else "is not a converted model (no odeify recipe inside)"
        )
        raise ConfigError(
            f"{args.model} {what}. retarget takes a file written by `odeify convert -o`; to convert a "
            f"checkpoint with these settings use `odeify convert {args.model} -o OUT ...`."
        )
    settings = manifestation(args)
    if not settings:
        raise ConfigError(
            "retarget needs at least one of --integrator, --steps, --knots, --basis, --backward."
        )
    loaded = odeify.load(source, verify=args.verify)
    model = odeify.retarget(loaded, **settings)
    if args.calibrate is not None:
        model = calibrate_with_flags(model, args.calibrate, args)
    odeify.save(model, output)
    changes = retarget_changes(loaded, model, args.steps)
    report = describe(model, name=output.name)
    if args.json:
        stages = [c.to_dict() for c in changes]
        print(json.dumps({**report.to_dict(), "output": str(output), "changes": stages}, indent=2))
        _note_multiplier(report)
    else:
        tables(args).print(format_report_table(report))
    for change in changes:
        note(change.line())
        for warning in change.warnings:
            note(f"odeify: warning: {warning}")
    note(f"wrote {output} (from {source.name}; parameters {_parameters(loaded):,} -> {_parameters(model):,})")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    """Load a converted file, calibrate it on ``--data``, save it with ``-o``."""
    output = checked_output_file(args.output, "-o", args, model=True)
    if not is_converted_file(args.model):
        raise ConfigError(
            f"{args.model} is not a converted model file. calibrate takes a file written by `odeify "
            "convert -o` or `odeify retarget -o` at a coarser manifestation (fewer steps or knots)."
        )
    model = calibrate_with_flags(odeify.load(args.model, verify=args.verify), args.data, args)
    odeify.save(model, output)
    note(f"wrote {output} (from {Path(args.model).name})")
    return 0


def _parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- eval, sweep, plot -----------------------------------------------------------------------------
def run_eval(args: argparse.Namespace) -> int:
    """Accuracy, NFE and forward time per batch on the validation split."""
    from odeify.inspection.report import describe
    from odeify.train.evaluate import evaluate
    from odeify.train.progress import plural

    require_data(args.data, evaluation=True)
    model, name = in_manifestation(args)
    loader, read = val_batches(args, model)
    result = evaluate(model.to(chosen_device(args)), loader, max_batches=args.max_batches)
    report = describe(model)
    if args.steps is not None:  # what '--steps x0.25' became, as convert and retarget say it
        _note_multiplier(report)
    if args.json:
        print(json.dumps({"model": name, "data": args.data, "read": read, **result.to_dict()}, indent=2))
        return 0
    stages = ", ".join(
        f"{s.name}: {s.integrator} x{s.steps}, {plural(s.knots, 'knot')} {s.basis}" for s in report.stages
    )
    print(
        f"{name} on {read} ({result.samples} samples): accuracy {result.accuracy:.2%}, "
        f"loss {result.loss:.4f}, NFE {result.nfe} ({stages}), "
        f"{1000 * result.seconds_per_batch:.1f} ms per batch of {args.batch_size}"
    )
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    """Every (integrator, steps, knots): accuracy, NFE, time; markdown on stdout, PNG."""
    from odeify.inspection.plots import plot_sweep
    from odeify.train.sweep import sweep, sweep_markdown

    plot = checked_output_file(args.plot, "--plot", args)
    markdown = checked_output_file(args.markdown, "--markdown", args)
    distinct_outputs(("--plot", plot), ("--markdown", markdown))
    require_data(args.data, evaluation=True)
    model, name = load_or_convert(args)
    model = model.to(chosen_device(args))
    loader, _ = val_batches(args, model)
    points = sweep(
        model,
        lambda: loader,
        args.integrators,
        args.steps,
        args.knots,
        basis=args.basis,
        max_batches=args.max_batches,
    )
    lines = sweep_markdown(points)
    print("\n".join(lines))
    if markdown is not None:
        atomic_write_bytes(markdown, ("\n".join(lines) + "\n").encode())
    plot_sweep(points, plot, title=f"{name} on {args.data}: accuracy vs NFE (no fine-tuning)")
    note(f"wrote {plot}" + (f" and {markdown}" if markdown else ""))
    return 0


def run_plot(args: argparse.Namespace) -> int:
    """The weight path over depth of every stage, as a PNG."""
    output = checked_output_file(args.output, "-o", args)
    model, name = in_manifestation(args)
    _plot_weight_path(model, name, output)
    return 0


# -- demo ------------------------------------------------------------------------------------------
def run_demo(args: argparse.Namespace) -> int:
    from odeify.cli.demo import run_demo as demo

    report = demo(Path(args.out), epochs=args.epochs)
    print(f"wrote {report}")
    return 0
