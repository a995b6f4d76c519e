"""The ``odeify`` command: inspect a model's residual runs, convert it, list the options.

Every user mistake odeify can name (an unknown model, a model without residual blocks, a bad
setting) ends with exit code 2 and one paragraph on stderr, never a traceback; ``--json`` puts
only JSON on stdout so scripts can parse it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from odeify.bases import BASES
from odeify.errors import ConfigError, OdeifyError
from odeify.fileio import atomic_write_bytes
from odeify.settings import BACKWARD_MODES, DEFAULT_MODEL_PATH, validate_backward
from odeify.tableaus import TABLEAUS, ReversibleHeun, resolve_integrator

if TYPE_CHECKING:
    from torch import nn

# torch, timm and the library proper are imported by the commands that use them, so that
# `odeify --help` and `odeify list` answer at once.

CHECK_SEED = 0
TABLE_WIDTH = 120  # rich's width when stdout is not a terminal (its own default, 80, wraps the tables)

DESCRIPTION = """\
Compile trained residual networks (timm ResNets) into continuous-in-depth ODE models.

MODEL is a timm model name (random weights unless --pretrained), a checkpoint file
(.safetensors/.pth/.pt/.bin), or nothing: the small digits ResNet that ships with odeify
({default}).
"""

EXAMPLES = """\
examples:
  odeify inspect                                  # runs of the shipped digits ResNet
  odeify inspect resnet50 --dot resnet50.dot      # plan table + Graphviz file (dot -Tsvg)
  odeify inspect resnet152 --input-size 3 160 160 --json
  odeify convert --check                          # exact at native depth: prints the tiny diff
  odeify convert resnet50 --integrator rk4 --steps 2 --check
  odeify convert resnet50 --steps x0.5 --knots 2 --code
  odeify list                                     # integrators, bases, backward modes
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 for a usage or odeify error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.handler(args)
    except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    except OdeifyError as exc:
        print(f"odeify: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("odeify: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with its subcommands (each sets ``handler``)."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="odeify",
        description=DESCRIPTION.format(default=DEFAULT_MODEL_PATH),
        epilog=EXAMPLES,
        formatter_class=formatter,
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    inspect = commands.add_parser(
        "inspect",
        help="find the residual blocks and the runs that become ODE stages",
        description="Trace MODEL, find its residual blocks and print the runs of identity blocks that\n"
        "odeify turns into ODE stages, and the blocks that stay discrete.",
        epilog=EXAMPLES,
        formatter_class=formatter,
    )
    _add_model_arguments(inspect)
    inspect.add_argument("--dot", metavar="FILE", help="also write the traced graph as Graphviz DOT")
    inspect.add_argument("--json", action="store_true", help="print the plan as JSON (nothing else)")
    inspect.set_defaults(handler=run_inspect)

    conv = commands.add_parser(
        "convert",
        help="convert MODEL into ODE stages and report them",
        description="Convert MODEL: fold BatchNorm, lift each run into an ODE stage and unroll it for\n"
        "the chosen integrator and steps. The defaults reproduce the model exactly.",
        epilog=EXAMPLES,
        formatter_class=formatter,
    )
    _add_model_arguments(conv)
    conv.add_argument(
        "--integrator",
        default="euler",
        help=f"integrator (default: euler); one of {', '.join(sorted([*TABLEAUS, ReversibleHeun.name]))}",
    )
    conv.add_argument(
        "--steps",
        type=_steps,
        default="native",
        metavar="native|INT|xFLOAT",
        help="steps per stage: the run's block count (native, default), a number, or a multiple "
        "of it (x2, x0.5)",
    )
    conv.add_argument(
        "--knots",
        type=_knots,
        default="native",
        metavar="native|INT",
        help="weight knots per stage: one per block (native, default) or a number (fewer compresses)",
    )
    conv.add_argument("--basis", default="constant", help=f"weights over depth; one of {', '.join(BASES)}")
    conv.add_argument(
        "--backward",
        default="backprop",
        choices=BACKWARD_MODES,
        help="training backward pass: backprop (default), checkpoint (exact, recomputes), reverse "
        "(memory-free, approximate) or reversible (memory-free and exact, needs reversible_heun)",
    )
    conv.add_argument(
        "--check",
        action="store_true",
        help=f"run one random input (seed {CHECK_SEED}) through both models and print the max absolute "
        "output difference and the relative one (divided by the max absolute original output)",
    )
    conv.add_argument("--code", action="store_true", help="print the converted model's Python code")
    conv.add_argument("--json", action="store_true", help="print the report as JSON (nothing else)")
    conv.set_defaults(handler=run_convert)

    listing = commands.add_parser(
        "list",
        aliases=["integrators"],
        help="list the integrators, bases and backward modes convert accepts",
        description="List the integrators, bases and backward modes that convert accepts.",
    )
    listing.add_argument("--json", action="store_true", help="print the lists as JSON")
    listing.set_defaults(handler=run_list)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="timm name or checkpoint file (default: the shipped digits ResNet)",
    )
    parser.add_argument(
        "--input-size",
        nargs="+",
        type=int,
        metavar="DIM",
        help="C H W or N C H W of the example input (default: the model's pretrained config)",
    )
    parser.add_argument(
        "--pretrained", action="store_true", help="download timm's pretrained weights (needs the hub)"
    )


def _steps(text: str) -> str | int | float:
    """'native', a positive int, or 'x' and a positive float multiplier."""
    if text == "native":
        return text
    try:
        value: int | float = float(text[1:]) if text.startswith("x") else int(text)
    except ValueError:
        value = 0
    if value > 0 and math.isfinite(value):
        return value
    raise argparse.ArgumentTypeError(f"expected native, a positive integer or x<multiplier>; got {text!r}")


def _knots(text: str) -> str | int:
    """'native' or a positive int."""
    if text == "native":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected native or a positive integer; got {text!r}")
    return int(text)


def _load(args: argparse.Namespace) -> tuple[nn.Module, str, tuple[int, ...]]:
    """The model, its display name and the validated input shape."""
    from odeify.analysis import input_shape_for
    from odeify.loading import load_model

    if args.input_size is not None and len(args.input_size) not in (3, 4):
        raise OdeifyError(
            f"--input-size takes C H W or N C H W (e.g. --input-size 3 224 224); got {len(args.input_size)} "
            f"number(s): {' '.join(map(str, args.input_size))}."
        )
    model = load_model(args.model or DEFAULT_MODEL_PATH, pretrained=args.pretrained)
    name = args.model or DEFAULT_MODEL_PATH.name
    return model, name, input_shape_for(model, args.input_size)


def run_inspect(args: argparse.Namespace) -> int:
    """``odeify inspect``: the plan table, the discrete blocks, optionally DOT and JSON."""
    import torch

    from odeify.analysis import analyze_graph, trace_and_annotate
    from odeify.dot import plan_to_dot
    from odeify.report import format_discrete_table, format_plan_table

    model, name, shape = _load(args)
    with torch.no_grad():
        gm = trace_and_annotate(model, shape)
    plan = analyze_graph(gm, name, shape)
    if args.dot:
        try:
            atomic_write_bytes(args.dot, plan_to_dot(gm, plan).encode())
        except OSError as exc:
            raise OdeifyError(f"cannot write the DOT file {args.dot}: {exc}") from exc
        print(f"wrote {args.dot} (render it with: dot -Tsvg {args.dot} -o graph.svg)", file=sys.stderr)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    console = _console()
    console.print(format_plan_table(plan))
    if plan.discrete:
        console.print(format_discrete_table(plan))
    return 0


def run_convert(args: argparse.Namespace) -> int:
    """``odeify convert``: the report table, optionally a numerical check and the code."""
    from odeify.conversion import convert
    from odeify.report import describe, format_report_table

    model, name, shape = _load(args)
    converted = convert(
        model,
        integrator=args.integrator,
        steps=args.steps,
        basis=args.basis,
        knots=args.knots,
        input_size=shape,
        backward=args.backward,
    )
    report = describe(converted, name=name)
    check = compare(model, converted, shape) if args.check else None
    if check is not None and _random_timm_weights(args):
        print(
            f"note: {args.model} has random weights and timm zero-initialises the last norm of each residual "
            "branch, so its blocks are identities and the check is trivially tight; pass --pretrained or "
            "a checkpoint file for a real test.",
            file=sys.stderr,
        )
    if args.json:
        out = report.to_dict()
        if check is not None:
            out["check"] = check
        if args.code:
            out["code"] = converted.code
        print(json.dumps(out, indent=2))
        return 0
    console = _console()
    console.print(format_report_table(report))
    if check is not None:
        console.print(
            f"check, random {'x'.join(map(str, shape))} input (seed {CHECK_SEED}): converted vs original "
            f"max |diff| {check['max_abs_diff']:.3g}, relative {check['relative_diff']:.3g}"
        )
    if args.code:
        print(converted.code)
    return 0


def _random_timm_weights(args: argparse.Namespace) -> bool:
    """True when MODEL was a timm name built without --pretrained."""
    return bool(args.model) and not args.pretrained and not Path(args.model).expanduser().is_file()


def compare(original: nn.Module, converted: nn.Module, shape: Sequence[int]) -> dict[str, float]:
    """Max absolute and relative output difference on one seeded random input."""
    import torch

    dtype = next((p.dtype for p in original.parameters() if p.is_floating_point()), torch.float32)
    x = torch.randn(tuple(shape), generator=torch.Generator().manual_seed(CHECK_SEED), dtype=dtype)
    with torch.no_grad():
        expected, actual = original(x), converted(x)
    if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
        raise ConfigError("--check compares models with one tensor output; this model returns another type.")
    diff = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    return {"max_abs_diff": diff, "relative_diff": diff / scale if scale else float(diff > 0)}


def run_list(args: argparse.Namespace) -> int:
    """``odeify list``: integrators (stages, order, backward modes), bases, backward modes."""
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
    console = _console()
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


def _console() -> Console:
    """A console on the current stdout; wide enough for the tables when stdout is not a terminal."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=TABLE_WIDTH)
    return console
