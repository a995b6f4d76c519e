"""The ``odeify`` command: convert, retarget, inspect, fine-tune, evaluate, sweep, plot, demo.

This module only parses arguments (it imports neither torch nor timm, so ``odeify --help`` and
``odeify list`` answer at once); :mod:`odeify.cli.commands` and :mod:`odeify.cli.finetune_command`
run the commands. Every user mistake odeify can name ends with exit code 2 and one paragraph on
stderr, never a traceback; ``--json`` and ``--code`` put only their output on stdout (tables go to
stderr), so scripts can parse it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from odeify import __version__
from odeify.cli import arguments as arg
from odeify.cli.console import print_log_lines, print_warnings_plainly, stdout_is_data
from odeify.core.errors import OdeifyError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.train.recipe import ALF_LR, DEFAULT_LR, DEFAULT_RECIPE, DEPTHS_LR

DESCRIPTION = """\
Compile trained residual networks (timm ResNets, ConvNeXts, RegNets, MobileNets, EfficientNets,
ViTs and other transformers) into continuous-in-depth ODE models, then retarget, fine-tune
(memory-free), evaluate and inspect them.

MODEL is a timm model name (random weights unless --pretrained), a checkpoint file
(.safetensors/.pth/.pth.tar) or model folder, or nothing: the small digits ResNet that ships
with odeify ({default}). CONVERTED is a file written by `odeify convert -o`.
"""

EXAMPLES = """\
examples:
  odeify convert -o digits_ode.safetensors        # the shipped model, verified exact
  odeify convert resnet50 --pretrained -o r50_ode.safetensors --integrator rk4 --steps 2
  odeify inspect digits_ode.safetensors --code    # stages, and the Python of every integrator
  odeify finetune digits_ode.safetensors --data digits --steps 1 --backward checkpoint --out runs/e1
  odeify eval runs/e1/best.safetensors --data digits
  odeify sweep digits_ode.safetensors --data digits --integrators euler,heun,rk4 --steps 1,2,native
  odeify demo                                     # the whole tour, report in out/demo/report.md

Run `odeify COMMAND --help` for each command's options and examples.
"""

COMMAND_EXAMPLES = {
    "inspect": """\
examples:
  odeify inspect                                  # runs of the shipped digits ResNet
  odeify inspect resnet50 --dot resnet50.dot      # plan table + traced and converted Graphviz files
  odeify inspect resnet152 --input-size 3 160 160 --json
  odeify inspect digits_ode.safetensors           # a converted file: its stages and manifestation
  odeify inspect digits_ode.safetensors --code > model.py   # the forward, each stage's steps written out
  odeify inspect digits_ode.safetensors --plot path.png     # weight path over depth
""",
    "convert": """\
examples:
  odeify convert -o digits_ode.safetensors        # exact at native depth; prints the verification
  odeify convert resnet50 --pretrained -o r50.safetensors --integrator rk4 --steps 2
  odeify convert model_best.pth.tar --arch resnet50 --num-classes 10 --ema -o ode.safetensors
  odeify convert vit.safetensors --arch vit_tiny_patch16_224 --img-size 32 \\
      --model-kwargs img_size=32 patch_size=8 depth=6 -o vit_ode.safetensors
  odeify convert resnet50 --steps x0.5 --knots 2 --basis linear --json
""",
    "retarget": """\
examples:
  odeify retarget digits_ode.safetensors -o euler1.safetensors --steps 1 --backward checkpoint
  odeify retarget digits_ode.safetensors -o heun.safetensors --integrator reversible_heun \\
      --steps x0.5 --backward reversible
  odeify retarget digits_ode.safetensors -o lin2.safetensors --basis linear --knots 2
  odeify retarget digits_ode.safetensors -o half.safetensors --steps x0.5 --calibrate digits
""",
    "calibrate": """\
examples:
  odeify calibrate half.safetensors --data digits -o half_cal.safetensors
  odeify calibrate lin2.safetensors --data ~/data/pets --calibrate-images 512 -o lin2_cal.safetensors
  odeify calibrate half.safetensors --data digits -o any.safetensors --calibrate-steps-set native,x0.5,x0.25
  odeify calibrate student.safetensors --data digits --source digits_ode.safetensors -o fitted.safetensors
""",
    "finetune": """\
examples:
  odeify finetune digits_ode.safetensors --data digits --steps 1 --backward checkpoint --out runs/e1
  odeify finetune --data digits --basis linear --knots 2 --backward reverse --out runs/lin2
  odeify finetune --data digits --steps 1 --refine-at 2,3 --out runs/grow   # deeper as it trains
  odeify finetune --data digits --out runs/e1 --resume                       # continue after a crash
  odeify finetune r50_ode.safetensors --data ~/data/pets --epochs 5 --out runs/pets
  torchrun --nproc_per_node 2 -m odeify finetune --data digits --out runs/ddp
""",
    "eval": """\
examples:
  odeify eval runs/e1/best.safetensors --data digits
  odeify eval digits_ode.safetensors --data digits --integrator rk4 --steps 1 --json
""",
    "sweep": """\
examples:
  odeify sweep digits_ode.safetensors --data digits --integrators euler,heun,rk4 --steps 1,2,4,native,x2
  odeify sweep --data digits --steps 1,2,native --knots 2,native --plot sweep.png --markdown sweep.md
""",
    "plot": """\
examples:
  odeify plot digits_ode.safetensors -o weight_path.png
  odeify plot runs/lin2/best.safetensors -o lin2_path.png
""",
    "demo": """\
examples:
  odeify demo                      # out/demo/report.md with its pictures (a few minutes on 2 cores)
  odeify demo --out /tmp/demo --epochs 1
""",
}


HANDLERS = {
    "inspect": ("odeify.cli.commands", "run_inspect"),
    "convert": ("odeify.cli.commands", "run_convert"),
    "retarget": ("odeify.cli.commands", "run_retarget"),
    "calibrate": ("odeify.cli.commands", "run_calibrate"),
    "finetune": ("odeify.cli.finetune_command", "run_finetune"),
    "eval": ("odeify.cli.commands", "run_eval"),
    "sweep": ("odeify.cli.commands", "run_sweep"),
    "plot": ("odeify.cli.commands", "run_plot"),
    "demo": ("odeify.cli.commands", "run_demo"),
    "list": ("odeify.cli.catalog", "run_list"),
}
"""Each command's function, as (module, name): imported when the command runs, so that ``--help``
and ``list`` do not wait for torch."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 failed verification, 2 usage or odeify error)."""
    parser = build_parser()
    args = None
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            arg.refuse_unknown(parser, args.command, unknown)
        arg.check_command_line(parser, sys.argv[1:] if argv is None else argv, args)
        module, function = HANDLERS[args.command]
        print_log_lines(to_stderr=stdout_is_data(args))
        print_warnings_plainly()
        return getattr(importlib.import_module(module), function)(args)
    except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    except OdeifyError as exc:
        _error(str(exc))
        return 2
    except OSError as exc:  # a file the user named cannot be read or written
        where = f" {exc.filename}" if exc.filename else ""
        _error(f"cannot access{where}: {exc.strerror or exc}.")
        return 2
    except KeyboardInterrupt:
        print(_interrupted(args), file=sys.stderr)
        return 130


def _interrupted(args: argparse.Namespace | None) -> str:
    """What Ctrl-C leaves: for a fine-tuning run with a completed epoch, its files and how to
    continue; before one (the opening calibration, the first epoch), that there is nothing to resume."""
    if args is None or getattr(args, "command", None) != "finetune":
        return "odeify: interrupted"
    from odeify.train.state import STATE_FILE  # torch is loaded by now: the run had started

    out = os.path.join(args.out, args.experiment) if getattr(args, "experiment", None) else args.out
    if not os.path.exists(os.path.join(out, STATE_FILE)):
        return (
            f"odeify: interrupted before the run's first epoch was saved: {out} holds no run to resume. "
            "Run the same command again to start it."
        )
    return (
        f"odeify: interrupted; {out} keeps the files of the last completed epoch (an epoch cut short "
        f"is not saved). Continue the run with: odeify finetune --resume --out {out}"
    )


def _error(message: str) -> None:
    """One paragraph on stderr; under torchrun, ranks other than 0 say which rank they are."""
    rank = os.environ.get("RANK", "0")
    prefix = "odeify: error: " if rank == "0" else f"odeify (rank {rank}): error: "
    print(prefix + " ".join(message.split()), file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per command, each set up by its own ``_add_*`` function."""
    parser = argparse.ArgumentParser(
        prog="odeify",
        description=DESCRIPTION.format(default=DEFAULT_MODEL_PATH),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command", required=True)
    for add in (
        _add_inspect,
        _add_convert,
        _add_retarget,
        _add_calibrate,
        _add_finetune,
        _add_eval,
        _add_sweep,
        _add_plot,
        _add_demo,
        _add_list,
    ):
        add(commands)
    return parser


def _command(commands: argparse._SubParsersAction, name: str, help_text: str, description: str, **kwargs):
    """A subcommand's parser with its examples as epilog; the command runs HANDLERS[name]."""
    parser = commands.add_parser(
        name,
        help=help_text,
        description=description,
        epilog=COMMAND_EXAMPLES.get(name),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )
    parser.set_defaults(command=name)
    return parser


def _add_inspect(commands: argparse._SubParsersAction) -> None:
    inspect = _command(
        commands,
        "inspect",
        "show a model's residual runs, or a converted model's stages",
        "MODEL: trace it and print the runs of identity blocks that become ODE stages and the blocks\n"
        "that stay discrete. CONVERTED (a file from `odeify convert -o`): print its stages and how each\n"
        "is integrated. Tables go to stderr when --code or --json write to stdout.",
    )
    arg.model_arguments(inspect, "MODEL|CONVERTED")
    arg.verify_argument(inspect, converts=True)
    inspect.add_argument(
        "--code",
        action="store_true",
        help="print the converted model's forward as Python: a stage in backward='backprop' is inlined "
        "(its integrator steps are in the model's code), a stage in a memory-free mode is listed after "
        "it with its unrolled steps (what backward re-runs), then each checkpointed segment (a MODEL "
        "is converted at native depth first)",
    )
    inspect.add_argument(
        "--dot",
        metavar="FILE",
        help="write Graphviz DOT: for a MODEL the traced graph (runs as clusters) and FILE.converted.dot, "
        "the converted graph; for a CONVERTED file its graph",
    )
    inspect.add_argument(
        "--json", action="store_true", help="print the plan or stages as JSON (nothing else)"
    )
    inspect.add_argument("--plot", metavar="FILE", help="also draw the weight path over depth as a PNG")


def _add_convert(commands: argparse._SubParsersAction) -> None:
    convert = _command(
        commands,
        "convert",
        "convert MODEL into ODE stages, verify it and save it",
        "Convert MODEL: fold BatchNorm, lift each run of identity blocks into an ODE stage, check that the\n"
        "native manifestation (Euler, one step and one knot per block) reproduces MODEL, then apply the\n"
        "requested manifestation and save it with -o.",
    )
    arg.model_arguments(convert, "MODEL", data_config=True)
    convert.add_argument("-o", "--output", metavar="FILE", help="write the converted model (.safetensors)")
    arg.manifestation_arguments(convert, defaults=True)
    convert.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the native manifestation against MODEL on one seeded random input and print the max "
        "relative error; exit code 1 if it exceeds the allowance (4x the larger of the source's and the "
        "conversion's own round-off on that input, at least 1e-4 in float32) (default: on)",
    )
    convert.add_argument("--code", action="store_true", help="print the converted model's Python code")
    convert.add_argument("--json", action="store_true", help="print the report as JSON (nothing else)")


def _add_retarget(commands: argparse._SubParsersAction) -> None:
    retarget = _command(
        commands,
        "retarget",
        "re-emit a converted model for another integrator, depth, knots or backward mode",
        "Load CONVERTED, change its manifestation (settings not given keep their current value), save it.\n"
        "The original network is not needed.",
    )
    retarget.add_argument("model", metavar="CONVERTED", help="a file written by odeify convert -o")
    arg.verify_argument(retarget)
    retarget.add_argument("-o", "--output", metavar="FILE", required=True, help="where to write the result")
    arg.manifestation_arguments(retarget, defaults=False)
    arg.calibration_arguments(retarget, data_flag="--calibrate")
    retarget.add_argument("--json", action="store_true", help="print the report as JSON (nothing else)")


def _add_calibrate(commands: argparse._SubParsersAction) -> None:
    calibrate = _command(
        commands,
        "calibrate",
        "fit a coarse manifestation's stages to its source network on unlabelled images",
        "Load CONVERTED (fewer steps or knots than its blocks: `odeify retarget -o`), fit each stage in\n"
        "turn so that its output on images of --data matches the source network's there (the source the\n"
        "file keeps; no labels are read), print each stage's residual before and after, save with -o.",
    )
    calibrate.add_argument("model", metavar="CONVERTED", help="a file written by odeify retarget -o")
    arg.verify_argument(calibrate)
    calibrate.add_argument("-o", "--output", metavar="FILE", required=True, help="where to write the result")
    calibrate.add_argument(
        "--source",
        metavar="FILE",
        help="a converted file of the network to fit to (its source network is used), for a model built "
        "with fewer blocks than it, such as a dropped-blocks student (default: the source CONVERTED keeps)",
    )
    arg.calibration_arguments(calibrate, data_flag="--data")


def _add_finetune(commands: argparse._SubParsersAction) -> None:
    finetune = _command(
        commands,
        "finetune",
        "fine-tune a converted model (memory-free) on digits or an image folder",
        "Fine-tune MODEL|CONVERTED (a MODEL is converted first) in the given manifestation. Prints\n"
        "progress, evaluates after every epoch and writes OUT/last.safetensors, OUT/best.safetensors (both\n"
        "readable by odeify.load and `odeify eval`), OUT/train_state.safetensors (for --resume) and\n"
        "OUT/history.json.\n"
        "The defaults are the recipe measured in docs/finetuning.md. Runs unchanged under torchrun.",
    )
    arg.model_arguments(finetune, "MODEL|CONVERTED", data_config=True)
    arg.verify_argument(finetune, converts=True)
    arg.data_arguments(finetune, batch_size=None)
    arg.manifestation_arguments(finetune, defaults=False, finetuning=True)
    arg.augmentation_arguments(finetune)
    _add_training_flags(finetune)
    _add_run_flags(finetune)
    _add_start_flags(finetune)
    _add_teacher_flags(finetune)
    _add_depth_flags(finetune)


def _add_run_flags(finetune: argparse.ArgumentParser) -> None:
    """Where a fine-tuning run writes, how it resumes, its seed, logging and determinism."""
    finetune.add_argument(
        "--out",
        "--output",
        metavar="DIR",
        default="runs/finetune",
        help="output folder (default: runs/finetune); --output is timm's name",
    )
    finetune.add_argument(
        "--experiment", metavar="NAME", help="write the run into OUT/NAME (timm's --experiment)"
    )
    finetune.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last completed epoch"
    )
    finetune.add_argument("--seed", type=arg.seed, help="seed of the batch order and RNGs (default 0)")
    finetune.add_argument(
        "--log-interval",
        type=arg.positive_int,
        metavar="N",
        help="when output is not a terminal (or TQDM_DISABLE is set): a progress line every N batches "
        "(default 50, as timm's train.py; --resume: the run's own)",
    )
    finetune.add_argument(
        "--deterministic",
        action="store_true",
        help="use deterministic kernels only (torch.use_deterministic_algorithms): bit-identical reruns",
    )


def _add_start_flags(finetune: argparse.ArgumentParser) -> None:
    """How a fine-tuning run starts: calibrated to the source network, or from the file's knots."""
    finetune.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="start a coarse manifestation (fewer steps or knots than blocks) from its retargeted knots; "
        "by default a new run first fits its stages to the source network on training images "
        "(odeify.calibrate)",
    )
    arg.memory_argument(finetune)


def _add_teacher_flags(finetune: argparse.ArgumentParser) -> None:
    """The objective, distillation and weight-average flags of a fine-tuning run."""
    arg.objective_argument(finetune)
    finetune.add_argument(
        "--distill",
        type=arg.fraction,
        help="weight of distillation from the teacher (the source network, or --teacher), 0..1 "
        "(default: the recipe's, 1; 0 when the data's classes differ from the model's)",
    )
    finetune.add_argument(
        "--teacher",
        metavar="FILE",
        help="distill from this model (a converted file or a checkpoint) instead of the source network",
    )
    finetune.add_argument(
        "--model-ema",
        action="store_true",
        default=None,
        help=f"keep an average of the weights (timm's --model-ema), decay {MODEL_EMA_DECAY} unless "
        "--model-ema-decay says (not --ema, which loads a checkpoint's EMA weights)",
    )
    finetune.add_argument(
        "--ema-decay",
        "--model-ema-decay",
        type=arg.ema_decay,
        metavar="DECAY",
        help="keep an exponential moving average of the weights, its decay at most DECAY in [0, 1) after "
        "timm's warm-up, and save the average; 'none' or 0: no average (default: the recipe's, none)",
    )


def _add_depth_flags(finetune: argparse.ArgumentParser) -> None:
    """The depths a fine-tuning run trains: refined during training, or several at once."""
    finetune.add_argument(
        "--refine-at",
        type=arg.epoch_list,
        metavar="EPOCHS",
        help="comma-separated epochs at whose start every stage's knots and steps double (e.g. 2,3)",
    )
    finetune.add_argument(
        "--depths",
        metavar="DEPTHS",
        help="train one file for several depths, e.g. native,x0.5,x0.25: each batch at one drawn at "
        "random (native trains the knots, another depth its own correction), every depth validated "
        "each epoch, the worst deciding best.safetensors; the file is saved at the first and runs at "
        "each (odeify eval --steps). A new run first calibrates for all (not a file already fitted "
        "for them); depths that give the same steps are merged",
    )


MODEL_EMA_DECAY = 0.9998  # timm train.py's --model-ema-decay default


def _add_training_flags(finetune: argparse.ArgumentParser) -> None:
    """The optimizer, schedule, clipping and precision flags of a fine-tuning run (timm's names)."""
    group = finetune.add_argument_group("optimizer, schedule and precision (timm train.py's names)")
    group.add_argument(
        "--epochs", type=arg.positive_int, help=f"epochs (default: the recipe's, {DEFAULT_RECIPE.epochs})"
    )
    group.add_argument(
        "--lr",
        type=arg.positive_float,
        help=f"peak learning rate (default: {DEFAULT_LR:g}; {ALF_LR:g} where a stage integrates with alf; "
        f"at most {DEPTHS_LR:g} with --depths)",
    )
    group.add_argument("--weight-decay", type=arg.nonnegative_float, help="weight decay (default 0.05)")
    group.add_argument(
        "--opt", dest="optimizer", metavar="NAME",
        help="timm optimizer name for create_optimizer_v2 (default: the recipe's, adamw)",
    )  # fmt: skip
    group.add_argument(
        "--opt-eps", dest="opt_eps", type=arg.positive_float, metavar="EPSILON",
        help="optimizer epsilon (default: the optimizer's own, AdamW's 1e-8)",
    )  # fmt: skip
    group.add_argument(
        "--sched", choices=["cosine"],
        help="learning-rate schedule: cosine, per step after a linear warm-up (the only one odeify runs)",
    )  # fmt: skip
    group.add_argument(
        "--warmup-epochs", type=arg.nonnegative_float, metavar="N",
        help="epochs of linear warm-up (default: the recipe's, a tenth of all steps)",
    )  # fmt: skip
    group.add_argument(
        "--clip-grad", dest="clip_grad_norm", type=arg.clip_norm, metavar="NORM|none",
        help="clip the gradient norm to NORM (default: the recipe's, 5); none: no clipping",
    )  # fmt: skip
    group.add_argument(
        "--amp", dest="use_amp", action="store_true", default=None,
        help="autocast the forward pass and loss (timm's --amp; with --backward backprop or checkpoint)",
    )  # fmt: skip
    group.add_argument(
        "--amp-dtype", choices=["float16", "bfloat16"],
        help="autocast dtype with --amp (default float16, as timm; float16 uses a gradient scaler)",
    )  # fmt: skip
    group.add_argument(
        "--channels-last", action="store_true", default=None, help="channels-last memory format"
    )
    group.add_argument(
        "--torchcompile", nargs="?", const="inductor", metavar="BACKEND",
        help="train and validate through torch.compile with BACKEND (alone: inductor; aot_eager: no code "
        "generation; torch._dynamo.list_backends() names them); --resume compiles only when given it too",
    )  # fmt: skip
    group.add_argument(
        "--torchcompile-mode", metavar="MODE",
        help="inductor's mode with --torchcompile: default, reduce-overhead, max-autotune, ...",
    )  # fmt: skip


def _add_eval(commands: argparse._SubParsersAction) -> None:
    evaluate = _command(
        commands,
        "eval",
        "accuracy, NFE and time per batch of a model on a data set",
        "Evaluate MODEL|CONVERTED on the validation split (optionally in another manifestation, not saved).",
    )
    arg.model_arguments(evaluate, "MODEL|CONVERTED", data_config=True)
    arg.verify_argument(evaluate, converts=True)
    arg.data_arguments(evaluate)
    arg.manifestation_arguments(evaluate, defaults=False)
    evaluate.add_argument("--json", action="store_true", help="print the result as JSON (nothing else)")


def _add_sweep(commands: argparse._SubParsersAction) -> None:
    sweep = _command(
        commands,
        "sweep",
        "accuracy vs NFE over integrators, steps and knots, without training",
        "Retarget MODEL|CONVERTED to every combination of --integrators, --steps and --knots and evaluate\n"
        "each: a markdown table on stdout and a PNG of accuracy against field evaluations.",
    )
    arg.model_arguments(sweep, "MODEL|CONVERTED", data_config=True)
    arg.verify_argument(sweep, converts=True)
    arg.data_arguments(sweep)
    sweep.add_argument(
        "--integrators",
        type=arg.integrator_list,
        default=["euler", "heun", "rk4"],
        help="comma-separated integrators (default: euler,heun,rk4)",
    )
    sweep.add_argument(
        "--steps",
        type=arg.list_of(arg.steps),
        default=[1, 2, 4, "native", "x2"],
        metavar="LIST",
        help="comma-separated steps (default: 1,2,4,native,x2)",
    )
    sweep.add_argument(
        "--knots",
        type=arg.list_of(arg.knots),
        default=["native"],
        metavar="LIST",
        help="comma-separated knot counts (default: native)",
    )
    sweep.add_argument(
        "--basis",
        choices=list(arg.BASES),
        help="the basis the knots are refitted in (default: the model's own, shown in the table)",
    )
    sweep.add_argument("--plot", metavar="FILE", default="sweep.png", help="the PNG (default: sweep.png)")
    sweep.add_argument("--markdown", metavar="FILE", help="also write the table to FILE")


def _add_plot(commands: argparse._SubParsersAction) -> None:
    plot = _command(
        commands,
        "plot",
        "draw the weight path over depth of each stage as a PNG",
        "Each stage's knot tensors: their norm over depth t, the knots as dots and the basis curve between.",
    )
    arg.model_arguments(plot, "MODEL|CONVERTED")
    arg.verify_argument(plot, converts=True)
    plot.add_argument(
        "-o", "--output", metavar="FILE", default="weight_path.png", help="default: weight_path.png"
    )


def _add_demo(commands: argparse._SubParsersAction) -> None:
    demo = _command(
        commands,
        "demo",
        "the whole tour on the shipped model; writes a report with pictures",
        "Convert the shipped digits model, check it, sweep manifestations, fine-tune a coarse one\n"
        "memory-free, measure memory against depth and draw the weight path: OUT/report.md and PNGs,\n"
        "every number measured in this run (the same as `make demo`).",
    )
    demo.add_argument("--out", metavar="DIR", default="out/demo", help="output folder (default: out/demo)")
    demo.add_argument("--epochs", type=arg.positive_int, help="fine-tuning epochs (default: the recipe's)")


def _add_list(commands: argparse._SubParsersAction) -> None:
    listing = _command(
        commands,
        "list",
        "list the integrators, bases and backward modes",
        "List the integrators, bases and backward modes that convert and retarget accept.",
        aliases=["integrators"],
    )
    listing.set_defaults(command="list")
    listing.add_argument("--json", action="store_true", help="print the lists as JSON")


def _version() -> str:
    versions = []
    for package in ("torch", "timm"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    return f"odeify {__version__} ({', '.join(versions)})"


if __name__ == "__main__":
    sys.exit(main())
