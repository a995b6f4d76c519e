"""The train.py flags of the corpus: what ``benchmarks/corpus.py`` parses into a checkpoint's ``args``.

timm's ``train.py`` records its parsed command line, an ``argparse.Namespace``, as the ``args`` of
every checkpoint it saves, and odeify's loaders read the architecture and the data config back from
it (``model``, ``num_classes``, ``model_kwargs``, ``in_chans``, ``gp``, ``img_size``, ``input_size``,
``mean``, ``std``, ``interpolation``, ``crop_pct``). train.py is a script, not part of the timm
package, so the corpus declares here the flags it needs, under train.py's names and with train.py's
defaults (huggingface/pytorch-image-models at aa4b5850): the flags its command lines pass
(``TRAIN_PY_RECIPE``, ``TIMM_MODELS``) and every attribute that the corpus and the timm helpers it
calls read (``create_model``, ``resolve_data_config``, ``create_dataset``, ``create_loader``,
``timm.optim.optimizer_kwargs``, ``timm.scheduler.scheduler_kwargs``, the EMA's settings,
``utils.init_distributed_device``, ``utils.CheckpointSaver``). A real train.py run records about
176 keys; the others (mixup, distillation, AMP, compilation, logging, variable-size loaders, ...)
change nothing the corpus does, so its ``args`` leave them out.
"""

from __future__ import annotations

import argparse

from timm.utils import ParseKwargs

__all__ = ["PARSER", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """A parser of the train.py flags above; ``parse_args`` gives train.py's values for them."""
    parser = argparse.ArgumentParser(description="the train.py flags of the odeify corpus", add_help=False)
    for add_group in _GROUPS:
        add_group(parser)
    return parser


def _data(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data (create_dataset)")
    data.add_argument("--data-dir", metavar="DIR")
    data.add_argument("--dataset", default="", metavar="NAME", help="'' is an ImageFolder")
    data.add_argument("--train-split", default="train", metavar="NAME")
    data.add_argument("--val-split", default="validation", metavar="NAME")
    data.add_argument("--class-map", default="", metavar="FILENAME")


def _model(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (create_model; odeify's loaders read these back)")
    model.add_argument("--model", default="resnet50", metavar="MODEL")
    model.add_argument("--pretrained", action="store_true")
    model.add_argument("--initial-checkpoint", default="", metavar="PATH")
    model.add_argument("--num-classes", type=int, metavar="N", help="None: the model's default")
    model.add_argument("--gp", metavar="POOL", help="global pool; None: the model's default")
    model.add_argument("--in-chans", type=int, metavar="N", help="None: input_size[0], else 3")
    model.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs, metavar="KEY=VALUE")
    model.add_argument("--torchscript", action="store_true")
    model.add_argument("--device", default="cuda")
    model.add_argument("--drop", type=float, default=0.0, metavar="PCT", help="dropout rate")
    model.add_argument("--drop-path", type=float, metavar="PCT")
    model.add_argument("--drop-block", type=float, metavar="PCT")
    model.add_argument("--bn-momentum", type=float)
    model.add_argument("--bn-eps", type=float)


def _data_config(parser: argparse.ArgumentParser) -> None:
    config = parser.add_argument_group("data config (resolve_data_config; None or '': the model's)")
    config.add_argument("--img-size", type=int, metavar="N")
    config.add_argument("--input-size", type=int, nargs=3, metavar="N", help="C H W")
    config.add_argument("--crop-pct", type=float, metavar="N", help="center crop of evaluation")
    config.add_argument("--mean", type=float, nargs="+", metavar="MEAN")
    config.add_argument("--std", type=float, nargs="+", metavar="STD")
    config.add_argument("--interpolation", default="", metavar="NAME")


def _loaders(parser: argparse.ArgumentParser) -> None:
    loader = parser.add_argument_group("loaders (create_loader)")
    loader.add_argument("-b", "--batch-size", type=int, default=128, metavar="N")
    loader.add_argument("-vb", "--validation-batch-size", type=int, metavar="N", help="None: batch size")
    loader.add_argument("--grad-accum-steps", type=int, default=1, metavar="N")
    loader.add_argument("-j", "--workers", type=int, default=4, metavar="N")
    loader.add_argument("--pin-mem", action="store_true")
    loader.add_argument("--no-prefetcher", action="store_true")
    loader.add_argument("--worker-seeding", default="all")
    loader.add_argument("--epoch-repeats", type=float, default=0.0, metavar="N")
    loader.add_argument("--train-batches-per-epoch", type=int, metavar="N", help="None: the whole split")


def _training_transforms(parser: argparse.ArgumentParser) -> None:
    augment = parser.add_argument_group("training transforms (create_loader with is_training=True)")
    augment.add_argument("--no-aug", action="store_true")
    augment.add_argument("--train-crop-mode", metavar="MODE")
    augment.add_argument("--scale", type=float, nargs="+", default=[0.08, 1.0], metavar="PCT")
    augment.add_argument("--ratio", type=float, nargs="+", default=[3.0 / 4.0, 4.0 / 3.0], metavar="RATIO")
    augment.add_argument("--hflip", type=float, default=0.5, metavar="PROB")
    augment.add_argument("--vflip", type=float, default=0.0, metavar="PROB")
    augment.add_argument("--color-jitter", type=float, default=0.4, metavar="PCT")
    augment.add_argument("--color-jitter-prob", type=float, metavar="PROB")
    augment.add_argument("--grayscale-prob", type=float, metavar="PROB")
    augment.add_argument("--gaussian-blur-prob", type=float, metavar="PROB")
    augment.add_argument("--aa", metavar="NAME", help="AutoAugment policy; None: none")
    augment.add_argument("--aug-repeats", type=float, default=0, metavar="N")
    augment.add_argument("--reprob", type=float, default=0.0, metavar="PROB", help="random erasing")
    augment.add_argument("--remode", default="pixel")
    augment.add_argument("--recount", type=int, default=1)
    augment.add_argument("--resplit", action="store_true")
    augment.add_argument("--train-interpolation", default="random", metavar="NAME")
    augment.add_argument("--smoothing", type=float, default=0.1, help="label smoothing of the loss")


def _optimizer(parser: argparse.ArgumentParser) -> None:
    opt = parser.add_argument_group("optimizer (timm.optim.optimizer_kwargs)")
    opt.add_argument("--opt", default="sgd", metavar="OPTIMIZER")
    opt.add_argument("--lr", type=float, metavar="LR", help="None: train.py scales --lr-base")
    opt.add_argument("--weight-decay", type=float, default=2e-5)
    opt.add_argument("--momentum", type=float, default=0.9, metavar="M")
    opt.add_argument("--opt-eps", type=float, metavar="EPSILON")
    opt.add_argument("--opt-betas", type=float, nargs="+", metavar="BETA")
    opt.add_argument("--layer-decay", type=float)
    opt.add_argument("--layer-decay-min-scale", type=float, default=0)
    opt.add_argument("--layer-decay-no-opt-scale", type=float)
    opt.add_argument("--opt-kwargs", nargs="*", default={}, action=ParseKwargs, metavar="KEY=VALUE")


def _schedule(parser: argparse.ArgumentParser) -> None:
    sched = parser.add_argument_group("schedule (timm.scheduler.scheduler_kwargs)")
    sched.add_argument("--sched", default="cosine", metavar="SCHEDULER")
    sched.add_argument("--sched-on-updates", action="store_true")
    sched.add_argument("--epochs", type=int, default=300, metavar="N")
    sched.add_argument("--warmup-epochs", type=int, default=5, metavar="N")
    sched.add_argument("--warmup-lr", type=float, default=1e-5, metavar="LR")
    sched.add_argument("--warmup-prefix", action="store_true")
    sched.add_argument("--min-lr", type=float, default=0, metavar="LR")
    sched.add_argument("--cooldown-epochs", type=int, default=0, metavar="N")
    sched.add_argument("--patience-epochs", type=int, default=10, metavar="N")
    sched.add_argument("--decay-epochs", type=float, default=90, metavar="N")
    sched.add_argument("--decay-milestones", type=int, nargs="+", default=[90, 180, 270], metavar="N")
    sched.add_argument("--decay-rate", "--dr", type=float, default=0.1, metavar="RATE")
    sched.add_argument("--lr-noise", type=float, nargs="+", metavar="PCT")
    sched.add_argument("--lr-noise-pct", type=float, default=0.67, metavar="PERCENT")
    sched.add_argument("--lr-noise-std", type=float, default=1.0, metavar="STDDEV")
    sched.add_argument("--lr-cycle-mul", type=float, default=1.0, metavar="MULT")
    sched.add_argument("--lr-cycle-decay", type=float, default=0.5, metavar="MULT")
    sched.add_argument("--lr-cycle-limit", type=int, default=1, metavar="N")
    sched.add_argument("--lr-k-decay", type=float, default=1.0)


def _weight_average(parser: argparse.ArgumentParser) -> None:
    ema = parser.add_argument_group("weight average (ClassificationTask.setup_ema)")
    ema.add_argument("--model-ema", action="store_true")
    ema.add_argument("--model-ema-decay", type=float, default=0.9998)
    ema.add_argument("--model-ema-warmup", action="store_true")


def _run(parser: argparse.ArgumentParser) -> None:
    run = parser.add_argument_group("the run (seeding, CheckpointSaver, the output folder)")
    run.add_argument("--seed", type=int, default=42, metavar="S")
    run.add_argument("--eval-metric", default="top1", metavar="EVAL_METRIC", help="ranks the checkpoints")
    run.add_argument("--checkpoint-hist", type=int, default=10, metavar="N")
    run.add_argument("--output", default="", metavar="PATH")
    run.add_argument("--experiment", default="", metavar="NAME")


_GROUPS = (
    _data,
    _model,
    _data_config,
    _loaders,
    _training_transforms,
    _optimizer,
    _schedule,
    _weight_average,
    _run,
)

PARSER = build_parser()
