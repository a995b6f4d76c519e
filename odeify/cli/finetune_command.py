"""``odeify finetune``: the flags (timm's spellings too) as a run's settings, then
:func:`odeify.train.run_settings.finetune_with`.

With ``--resume`` every setting not given takes the recorded run's value
(:func:`odeify.train.run_settings.with_recorded`; ``args`` itself is not changed: the settings are
a copy).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from odeify.cli.eval_flags import check_device, require_data
from odeify.cli.model_flags import load_or_convert
from odeify.cli.parser import MODEL_EMA_DECAY
from odeify.core.errors import ConfigError
from odeify.core.paths import output_folder
from odeify.train.recipe import DEFAULT_RECIPE

__all__ = ["run_finetune"]


def run_finetune(args: argparse.Namespace) -> int:
    """Build the model in its manifestation, then fine-tune it as the settings say."""
    from odeify.train.distributed import start_processes, stop_processes
    from odeify.train.run_settings import finetune_with, recipe_from, with_recorded
    from odeify.train.state import STATE_FILE, read_run

    timm_style = _timm_flags(args)
    out = output_folder(timm_style.out, "--out", error=ConfigError)
    if not args.resume and (out / STATE_FILE).exists():
        raise ConfigError(
            f"{out} already holds a fine-tuning run. Continue it with --resume, or pass another --out folder."
        )
    run = read_run(out) if args.resume else {}
    settings = with_recorded(timm_style, run) if args.resume else timm_style
    settings.warmup = _warmup(args, settings)
    require_data(settings.data)
    recipe = recipe_from(settings, run)
    check_device(settings.device)
    processes = start_processes(settings.device)
    try:
        finetune_with(load_or_convert(settings)[0], settings, recipe, out, processes)
    finally:
        stop_processes()
    return 0


def _timm_flags(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with timm's spellings turned into odeify's settings: --experiment (the run
    folder OUT/NAME), --model-ema (an average of decay 0.9998), --amp/--amp-dtype (the recipe's amp)."""
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
