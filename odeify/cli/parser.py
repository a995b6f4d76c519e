"""The ``odeify`` command: convert, retarget, inspect, fine-tune, evaluate, sweep, plot, demo.

This module only parses arguments (it imports neither torch nor timm, so ``odeify --help`` and
``odeify list`` answer at once); :mod:`odeify.cli.commands` runs each command. Every user mistake
odeify can name ends with exit code 2 and one paragraph on stderr, never a traceback; ``--json``
and ``--code`` put only their output on stdout (tables go to stderr), so scripts can parse it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from odeify import __version__
from odeify.cli.console import console_on
from odeify.core.errors import ConfigError, OdeifyError
from odeify.ir.settings import BACKWARD_MODES, parse_steps, validate_backward
from odeify.models import DEFAULT_MODEL_PATH
from odeify.numerics.bases import BASES
from odeify.numerics.tableaus import TABLEAUS, ReversibleHeun, resolve_integrator

INTEGRATORS = sorted([*TABLEAUS, ReversibleHeun.name])

DESCRIPTION = """\
Compile trained residual networks (timm ResNets) into continuous-in-depth ODE models, then
retarget, fine-tune (memory-free), evaluate and inspect them.

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
  odeify inspect digits_ode.safetensors --code > model.py   # model + each integrator, every backward
  odeify inspect digits_ode.safetensors --plot path.png     # weight path over depth
""",
    "convert": """\
examples:
  odeify convert -o digits_ode.safetensors        # exact at native depth; prints the verification
  odeify convert resnet50 --pretrained -o r50.safetensors --integrator rk4 --steps 2
  odeify convert model_best.pth.tar --arch resnet50 --num-classes 10 --ema -o ode.safetensors
  odeify convert resnet50 --steps x0.5 --knots 2 --basis linear --json
""",
    "retarget": """\
examples:
  odeify retarget digits_ode.safetensors -o euler1.safetensors --steps 1 --backward checkpoint
  odeify retarget digits_ode.safetensors -o heun.safetensors --integrator reversible_heun \\
      --steps x0.5 --backward reversible
  odeify retarget digits_ode.safetensors -o lin2.safetensors --basis linear --knots 2
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 failed verification, 2 usage or odeify error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "list":
            return run_list(args)
        from odeify.cli import commands

        return getattr(commands, f"run_{args.command}")(args)
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
        print("odeify: interrupted", file=sys.stderr)
        return 130


def _error(message: str) -> None:
    """One paragraph on stderr; under torchrun, ranks other than 0 say which rank they are."""
    rank = os.environ.get("RANK", "0")
    prefix = "odeify: error: " if rank == "0" else f"odeify (rank {rank}): error: "
    print(prefix + " ".join(message.split()), file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with its subcommands (each sets ``command``)."""
    parser = argparse.ArgumentParser(
        prog="odeify",
        description=DESCRIPTION.format(default=DEFAULT_MODEL_PATH),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command", required=True)

    def command(name: str, help_text: str, description: str, **kwargs) -> argparse.ArgumentParser:
        return commands.add_parser(
            name,
            help=help_text,
            description=description,
            epilog=COMMAND_EXAMPLES.get(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kwargs,
        )

    inspect = command(
        "inspect",
        "show a model's residual runs, or a converted model's stages",
        "MODEL: trace it and print the runs of identity blocks that become ODE stages and the blocks\n"
        "that stay discrete. CONVERTED (a file from `odeify convert -o`): print its stages and how each\n"
        "is integrated. Tables go to stderr when --code or --json write to stdout.",
    )
    _model_arguments(inspect, "MODEL|CONVERTED")
    inspect.add_argument(
        "--code",
        action="store_true",
        help="print the converted model's Python, with each stage's integrator in every backward mode "
        "(a MODEL is converted at native depth first)",
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

    convert = command(
        "convert",
        "convert MODEL into ODE stages, verify it and save it",
        "Convert MODEL: fold BatchNorm, lift each run of identity blocks into an ODE stage, check that the\n"
        "native manifestation (Euler, one step and one knot per block) reproduces MODEL, then apply the\n"
        "requested manifestation and save it with -o.",
    )
    _model_arguments(convert, "MODEL")
    convert.add_argument("-o", "--output", metavar="FILE", help="write the converted model (.safetensors)")
    _manifestation_arguments(convert, defaults=True)
    convert.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the native manifestation against MODEL on one seeded random input and print the max "
        "relative error; exit code 1 if it exceeds the dtype's tolerance (default: on)",
    )
    convert.add_argument("--code", action="store_true", help="print the converted model's Python code")
    convert.add_argument("--json", action="store_true", help="print the report as JSON (nothing else)")

    retarget = command(
        "retarget",
        "re-emit a converted model for another integrator, depth, knots or backward mode",
        "Load CONVERTED, change its manifestation (settings not given keep their current value), save it.\n"
        "The original network is not needed.",
    )
    retarget.add_argument("model", metavar="CONVERTED", help="a file written by odeify convert -o")
    retarget.add_argument("-o", "--output", metavar="FILE", required=True, help="where to write the result")
    _manifestation_arguments(retarget, defaults=False)
    retarget.add_argument("--json", action="store_true", help="print the report as JSON (nothing else)")

    finetune = command(
        "finetune",
        "fine-tune a converted model (memory-free) on digits or an image folder",
        "Fine-tune MODEL|CONVERTED (a MODEL is converted first) in the given manifestation. Prints\n"
        "progress, evaluates after every epoch and writes OUT/last.safetensors, OUT/best.safetensors (both\n"
        "readable by odeify.load and `odeify eval`), OUT/train_state.safetensors (for --resume) and\n"
        "OUT/history.json.\n"
        "The defaults are the recipe measured in docs/finetuning.md. Runs unchanged under torchrun.",
    )
    _model_arguments(finetune, "MODEL|CONVERTED")
    _data_arguments(finetune, batch_size=None)
    _manifestation_arguments(finetune, defaults=False, finetuning=True)
    finetune.add_argument("--epochs", type=_positive_int, help="epochs (default: the recipe's, 3)")
    finetune.add_argument(
        "--lr", type=_positive_float, help="peak learning rate (default: the recipe's, 1e-3)"
    )
    finetune.add_argument("--weight-decay", type=_nonnegative_float, help="AdamW weight decay (default 0.05)")
    finetune.add_argument(
        "--out", metavar="DIR", default="runs/finetune", help="output folder (default: runs/finetune)"
    )
    finetune.add_argument(
        "--distill",
        type=_fraction,
        help="weight of distillation from the model at native depth, 0..1 (default: the recipe's, 1; "
        "0 when the data's classes differ from the model's)",
    )
    finetune.add_argument(
        "--ema-decay",
        type=_ema_decay,
        metavar="DECAY",
        help="keep an exponential moving average of the weights, its decay at most DECAY in [0, 1) after "
        "timm's warm-up, and save the average; 'none' or 0: no average (default: the recipe's, none)",
    )
    finetune.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last completed epoch"
    )
    finetune.add_argument(
        "--refine-at",
        type=_epoch_list,
        metavar="EPOCHS",
        help="comma-separated epochs at whose start every stage's knots and steps double (e.g. 2,3)",
    )
    finetune.add_argument("--seed", type=int, help="seed of the batch order and RNGs (default 0)")
    finetune.add_argument(
        "--deterministic",
        action="store_true",
        help="use deterministic kernels only (torch.use_deterministic_algorithms): bit-identical reruns",
    )

    evaluate = command(
        "eval",
        "accuracy, NFE and time per batch of a model on a data set",
        "Evaluate MODEL|CONVERTED on the validation split (optionally in another manifestation, not saved).",
    )
    _model_arguments(evaluate, "MODEL|CONVERTED")
    _data_arguments(evaluate)
    _manifestation_arguments(evaluate, defaults=False)
    evaluate.add_argument("--json", action="store_true", help="print the result as JSON (nothing else)")

    sweep = command(
        "sweep",
        "accuracy vs NFE over integrators, steps and knots, without training",
        "Retarget MODEL|CONVERTED to every combination of --integrators, --steps and --knots and evaluate\n"
        "each: a markdown table on stdout and a PNG of accuracy against field evaluations.",
    )
    _model_arguments(sweep, "MODEL|CONVERTED")
    _data_arguments(sweep)
    sweep.add_argument(
        "--integrators",
        type=_integrator_list,
        default=["euler", "heun", "rk4"],
        help="comma-separated integrators (default: euler,heun,rk4)",
    )
    sweep.add_argument(
        "--steps",
        type=_list_of(_steps),
        default=[1, 2, 4, "native", "x2"],
        metavar="LIST",
        help="comma-separated steps (default: 1,2,4,native,x2)",
    )
    sweep.add_argument(
        "--knots",
        type=_list_of(_knots),
        default=["native"],
        metavar="LIST",
        help="comma-separated knot counts (default: native)",
    )
    sweep.add_argument("--plot", metavar="FILE", default="sweep.png", help="the PNG (default: sweep.png)")
    sweep.add_argument("--markdown", metavar="FILE", help="also write the table to FILE")

    plot = command(
        "plot",
        "draw the weight path over depth of each stage as a PNG",
        "Each stage's knot tensors: their norm over depth t, the knots as dots and the basis curve between.",
    )
    _model_arguments(plot, "MODEL|CONVERTED")
    plot.add_argument(
        "-o", "--output", metavar="FILE", default="weight_path.png", help="default: weight_path.png"
    )

    demo = command(
        "demo",
        "the whole tour on the shipped model; writes a report with pictures",
        "Convert the shipped digits model, check it, sweep manifestations, fine-tune a coarse one\n"
        "memory-free, measure memory against depth and draw the weight path: OUT/report.md and PNGs,\n"
        "every number measured in this run (the same as `make demo`).",
    )
    demo.add_argument("--out", metavar="DIR", default="out/demo", help="output folder (default: out/demo)")
    demo.add_argument("--epochs", type=_positive_int, help="fine-tuning epochs (default: the recipe's)")

    listing = command(
        "list",
        "list the integrators, bases and backward modes",
        "List the integrators, bases and backward modes that convert and retarget accept.",
        aliases=["integrators"],
    )
    listing.set_defaults(command="list")
    listing.add_argument("--json", action="store_true", help="print the lists as JSON")
    return parser


def _version() -> str:
    versions = []
    for package in ("torch", "timm"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    return f"odeify {__version__} ({', '.join(versions)})"


def _model_arguments(parser: argparse.ArgumentParser, metavar: str) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        metavar=metavar,
        help="timm name, checkpoint, model folder or converted file (default: the shipped digits ResNet)",
    )
    source = parser.add_argument_group("how to build MODEL (ignored for a converted file)")
    source.add_argument(
        "--input-size",
        nargs="+",
        type=int,
        metavar="DIM",
        help="C H W or N C H W of the example input (default: the model's pretrained config)",
    )
    source.add_argument("--pretrained", action="store_true", help="download timm's weights (needs the hub)")
    source.add_argument("--arch", help="timm architecture of a checkpoint that does not name it")
    source.add_argument("--num-classes", type=_positive_int, help="classifier size of the checkpoint's model")
    source.add_argument("--checkpoint", metavar="FILE", help="weights for a timm name given as MODEL")
    source.add_argument(
        "--ema", action="store_true", help="use the checkpoint's EMA weights (state_dict_ema)"
    )
    source.add_argument(
        "--leaf",
        action="append",
        default=[],
        metavar="CLASS",
        help="keep modules of this class opaque while tracing (repeatable); for code FX cannot trace",
    )


def _manifestation_arguments(
    parser: argparse.ArgumentParser, *, defaults: bool, finetuning: bool = False
) -> None:
    """--integrator --steps --knots --basis --backward; ``defaults``: convert's, else keep current."""
    keep = "" if defaults else "; default: keep the model's"
    group = parser.add_argument_group("manifestation")
    group.add_argument(
        "--integrator",
        type=_integrator,
        default="euler" if defaults else None,
        help=f"one of {', '.join(INTEGRATORS)}" + (" (default: euler)" if defaults else keep),
    )
    group.add_argument(
        "--steps",
        type=_steps,
        default="native" if defaults else None,
        metavar="native|INT|xFLOAT",
        help="steps per stage: the run's block count (native), a number, or a multiple of native (x2, x0.5)"
        + (" (default: native)" if defaults else keep),
    )
    group.add_argument(
        "--knots",
        type=_knots,
        default="native" if defaults else None,
        metavar="native|INT",
        help="weight knots per stage: one per block (native) or a number (fewer compresses)"
        + (" (default: native)" if defaults else keep),
    )
    group.add_argument(
        "--basis",
        choices=list(BASES),
        default="constant" if defaults else None,
        help="weights over depth" + (" (default: constant)" if defaults else keep),
    )
    backward_help = (
        "training backward pass: backprop (stores everything), checkpoint (exact, stores each step's "
        "state), reverse (memory-free, approximate; explicit integrators) or reversible (memory-free and "
        "exact; reversible_heun)"
    )
    if finetuning:
        backward_help += "; default: reversible for reversible_heun, checkpoint otherwise"
    group.add_argument(
        "--backward",
        choices=BACKWARD_MODES,
        default="backprop" if defaults else None,
        help=backward_help + (" (default: backprop)" if defaults else "" if finetuning else keep),
    )


def _data_arguments(parser: argparse.ArgumentParser, batch_size: int | None = 256) -> None:
    """--data --batch-size --max-batches --workers; ``batch_size`` None: the recipe's (finetune)."""
    data = parser.add_argument_group("data")
    data.add_argument(
        "--data",
        metavar="DIR|digits",
        help="'digits' (built in) or an ImageFolder with train/ and val/ subfolders (required; "
        "with finetune --resume the recorded one)",
    )
    default = batch_size or "the recipe's, 64"
    data.add_argument(
        "--batch-size",
        type=_positive_int,
        default=batch_size,
        help=f"batch size per process (default: {default})",
    )
    data.add_argument(
        "--max-batches", type=_positive_int, metavar="N", help="use at most N batches per epoch (quick tries)"
    )
    data.add_argument(
        "--workers", type=_nonnegative_int, default=0, help="data-loading processes (default 0)"
    )


# -- argument types: argparse turns their ArgumentTypeError into a usage error (exit code 2) --------
def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return int(text)


def _nonnegative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer; got {text!r}")
    return int(text)


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number; got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0; got {text!r}")
    return value


def _nonnegative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0; got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1; got {text!r}")
    return value


def _ema_decay(text: str) -> float:
    """A decay in [0, 1), or 'none' (no weight average), which is 0."""
    if text.lower() == "none":
        return 0.0
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1) or 'none'; got {text!r}")
    return value


def _steps(text: str) -> str | int:
    """'native', a positive int, or 'x' and a positive multiplier (ir.settings.parse_steps's grammar)."""
    try:
        return parse_steps(int(text) if text.isdigit() else text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _knots(text: str) -> str | int:
    """'native' or a positive int."""
    if text == "native":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected native or a positive integer; got {text!r}")
    return int(text)


def _integrator(text: str) -> str:
    try:
        resolve_integrator(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _list_of(item):
    def parse(text: str) -> list:
        values = [item(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list; got {text!r}")
        return values

    parse.__name__ = f"list of {item.__name__}"
    return parse


_integrator_list = _list_of(_integrator)


def _epoch_list(text: str) -> list[int]:
    return sorted(set(_list_of(_positive_int)(text)))


def run_list(args: argparse.Namespace) -> int:
    """``odeify list``: integrators (stages, order, backward modes), bases, backward modes."""
    from rich.table import Table

    integrators = []
    for name in [*TABLEAUS, ReversibleHeun.name]:
        integrator = resolve_integrator(name)
        modes = [m for m in BACKWARD_MODES if _allows(integrator, m)]
        integrators.append(
            {"name": name, "stages": integrator.evals_per_step, "order": integrator.order, "backward": modes}
        )
    bases = [{"name": n, "description": _first_line(type(b).__doc__)} for n, b in BASES.items()]
    if args.json:
        print(json.dumps({"integrators": integrators, "bases": bases, "backward": list(BACKWARD_MODES)}))
        return 0
    table = Table(title="integrators (--integrator)", caption="NFE per stage = stages x steps")
    for header, justify in (("name", "left"), ("stages", "right"), ("order", "right"), ("backward", "left")):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in integrators:
        table.add_row(row["name"], str(row["stages"]), str(row["order"]), ", ".join(row["backward"]))
    basis_table = Table(title="bases (--basis): weights over depth")
    basis_table.add_column("name")
    basis_table.add_column("description")
    for row in bases:
        basis_table.add_row(row["name"], row["description"])
    console = console_on(sys.stdout)
    console.print(table)
    console.print(basis_table)
    return 0


def _allows(integrator: object, mode: str) -> bool:
    try:
        validate_backward(mode, integrator)  # type: ignore[arg-type]
    except ConfigError:
        return False
    return True


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc else ""


if __name__ == "__main__":
    sys.exit(main())
