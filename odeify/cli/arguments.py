"""The command line's shared argument groups and argument types (argparse only: no torch).

Each type raises ``argparse.ArgumentTypeError``, which argparse turns into a usage error naming the
flag (exit code 2). The grammars are the library's own (``odeify.ir.settings.parse_steps``), so the
command line accepts what Python accepts. :func:`check_command_line` refuses what argparse lets
through silently: a flag given twice (argparse keeps the last) and an empty argument (an empty
MODEL would mean the shipped model, an empty --out the current folder).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from odeify.core.errors import ConfigError
from odeify.ir.settings import BACKWARD_MODES, DEFAULTS, parse_steps
from odeify.models.data_config import INTERPOLATIONS, MAX_CROP
from odeify.numerics.bases import BASES
from odeify.numerics.tableaus import KNOWN_INTEGRATORS, resolve_integrator
from odeify.train.recipe import (
    CALIBRATION_IMAGES,
    CALIBRATION_MEMORY_MIB,
    CALIBRATION_OBJECTIVE,
    CALIBRATION_OBJECTIVES,
    CALIBRATION_STEPS,
)


def model_arguments(parser: argparse.ArgumentParser, metavar: str, *, data_config: bool = False) -> None:
    """MODEL and how to build it; ``data_config``: also timm's data-config flags (--mean, --std, ...)."""
    parser.add_argument(
        "model",
        nargs="?",
        metavar=metavar,
        help="timm name, checkpoint, model folder or converted file (default: the shipped digits ResNet)",
    )
    data_config_arguments(parser, full=data_config)
    source = parser.add_argument_group("how to build MODEL (ignored for a converted file)")
    source.add_argument("--pretrained", action="store_true", help="download timm's weights (needs the hub)")
    source.add_argument("--arch", help="timm architecture of a checkpoint that does not name it")
    source.add_argument("--num-classes", type=positive_int, help="classifier size of the checkpoint's model")
    source.add_argument("--checkpoint", metavar="FILE", help="weights for a timm name given as MODEL")
    source.add_argument(
        "--model-kwargs",
        nargs="+",
        type=model_kwarg,
        metavar="KEY=VALUE",
        help="constructor kwargs for MODEL's timm architecture, as train.py's --model-kwargs (values "
        "read as Python literals, else as text): e.g. img_size=32 patch_size=8 depth=6",
    )
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


def verify_argument(parser: argparse.ArgumentParser, *, converts: bool = False) -> None:
    """--no-verify: load a converted file that its probe cannot check (``odeify.load(verify=False)``);
    with ``converts`` (commands that also take a MODEL to convert), skip that conversion's check too."""
    conversion = "; for a MODEL converted here, skip checking the conversion against its source"
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="load a converted file without running its probe (one saved by an older odeify, which "
        "has none or checks less), for a file you trust: nothing then shows it computes what was saved"
        + (conversion if converts else ""),
    )


def data_config_arguments(parser: argparse.ArgumentParser, *, full: bool) -> None:
    """timm's data-config flags, with train.py's names and meanings; ``full``: beyond the input size."""
    group = parser.add_argument_group(
        "data config (timm's flags; default: what the model's file records: a train.py checkpoint's "
        "args, a folder's config.json, a converted file's pretrained_cfg)"
    )
    size_help = "C H W (or N C H W) of the input: the size the model is traced at" + (
        ", verified at and, on convert, recorded in the converted file; on eval, sweep and finetune also "
        "the size images are resized to"
        if full
        else ""
    )
    group.add_argument("--input-size", nargs="+", type=int, metavar="DIM", help=size_help)
    group.add_argument(
        "--img-size",
        type=positive_int,
        metavar="PIXELS",
        help="the image side, as timm's --img-size: --input-size C PIXELS PIXELS with the model's C",
    )
    if not full:
        return
    group.add_argument(
        "--mean", nargs="+", type=finite_float, metavar="M", help="normalisation mean, one per channel"
    )
    group.add_argument(
        "--std", nargs="+", type=positive_float, metavar="S", help="normalisation std, one per channel"
    )
    group.add_argument(
        "--interpolation", choices=INTERPOLATIONS, help="the resize's interpolation (timm's names)"
    )
    group.add_argument(
        "--crop-pct", type=crop_pct, metavar="PCT", help="evaluation crop: resize to SIZE/PCT, crop SIZE"
    )


def manifestation_arguments(
    parser: argparse.ArgumentParser, *, defaults: bool, finetuning: bool = False
) -> None:
    """--integrator --steps --knots --basis --backward; ``defaults``: convert's, else keep current."""
    keep = "" if defaults else "; default: keep the model's"
    group = parser.add_argument_group("manifestation")
    group.add_argument(
        "--integrator",
        type=integrator,
        default=DEFAULTS["integrator"] if defaults else None,
        help=f"one of {', '.join(KNOWN_INTEGRATORS)}"
        + (" (default: euler)" if defaults else keep)
        + (" (a model as converted, given no manifestation flag: see --backward)" if finetuning else ""),
    )
    group.add_argument(
        "--steps",
        type=steps,
        default=DEFAULTS["steps"] if defaults else None,
        metavar="native|INT|xFLOAT",
        help="steps per stage: the run's block count (native), a number, or a multiple of native (x2, x0.5)"
        + (" (default: native)" if defaults else keep),
    )
    group.add_argument(
        "--knots",
        type=knots,
        default=DEFAULTS["knots"] if defaults else None,
        metavar="native|INT",
        help="weight knots per stage: one per block (native) or a number (fewer compresses)"
        + (" (default: native)" if defaults else keep),
    )
    group.add_argument(
        "--basis",
        choices=list(BASES),
        default=DEFAULTS["basis"] if defaults else None,
        help="weights over depth" + (" (default: constant)" if defaults else keep),
    )
    backward_help = (
        "training backward pass: backprop (stores everything), checkpoint (exact, stores each step's "
        "state), reverse (memory-free, approximate; explicit integrators) or reversible (memory-free and "
        "exact; alf, reversible_heun)"
    )
    if finetuning:
        backward_help += (
            "; default: a model as converted, given no manifestation flag, trains as --integrator alf "
            "--backward reversible where one training step on a batch of the run's shape peaks at most "
            "0.9x checkpoint's (measured at the start, logged), else with checkpoint (also with --amp, "
            "and on a GPU without --deterministic); else reversible for alf and reversible_heun, "
            "checkpoint otherwise"
        )
    group.add_argument(
        "--backward",
        choices=BACKWARD_MODES,
        default=DEFAULTS["backward"] if defaults else None,
        help=backward_help + (" (default: backprop)" if defaults else "" if finetuning else keep),
    )


def data_arguments(parser: argparse.ArgumentParser, batch_size: int | None = 256) -> None:
    """--data --batch-size --max-batches --workers; ``batch_size`` None: the recipe's (finetune)."""
    data = parser.add_argument_group("data")
    data.add_argument(
        "--data",
        "--data-dir",
        metavar="DIR|digits",
        help="'digits' (built in) or an ImageFolder with train/ and val/ subfolders (required; "
        "with finetune --resume the recorded one)",
    )
    default = batch_size or "the recipe's, 64"
    data.add_argument(
        "-b",
        "--batch-size",
        type=positive_int,
        default=batch_size,
        help=f"batch size per process (default: {default})",
    )
    data.add_argument(
        "--max-batches", type=positive_int, metavar="N", help="use at most N batches per epoch (quick tries)"
    )
    data.add_argument(
        "-j", "--workers", type=nonnegative_int, default=0, help="data-loading processes (default 0)"
    )
    data.add_argument(
        "--device",
        type=device,
        help="where to run: cpu, cuda or cuda:N (default: cuda when available, else cpu; under "
        "torchrun each rank's own GPU)",
    )


def augmentation_arguments(parser: argparse.ArgumentParser) -> None:
    """timm train.py's training augmentation flags, its names and meanings (image folders); a flag left
    out takes what the model's file recorded for its source's training, else timm's default."""
    group = parser.add_argument_group(
        "training augmentation (timm train.py's flags; an image folder's train/ split)",
        "A flag left out takes the value the model's file recorded for its source's training (timm "
        "train.py's args, kept by convert; the run's log says which), else timm's default, in parentheses.",
    )
    group.add_argument("--no-aug", action="store_true", default=None, help="no augmentation: resize and crop")
    group.add_argument("--scale", nargs=2, type=fraction, metavar="PCT",
                       help="random-resized-crop area range (0.08 1.0)")  # fmt: skip
    group.add_argument("--ratio", nargs=2, type=positive_float, metavar="RATIO",
                       help="random-resized-crop aspect range (0.75 1.33)")  # fmt: skip
    group.add_argument("--hflip", type=fraction, metavar="PROB", help="horizontal flip probability (0.5)")
    group.add_argument("--vflip", type=fraction, metavar="PROB", help="vertical flip probability (0)")
    group.add_argument("--color-jitter", type=nonnegative_float, metavar="PCT", help="colour jitter (0.4)")
    group.add_argument("--aa", metavar="NAME", help="AutoAugment policy, e.g. rand-m9-mstd0.5 (none)")
    group.add_argument("--reprob", type=fraction, metavar="PROB", help="random erasing probability (0)")
    group.add_argument("--mixup", type=nonnegative_float, metavar="ALPHA", help="mixup alpha (0: off)")
    group.add_argument("--cutmix", type=nonnegative_float, metavar="ALPHA", help="cutmix alpha (0: off)")
    group.add_argument(
        "--smoothing",
        dest="label_smoothing",
        type=smoothing,
        metavar="EPS",
        help="label smoothing in [0, 1) (default: the recipe's, 0; timm's train.py uses 0.1)",
    )


# -- the command line as a whole ---------------------------------------------------------------------
def check_command_line(
    parser: argparse.ArgumentParser, argv: Sequence[str], args: argparse.Namespace
) -> None:
    """Refuse a flag given twice and an empty argument (a ConfigError: exit code 2, one paragraph)."""
    command = _subparser(parser, args.command)
    if command is None:
        return
    actions = {option: action for action in command._actions for option in action.option_strings}
    seen: dict[int, str] = {}
    tokens = list(argv)
    start = next(
        (i + 1 for i, t in enumerate(tokens) if t == args.command or t in _aliases(parser, args.command)), 0
    )
    for token in tokens[start:]:
        if token == "--":
            break
        if not token.startswith("-") or token == "-":
            continue
        option = _resolve(token.split("=", 1)[0], actions)
        action = actions.get(option)
        if action is None or isinstance(action, (argparse._AppendAction, argparse._CountAction)):
            continue
        if id(action) in seen:
            raise ConfigError(
                f"{'/'.join(action.option_strings)} is given twice ({seen[id(action)]} and "
                f"{token.split('=')[0]}): odeify would use the last one silently. Give it once."
            )
        seen[id(action)] = token.split("=", 1)[0]
    for action in command._actions:
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            name = "/".join(action.option_strings) or action.metavar or action.dest.upper()
            raise ConfigError(f"{name} is empty: give it a value, or leave it out for the default.")


def refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: Sequence[str]) -> None:
    """A usage error from the subcommand (its usage line, not odeify's), naming the closest flag."""
    import difflib

    sub = _subparser(parser, command) or parser
    flags = [option for action in sub._actions for option in action.option_strings]
    first = unknown[0].split("=", 1)[0]
    close = difflib.get_close_matches(first, flags, n=1, cutoff=0.6) if first.startswith("-") else []
    hint = f"; did you mean {close[0]}?" if close else f"; `odeify {command} --help` lists the flags"
    sub.error(f"unrecognized argument{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)}{hint}")


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def _aliases(parser: argparse.ArgumentParser, name: str) -> set[str]:
    """Every name the command ``name`` answers to (``list`` is also ``integrators``)."""
    command = _subparser(parser, name)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {alias for alias, sub in action.choices.items() if sub is command}
    return set()


def _resolve(option: str, actions: dict[str, argparse.Action]) -> str:
    """The full flag an abbreviation (``--integ``) or a short flag with its value (``-oFILE``) stands for."""
    if option in actions:
        return option
    if not option.startswith("--"):
        return option[:2]
    matches = [name for name in actions if name.startswith(option)]
    return matches[0] if len(matches) == 1 else option


# -- argument types: argparse turns their ArgumentTypeError into a usage error (exit code 2) --------
MAX_INT = 2**31 - 1  # batch sizes, epochs, counts: far above any real value, far below what overflows
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a signed 64-bit integer


def _integer(text: str, lo: int, hi: int, what: str) -> int:
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()) or not lo <= int(digits) <= hi:
        raise argparse.ArgumentTypeError(f"expected {what} from {lo} to {hi}; got {text!r}")
    return int(digits)


def model_kwarg(text: str) -> str:
    """One ``KEY=VALUE`` of --model-kwargs (timm train.py's syntax), checked for its form; kept as text."""
    key, equals, _ = text.partition("=")
    if not equals or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE with KEY a Python name (timm's --model-kwargs, e.g. depth=6); got {text!r}"
        )
    return text


def positive_int(text: str) -> int:
    return _integer(text, 1, MAX_INT, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _integer(text, 0, MAX_INT, "a non-negative integer")


def seed(text: str) -> int:
    """A seed torch accepts: an integer in [0, 2^63)."""
    return _integer(text, 0, MAX_SEED, "an integer seed")


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number; got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0; got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0; got {text!r}")
    return value


def fraction(text: str) -> float:
    value = finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1; got {text!r}")
    return value


def crop_pct(text: str) -> float:
    """timm's crop fraction: in (0, MAX_CROP] (timm's largest is 1.15)."""
    value = finite_float(text)
    if not 0 < value <= MAX_CROP:
        raise argparse.ArgumentTypeError(f"expected a number in (0, {MAX_CROP:g}]; got {text!r}")
    return value


def smoothing(text: str) -> float:
    value = finite_float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1); got {text!r}")
    return value


def clip_norm(text: str) -> float:
    """A positive gradient-norm limit, or 'none' (no clipping), which is 0."""
    return 0.0 if text.lower() == "none" else positive_float(text)


def device(text: str) -> str:
    """cpu, cuda or cuda:N (torch's device names that odeify trains on)."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N; got {text!r}")
    return text


def ema_decay(text: str) -> float:
    """A decay in [0, 1), or 'none' (no weight average), which is 0."""
    if text.lower() == "none":
        return 0.0
    value = finite_float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1) or 'none'; got {text!r}")
    return value


def steps(text: str) -> str | int:
    """'native', a positive int, or 'x' and a positive multiplier (ir.settings.parse_steps's grammar)."""
    if text.isascii() and text.isdigit() and int(text) > MAX_INT:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_INT} steps; got {text!r}")
    try:
        return parse_steps(int(text) if text.isascii() and text.isdigit() else text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def knots(text: str) -> str | int:
    """'native' or a positive int."""
    if text == "native":
        return text
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_INT:
        raise argparse.ArgumentTypeError(f"expected native or a positive integer; got {text!r}")
    return int(text)


def integrator(text: str) -> str:
    try:
        resolve_integrator(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def list_of(item):
    def parse(text: str) -> list:
        values = [item(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list; got {text!r}")
        return values

    parse.__name__ = f"list of {item.__name__}"
    return parse


integrator_list = list_of(integrator)


def epoch_list(text: str) -> list[int]:
    return sorted(set(list_of(positive_int)(text)))


def objective_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--calibrate-objective``: what calibration matches (``calibrate``, ``retarget``, ``finetune``)."""
    parser.add_argument(
        "--calibrate-objective",
        choices=CALIBRATION_OBJECTIVES,
        default=CALIBRATION_OBJECTIVE,
        help="what the fit matches: 'output' (the default) each stage's output and, on "
        "the network's last stage, the network's output too (a ViT's head reads the class token alone); "
        "'stage' each stage's output only",
    )


def memory_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--calibrate-memory``: the MiB of activations calibration holds in memory (``calibrate``,
    ``retarget``, ``finetune``)."""
    parser.add_argument(
        "--calibrate-memory",
        type=positive_int,
        default=CALIBRATION_MEMORY_MIB,
        metavar="MIB",
        help=f"MiB of activations the fit holds in memory, the rest in a temporary file; also sizes its "
        f"passes (default {CALIBRATION_MEMORY_MIB})",
    )


def calibration_arguments(parser: argparse.ArgumentParser, *, data_flag: str) -> None:
    """The calibration flags: where the images are (``data_flag``: --calibrate on retarget, --data on
    calibrate), how many, the time budget and the seed."""
    group = parser.add_argument_group("calibration (odeify.calibrate: stages fitted to the source network)")
    required = data_flag == "--data"
    group.add_argument(
        data_flag,
        metavar="DIR|digits",
        required=required,
        help="unlabelled images to fit the stages on: an image folder (its train/ split when it has "
        "one; labels are not read) or 'digits'"
        + ("" if required else "; calibrates the retargeted model before it is saved"),
    )
    group.add_argument(
        "--calibrate-images",
        type=positive_int,
        default=CALIBRATION_IMAGES,
        metavar="N",
        help=f"images read (default {CALIBRATION_IMAGES})",
    )
    group.add_argument(
        "--calibrate-steps",
        type=positive_int,
        default=CALIBRATION_STEPS,
        metavar="N",
        help=f"Adam steps per stage (default {CALIBRATION_STEPS}; a model of one deep stage, a ViT, fits "
        "on to 100 and more)",
    )
    group.add_argument(
        "--calibrate-seconds", type=positive_float, metavar="S", help="time budget of the fit (default: none)"
    )
    group.add_argument(
        "--calibrate-steps-set",
        type=list_of(steps),
        action="append",
        metavar="DEPTHS",
        help="fit one file for several depths at once, each as --steps takes it: 'native,x0.5,x0.25' "
        "(comma-separated or repeated): native keeps the blocks, each other depth gets a correction of "
        "its own; the file keeps its own depth (default: that depth alone)",
    )
    objective_argument(group)
    memory_argument(group)
    group.add_argument("--seed", type=seed, default=0, help="which images and batches (default 0)")
