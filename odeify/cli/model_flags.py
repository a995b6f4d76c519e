"""MODEL and the flags that build it, as the commands read them: the source module, its conversion,
or a converted file as saved, in the manifestation the flags ask for.

A MODEL that is a converted file (:func:`odeify.serialization.io.is_converted_file`) is loaded;
any other is built by :func:`odeify.compiler.analysis.resolve_model` (a timm name, a checkpoint, a
folder) and converted by name or path, so that the saved file can name its source.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

import odeify
from odeify.cli.data_flags import apply_data_config, check_size_flags, trace_size
from odeify.compiler.verification import VerificationError
from odeify.core.errors import ConfigError, did_you_mean
from odeify.models import DEFAULT_MODEL_PATH
from odeify.serialization.io import is_converted_file

__all__ = [
    "MANIFESTATION",
    "convert_source",
    "in_manifestation",
    "leaf_modules",
    "load_kwargs",
    "load_or_convert",
    "manifestation",
    "model_kwargs",
    "model_source",
    "random_timm_weights",
    "source_model",
]

MANIFESTATION = ("integrator", "steps", "knots", "basis", "backward")


def model_source(args: argparse.Namespace) -> str:
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


def load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The model-building flags that were given, as ``odeify.load_model`` keywords."""
    kwargs: dict[str, Any] = model_kwargs(args.model_kwargs)
    for flag in ("arch", "num_classes", "checkpoint"):
        if getattr(args, flag) is not None:
            kwargs[flag] = getattr(args, flag)
    for flag in ("pretrained", "ema"):
        if getattr(args, flag):
            kwargs[flag] = True
    return kwargs


def _refuse_converted(args: argparse.Namespace) -> None:
    if is_converted_file(model_source(args)):
        raise ConfigError(
            f"{args.model} is already a converted model. Use `odeify retarget {args.model} -o OUT ...` to "
            f"change its manifestation, or `odeify inspect {args.model}` to see it."
        )


def source_model(args: argparse.Namespace) -> tuple[nn.Module, str, tuple[int, ...]]:
    """MODEL as a module, its display name and the validated example input shape."""
    from odeify.compiler.analysis import input_shape_for, resolve_model

    check_size_flags(args)
    _refuse_converted(args)
    with seeded_random_weights(args):
        model, name = resolve_model(model_source(args), **load_kwargs(args))
    if not args.model:
        name = DEFAULT_MODEL_PATH.name
    return model, name, input_shape_for(model, trace_size(args, model))


def convert_source(args: argparse.Namespace, **settings: Any) -> fx.GraphModule:
    """MODEL converted by name or path (so that the saved file can name its source), checked unless
    --no-verify, with the data-config flags over what MODEL records (also on a failed check's model)."""
    check_size_flags(args)
    _refuse_converted(args)
    source = source_model(args)[0] if args.leaf or args.img_size is not None else None
    leaves = leaf_modules(source, args.leaf) if source is not None and args.leaf else []
    from_file = args.model if args.model and os.path.lexists(args.model) else None
    try:
        with seeded_random_weights(args):
            converted = odeify.convert(
                model_source(args), input_size=trace_size(args, source), leaf_modules=leaves,
                verify=args.verify, **load_kwargs(args), **settings,
            )  # fmt: skip
    except VerificationError as failed:
        apply_data_config(failed.converted, args, recorded=from_file)
        raise
    return apply_data_config(converted, args, recorded=from_file)


RANDOM_WEIGHTS_SEED = 0


@contextlib.contextmanager
def seeded_random_weights(args: argparse.Namespace):
    """Random weights from one seed while a timm name without weights is built.

    Such a MODEL is built twice (the source whose inert scales convert names, and the one it converts,
    checks and saves); drawn from one seed they are the same network, so the note is about that one.
    """
    if not random_timm_weights(args):
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_WEIGHTS_SEED)
        yield


def leaf_modules(model: nn.Module, names: list[str]) -> list[type[nn.Module]]:
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


def manifestation(args: argparse.Namespace) -> dict[str, Any]:
    """The manifestation flags that were given (None means: keep)."""
    return {k: getattr(args, k) for k in MANIFESTATION if getattr(args, k, None) is not None}


def load_or_convert(args: argparse.Namespace) -> tuple[fx.GraphModule, str]:
    """CONVERTED as saved, or MODEL converted at native depth; and its display name."""
    source = model_source(args)
    if is_converted_file(source):
        loaded = odeify.load(source, verify=args.verify)
        return apply_data_config(loaded, args, recorded=None), Path(source).name
    return convert_source(args), Path(args.model).name if args.model else DEFAULT_MODEL_PATH.name


def in_manifestation(args: argparse.Namespace) -> tuple[fx.GraphModule, str]:
    """:func:`load_or_convert`, in the manifestation the flags ask for (only --steps: switched in place,
    the knots neither copied nor refitted)."""
    model, name = load_or_convert(args)
    settings = manifestation(args)
    if set(settings) == {"steps"}:
        return odeify.set_steps(model, settings["steps"]), name
    return (odeify.retarget(model, **settings) if settings else model), name


def random_timm_weights(args: argparse.Namespace) -> bool:
    """True when MODEL was a timm name built without weights."""
    return bool(args.model) and not args.pretrained and not args.checkpoint and not Path(args.model).exists()
