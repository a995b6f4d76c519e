"""What each ``odeify`` command does, once :mod:`odeify.cli.parser` has parsed its arguments.

Each ``run_<command>(args)`` returns the exit code. Bad input raises an ``OdeifyError`` subclass
(the CLI prints it as one paragraph, exit code 2). Results go to stdout; tables, progress and
notes go to stderr whenever stdout carries JSON or code.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

import odeify
from odeify.cli.calibration import calibrate_with_flags
from odeify.cli.console import console_on, stdout_is_data
from odeify.cli.data_flags import DATA_CONFIG_FLAGS, apply_data_config, check_size_flags, trace_size
from odeify.cli.retarget_report import retarget_changes
from odeify.compiler.verification import VERIFY_SEED, VerificationError
from odeify.core.errors import ConfigError, OdeifyError, did_you_mean
from odeify.core.fileio import atomic_write_bytes, read_header
from odeify.core.paths import MODEL_SUFFIX, output_file, output_folder, same_file
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models.data_config import TRAIN_AUGMENTATION_KEYS
from odeify.models.inert_scales import TINY_SCALE, inert_scales
from odeify.train.recipe import DEFAULT_RECIPE

MANIFESTATION = ("integrator", "steps", "knots", "basis", "backward")


# -- models in -------------------------------------------------------------------------------------
def _source(args: argparse.Namespace) -> str:
    return args.model or str(DEFAULT_MODEL_PATH)


_OWN_FLAGS = {"num_classes": "--num-classes", "pretrained": "--pretrained", "checkpoint_path": "--checkpoint"}
"""Constructor kwargs that --model-kwargs leaves to their own flags."""


def model_kwargs(items: list[str] | None) -> dict[str, Any]:
    """--model-kwargs as timm's train.py reads them: each VALUE a Python literal, else text."""
    kwargs: dict[str, Any] = {}
    for item in items or []:
        key, _, text = item.partition("=")
        if key in _OWN_FLAGS:
            raise ConfigError(f"--model-kwargs {item}: pass {key} as {_OWN_FLAGS[key]} instead.")
        if key in kwargs:
            raise ConfigError(f"--model-kwargs names {key} twice; give it once.")
        try:
            kwargs[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            kwargs[key] = text
    return kwargs


def _load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The model-building flags that were given, as ``odeify.load_model`` keywords."""
    kwargs: dict[str, Any] = model_kwargs(args.model_kwargs)
    for flag in ("arch", "num_classes", "checkpoint"):
        if getattr(args, flag) is not None:
            kwargs[flag] = getattr(args, flag)
    for flag in ("pretrained", "ema"):
        if getattr(args, flag):
            kwargs[flag] = True
    return kwargs


def is_converted_file(path: str | os.PathLike[str]) -> bool:
    """True for a file written by ``odeify.save`` (it carries odeify's recipe in its metadata)."""
    from odeify.serialization.io import RECIPE_KEY

    path = Path(path)
    if not path.is_file() or path.suffix != MODEL_SUFFIX:
        return False
    try:
        return RECIPE_KEY in read_header(path, OdeifyError, "a safetensors file").metadata
    except OdeifyError:  # not a readable safetensors file: load_model will say what is wrong with it
        return False


def _refuse_converted(args: argparse.Namespace) -> None:
    if is_converted_file(_source(args)):
        raise ConfigError(
            f"{args.model} is already a converted model. Use `odeify retarget {args.model} -o OUT ...` to "
            f"change its manifestation, or `odeify inspect {args.model}` to see it."
        )


def _source_model(args: argparse.Namespace) -> tuple[nn.Module, str, tuple[int, ...]]:
    """MODEL as a module, its display name and the validated example input shape."""
    from odeify.compiler.analysis import input_shape_for, resolve_model

    check_size_flags(args)
    _refuse_converted(args)
    with _seeded_random_weights(args):
        model, name = resolve_model(_source(args), **_load_kwargs(args))
    if not args.model:
        name = DEFAULT_MODEL_PATH.name
    return model, name, input_shape_for(model, trace_size(args, model))


def _convert_source(args: argparse.Namespace, **settings: Any) -> fx.GraphModule:
    """MODEL converted by name or path (so that the saved file can name its source), checked unless
    --no-verify, with the data-config flags over what MODEL records (also on a failed check's model)."""
    check_size_flags(args)
    _refuse_converted(args)
    source = _source_model(args)[0] if args.leaf or args.img_size is not None else None
    leaves = _leaf_modules(source, args.leaf) if source is not None and args.leaf else []
    from_file = args.model if args.model and os.path.lexists(args.model) else None
    try:
        with _seeded_random_weights(args):
            converted = odeify.convert(
                _source(args), input_size=trace_size(args, source), leaf_modules=leaves, verify=args.verify,
                **_load_kwargs(args), **settings,
            )  # fmt: skip
    except VerificationError as failed:
        apply_data_config(failed.converted, args, recorded=from_file)
        raise
    return apply_data_config(converted, args, recorded=from_file)


RANDOM_WEIGHTS_SEED = 0


@contextlib.contextmanager
def _seeded_random_weights(args: argparse.Namespace):
    """Random weights from one seed while a timm name without weights is built.

    Such a MODEL is built twice (the source whose inert scales convert names, and the one it converts,
    checks and saves); drawn from one seed they are the same network, so the note is about that one.
    """
    if not _random_timm_weights(args):
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_WEIGHTS_SEED)
        yield


def _leaf_modules(model: nn.Module, names: list[str]) -> list[type[nn.Module]]:
    """The module classes ``--leaf`` names, looked up among the classes the model uses."""
    classes = {}
    for module in model.modules():
        cls = type(module)
        classes[cls.__name__] = classes[f"{cls.__module__}.{cls.__qualname__}"] = cls
    unknown = [n for n in names if n not in classes]
    if unknown:
        hint = did_you_mean(unknown[0], classes)
        raise ConfigError(
            f"--leaf {unknown[0]}: the model has no module of that class.{hint} Name a class the model uses, "
            "as its class name (Bottleneck) or its full path (timm.models.resnet.Bottleneck)."
        )
    return [classes[n] for n in names]


def _manifestation(args: argparse.Namespace, without: tuple[str, ...] = ()) -> dict[str, Any]:
    """The manifestation flags that were given (None means: keep), except those ``without`` names."""
    given = {k: getattr(args, k) for k in MANIFESTATION if getattr(args, k, None) is not None}
    return {k: v for k, v in given.items() if k not in without}


def _loaded(args: argparse.Namespace) -> tuple[fx.GraphModule, str]:
    """CONVERTED as saved, or MODEL converted at native depth; and its display name."""
    source = _source(args)
    if is_converted_file(source):
        loaded = odeify.load(source, verify=args.verify)
        return apply_data_config(loaded, args, recorded=None), Path(source).name
    return _convert_source(args), Path(args.model).name if args.model else DEFAULT_MODEL_PATH.name


def _converted(args: argparse.Namespace) -> tuple[fx.GraphModule, str]:
    """:func:`_loaded`, in the manifestation the flags ask for."""
    model, name = _loaded(args)
    settings = _manifestation(args)
    return (odeify.retarget(model, **settings) if settings else model), name


def checked_output_file(
    path: str | None, what: str = "-o", args: argparse.Namespace | None = None, *, model: bool = False
) -> Path | None:
    """Check an output path before any work (:func:`odeify.core.paths.output_file`): not empty, not a
    folder, FIFO or device, its parent not a file, not one of the command's inputs; ``model``: a
    ``.safetensors`` file."""
    if path is None:
        return None
    inputs = _inputs(args) if args is not None else []
    return output_file(
        path, what, error=ConfigError, inputs=inputs, suffix=MODEL_SUFFIX if model else None,
        example="model.safetensors" if model else "out.png",
    )  # fmt: skip


def _inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The files the command reads (MODEL when it is a path, --checkpoint), as (label, path)."""
    found = []
    model = getattr(args, "model", None)
    if model and os.path.lexists(model):
        found.append(("MODEL", model))
    if getattr(args, "checkpoint", None):
        found.append(("--checkpoint", args.checkpoint))
    return found


def _distinct(*outputs: tuple[str, Path | None]) -> None:
    """Two outputs of one command must be two files (the second would replace the first)."""
    given = [(flag, path) for flag, path in outputs if path is not None]
    for i, (flag, path) in enumerate(given):
        for other, second in given[i + 1 :]:
            if same_file(path, second):
                raise ConfigError(f"{flag} and {other} name the same file {path}; name two files.")


def _tables(args: argparse.Namespace):
    """Where tables go: stdout, or stderr when stdout carries JSON or code."""
    return console_on(sys.stderr if stdout_is_data(args) else sys.stdout)


def _note(message: str) -> None:
    print(message, file=sys.stderr)


# -- inspect ---------------------------------------------------------------------------------------
def run_inspect(args: argparse.Namespace) -> int:
    """Plan of a MODEL, or stages of a CONVERTED file; --code, --dot, --json, --plot."""
    converted = is_converted_file(_source(args))
    dot = checked_output_file(args.dot, "--dot", args)
    plot = checked_output_file(args.plot, "--plot", args)
    also = dot.with_name(f"{dot.stem}.converted{dot.suffix or '.dot'}") if dot and not converted else None
    _distinct(("--dot", dot), ("--plot", plot), ("--dot's converted graph", also))
    if also is not None:
        checked_output_file(str(also), "--dot's converted graph", args)
    if converted:
        return _inspect_converted(
            args, odeify.load(_source(args), verify=args.verify), Path(_source(args)).name, dot, plot
        )
    return _inspect_source(args, dot, plot)


def _inspect_source(args: argparse.Namespace, dot: Path | None, plot: Path | None) -> int:
    from odeify.compiler.analysis import analyze_graph, trace_and_annotate
    from odeify.inspection.dot import plan_to_dot
    from odeify.inspection.report import format_discrete_table, format_plan_table

    model, name, shape = _source_model(args)
    leaves = _leaf_modules(model, args.leaf)
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
        _note(
            f"wrote {dot} (traced graph) and {converted_dot} (converted); "
            f"render with: dot -Tsvg {dot} -o graph.svg"
        )
    if plot:
        _plot_weight_path(converted, name, plot)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    console = _tables(args)
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
        _note(f"wrote {dot}; render with: dot -Tsvg {dot} -o graph.svg")
    if plot:
        _plot_weight_path(model, name, plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    _tables(args).print(format_report_table(report))
    if args.code:
        print(_code_listing(model))
    return 0


def _write_converted_dot(model: fx.GraphModule, name: str, path: Path) -> None:
    from odeify.inspection.dot import converted_to_dot

    atomic_write_bytes(path, converted_to_dot(model, name).encode())


def _plot_weight_path(model: fx.GraphModule, name: str, path: Path) -> None:
    from odeify.inspection.plots import plot_weight_path

    plot_weight_path(model, path, title=f"{name}: weight path over depth")
    _note(f"wrote {path}")


def _code_listing(model: fx.GraphModule) -> str:
    """The converted model's forward as Python: inlined stages in its code, the others' steps after it."""
    return odeify.model_code(model)


# -- convert, retarget -----------------------------------------------------------------------------
def run_convert(args: argparse.Namespace) -> int:
    """Convert (the library checks the native conversion against the source), save, report; a failed
    check still saves and reports the model, then exits with 1."""
    from odeify.inspection.report import describe, format_report_table

    output = checked_output_file(args.output, "-o", args, model=True)
    model, name, _ = _source_model(args)
    try:
        converted = _convert_source(args, **_manifestation(args))
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
    else:
        console = _tables(args)
        console.print(format_report_table(report))
        if args.code:
            print(_code_listing(converted))
    if check is not None:
        _note(_verify_line(check))
        inert = inert_scales(model)
        if inert:
            _note(_inert_note(inert, args))
    elif args.verify:
        _note(f"verify: skipped: {converted.meta['odeify']['verification_skipped_because']}")
    _note(
        f"wrote {output}" if output is not None else "not saved: pass -o FILE.safetensors to keep the model"
    )
    if check is not None and not check["passed"]:
        _note(
            f"odeify: verification failed: relative error {check['relative_error']:.3g} exceeds "
            f"{check['tolerance']:.0e}. Please report this model (the converted file was still written)."
        )
        return 1
    return 0


def _verify_line(check: dict[str, Any]) -> str:
    verdict = "ok" if check["passed"] else "FAILED"
    shape = "x".join(map(str, check["input_shape"]))
    return (
        f"verify: native manifestation vs the source on a random {shape} input (seed "
        f"{VERIFY_SEED}): max relative error {check['relative_error']:.3g} "
        f"(max |diff| {check['max_abs_diff']:.3g}; "
        f"tolerance {check['tolerance']:.0e}): {verdict}"
    )


def _inert_note(inert: list[str], args: argparse.Namespace) -> str:
    """Name the source's parameters that silence residual branches: the check says little of those."""
    why = (
        "timm zero-initialises the last norm of each residual branch and starts LayerScales near 0 in "
        "a model built without weights"
        if _random_timm_weights(args)
        else "a model trained briefly or not at all keeps timm's initialisation"
    )
    names = ", ".join(inert[:3]) + (f" and {len(inert) - 3} more" if len(inert) > 3 else "")
    return (
        f"note: {len(inert)} scale parameters of the source are zero or at most {TINY_SCALE:g} ({names}; "
        f"{why}): the residual branches they scale output almost nothing, so the check says little "
        "about those; pass --pretrained or a trained checkpoint for a real test."
    )


def _random_timm_weights(args: argparse.Namespace) -> bool:
    """True when MODEL was a timm name built without weights."""
    return bool(args.model) and not args.pretrained and not args.checkpoint and not Path(args.model).exists()


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
    settings = _manifestation(args)
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
    else:
        _tables(args).print(format_report_table(report))
    for change in changes:
        _note(change.line())
        for warning in change.warnings:
            _note(f"odeify: warning: {warning}")
    _note(
        f"wrote {output} (from {source.name}; parameters {_parameters(loaded):,} -> {_parameters(model):,})"
    )
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
    _note(f"wrote {output} (from {Path(args.model).name})")
    return 0


def _parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- eval, sweep, plot -----------------------------------------------------------------------------
def _check_device(name: str | None) -> None:
    """--device names a device this machine has."""
    if name is not None and name.startswith("cuda"):
        index = int(name.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s). Pass "
                "--device cpu, or leave --device out (CUDA when available, else the CPU)."
            )


def _device(args: argparse.Namespace) -> torch.device:
    """--device, else CUDA when available."""
    if args.device is not None:
        _check_device(args.device)
        return torch.device(args.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _require_data(spec: str | None) -> None:
    """--data is given and names a data set; checked before the model loads (seconds)."""
    from odeify.train.datasets import check_data_spec

    if spec is None:
        raise ConfigError(
            "--data is required: 'digits' for the built-in set, or an ImageFolder DIR (train/, val/)."
        )
    check_data_spec(spec)


def _val_batches(args: argparse.Namespace, model: nn.Module):
    from odeify.train.datasets import make_loader, open_data

    _require_data(args.data)
    data = open_data(args.data, model)
    return make_loader(data.val, args.batch_size, train=False, workers=args.workers)


def run_eval(args: argparse.Namespace) -> int:
    """Accuracy, NFE and forward time per batch on the validation split."""
    from odeify.inspection.report import describe
    from odeify.train.evaluate import evaluate
    from odeify.train.progress import plural

    _require_data(args.data)
    model, name = _converted(args)
    loader = _val_batches(args, model)
    result = evaluate(model.to(_device(args)), loader, max_batches=args.max_batches)
    if args.json:
        print(json.dumps({"model": name, "data": args.data, **result.to_dict()}, indent=2))
        return 0
    stages = ", ".join(
        f"{s.name}: {s.integrator} x{s.steps}, {plural(s.knots, 'knot')} {s.basis}"
        for s in describe(model).stages
    )
    print(
        f"{name} on {args.data} ({result.samples} samples): accuracy {result.accuracy:.2%}, "
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
    _distinct(("--plot", plot), ("--markdown", markdown))
    _require_data(args.data)
    model, name = _loaded(args)
    model = model.to(_device(args))
    loader = _val_batches(args, model)
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
    _note(f"wrote {plot}" + (f" and {markdown}" if markdown else ""))
    return 0


def run_plot(args: argparse.Namespace) -> int:
    """The weight path over depth of every stage, as a PNG."""
    output = checked_output_file(args.output, "-o", args)
    model, name = _converted(args)
    _plot_weight_path(model, name, output)
    return 0


# -- finetune --------------------------------------------------------------------------------------
RECORDED = (
    "model",
    "data",
    "integrator",
    "steps",
    "knots",
    "basis",
    "backward",
    "arch",
    "num_classes",
    "checkpoint",
    "model_kwargs",
    "pretrained",
    "ema",
    *DATA_CONFIG_FLAGS,
    "leaf",
    "deterministic",
    "teacher",
    "log_interval",
    *TRAIN_AUGMENTATION_KEYS,  # timm train.py's names, argparse dests and Augmentation fields
)

RECIPE_FLAGS = (
    "epochs", "lr", "weight_decay", "batch_size", "distill", "ema_decay", "optimizer", "label_smoothing",
    "clip_grad_norm", "amp", "channels_last", "mixup", "cutmix", "warmup", "opt_eps",
)  # fmt: skip
"""The command-line settings that are Recipe fields (argparse dests named as the fields)."""


def _timm_flags(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with timm's spellings turned into odeify's settings: --experiment (the run
    folder OUT/NAME), --model-ema (an average of decay 0.9998), --amp/--amp-dtype (the recipe's amp)."""
    from odeify.cli.parser import MODEL_EMA_DECAY

    settings = argparse.Namespace(**vars(args))
    if args.experiment is not None:
        settings.out = str(Path(args.out) / args.experiment)
    if args.model_ema and args.ema_decay is None:
        settings.ema_decay = MODEL_EMA_DECAY
    if args.amp_dtype is not None and not args.use_amp:
        raise ConfigError(f"--amp-dtype {args.amp_dtype} sets the dtype of --amp; pass --amp too.")
    settings.amp = (args.amp_dtype or "float16") if args.use_amp else None
    settings.warmup = None  # from --warmup-epochs, once the epochs are known (_warmup)
    return settings


def _warmup(args: argparse.Namespace, settings: argparse.Namespace) -> float | None:
    """--warmup-epochs as the recipe's warm-up fraction of all steps; else the recorded or default one."""
    if args.warmup_epochs is None:
        return settings.warmup
    epochs = settings.epochs or DEFAULT_RECIPE.epochs
    if args.warmup_epochs >= epochs:
        raise ConfigError(
            f"--warmup-epochs {args.warmup_epochs:g} must be below the run's {epochs} epochs (--epochs): the "
            "schedule warms up, then decays over the remaining epochs."
        )
    return args.warmup_epochs / epochs


def run_finetune(args: argparse.Namespace) -> int:
    """Build the model in its manifestation, then :func:`odeify.train.finetune.finetune` it.

    With ``--resume`` every setting not given takes the recorded run's value (``args`` itself is not
    changed: the settings are a copy).
    """
    from dataclasses import fields, replace

    from odeify.train.datasets import open_data
    from odeify.train.finetune import (
        finetune,
        for_training,
        read_run,
        start_processes,
        stop_processes,
    )
    from odeify.train.progress import DEFAULT_LOG_INTERVAL

    RECIPE_FIELDS = {f.name for f in fields(DEFAULT_RECIPE)}  # noqa: N806
    timm_style = _timm_flags(args)
    out = output_folder(timm_style.out, "--out", error=ConfigError)
    if not args.resume and (out / "train_state.safetensors").exists():
        raise ConfigError(
            f"{out} already holds a fine-tuning run. Continue it with --resume, or pass another --out folder."
        )
    run = read_run(out) if args.resume else {}
    settings = _with_recorded(timm_style, run) if args.resume else timm_style
    settings.warmup = _warmup(args, settings)
    _require_data(settings.data)
    given = {k: getattr(settings, k) for k in RECIPE_FLAGS if getattr(settings, k) is not None}
    if given.get("clip_grad_norm") == 0:  # --clip-grad none
        given["clip_grad_norm"] = None
    recorded = {k: v for k, v in run.get("recipe", {}).items() if k in RECIPE_FIELDS}
    recipe = replace(replace(DEFAULT_RECIPE, **recorded), **given)  # given, else recorded, else default
    _check_device(settings.device)
    processes = start_processes(settings.device)
    try:
        loaded, _ = _loaded(settings)
        manifestation = _manifestation(settings, without=("backward",))
        exact = recipe.amp is None and (processes.device.type == "cpu" or bool(settings.deterministic))
        model = for_training(loaded, settings.backward, rebuilds_exactly=exact, **manifestation)
        finetune(
            model,
            open_data(settings.data, model, _augmentation(settings, model)),
            recipe,
            out=out,
            resume=settings.resume,
            refine_at=settings.refine_at or [],
            seed=0 if settings.seed is None else settings.seed,
            max_batches=settings.max_batches,
            workers=settings.workers,
            processes=processes,
            teacher=settings.teacher,
            run_info={"cli": {k: getattr(settings, k) for k in RECORDED}},
            deterministic=settings.deterministic,
            log_interval=settings.log_interval or DEFAULT_LOG_INTERVAL,
            calibrate_first=settings.calibrate,
        )
    finally:
        stop_processes()
    return 0


def _augmentation(settings: argparse.Namespace, model: nn.Module):
    """The training augmentation the flags ask for, or None (open_data's default) when none is given.

    A setting not given is the one the model's file recorded for its source (train.py's ``args``),
    else timm's default."""
    from odeify.train.datasets import Augmentation, recorded_augmentation

    given = {k: getattr(settings, k) for k in TRAIN_AUGMENTATION_KEYS if getattr(settings, k) is not None}
    if not given:
        return None
    for key in ("scale", "ratio"):
        if key in given:
            given[key] = tuple(given[key])
    return Augmentation(**{**recorded_augmentation(model), **given})


_RECORDED_TYPES: dict[str, tuple[type, ...]] = {
    "steps": (str, int), "knots": (str, int), "num_classes": (int,), "pretrained": (bool,), "ema": (bool,),
    "deterministic": (bool,), "log_interval": (int,), "input_size": (int,), "leaf": (str,),
    "img_size": (int,),
    "mean": (float,), "std": (float,), "crop_pct": (float,), "no_aug": (bool,), "scale": (float,),
    "ratio": (float,), "hflip": (float,), "vflip": (float,), "color_jitter": (float,), "reprob": (float,),
}  # fmt: skip
"""The types of the recorded command-line settings that are not strings (what argparse produced; of
the items of the lists in _RECORDED_LISTS)."""
_RECORDED_LISTS = ("input_size", "leaf", "mean", "std", "scale", "ratio", "model_kwargs")


def _recorded_ok(key: str, value: object) -> bool:
    kinds = _RECORDED_TYPES.get(key, (str,))
    items = value if key in _RECORDED_LISTS and isinstance(value, list) else None
    if key in _RECORDED_LISTS and items is None:
        return False
    return all(type(v) in kinds for v in (items if items is not None else [value]))


def _with_recorded(args: argparse.Namespace, run: dict) -> argparse.Namespace:
    """A copy of ``args`` with every setting not given taken from the recorded run (given ones must match)."""
    settings = argparse.Namespace(**vars(args))
    recorded = run.get("cli", {})
    if not isinstance(recorded, dict):
        raise ConfigError(
            "cannot resume: the recorded command-line settings are not an object; the state was altered."
        )
    for key in RECORDED:
        value = recorded.get(key)
        if value is not None and not _recorded_ok(key, value):
            raise ConfigError(
                f"cannot resume: the recorded setting {key} is {value!r:.60}, which the command line never "
                "records; the training state was altered. Start a new run in another --out folder."
            )
    for key in RECORDED:
        value = getattr(settings, key, None)
        if (value is None or value is False or value == []) and recorded.get(key) is not None:
            setattr(settings, key, recorded[key])
    recipe = run.get("recipe", {})
    for key in RECIPE_FLAGS:
        if getattr(settings, key) is None:
            setattr(settings, key, recipe.get(key))
    for key in ("refine_at", "seed", "max_batches"):
        if getattr(settings, key) is None:
            setattr(settings, key, run.get(key))
    return settings


# -- demo ------------------------------------------------------------------------------------------
def run_demo(args: argparse.Namespace) -> int:
    from odeify.cli.demo import run_demo as demo

    report = demo(Path(args.out), epochs=args.epochs)
    print(f"wrote {report}")
    return 0
