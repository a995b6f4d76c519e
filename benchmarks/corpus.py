"""The corpus of user-like models: timm models trained the way a user's quick run trains them.

Every recipe and default of odeify was first chosen on the digits models that
``examples/train_digits.py`` trains for a long time. This script makes models like a new user's, so
that benchmarks and tests can check odeify on them (docs/corpus.md says what it measured):

- **data**: scikit-learn's 1797 digits as an ImageFolder of real 32x32 RGB PNG files,
  ``digits_png/train/<digit>/*.png`` (1438) and ``digits_png/val/<digit>/*.png`` (359): the split
  of the shipped digits model (``odeify.models.digits.digits_split``), so every model of the corpus
  is scored on the same 359 images;
- **timm models** (``pretrained=False``, timm's init as timm makes it, zero-init of the last BN of
  each residual branch included): resnet18, resnet26d, resnetv2_18 (pre-activation), resnet50,
  resnet101 (a stage of 22 blocks; neither in a ``--quick`` corpus unless named), a 6-block
  ViT-Tiny (``vit_tiny_patch16_224`` with img_size=32, patch_size=8, depth=6) and ``vit_user``, the
  same on 4x4-pixel patches for 20 epochs (a user's quick run, kept out of every recipe choice; not
  in a ``--quick`` corpus unless named), each trained as
  timm's ``train.py`` trains for the flags of a quick run (``TRAIN_PY_RECIPE``: AdamW via
  ``create_optimizer_v2``, lr 1e-3, weight decay 0.05, batch 64, 14 epochs of 22 steps (the ViT
  30) with a warm-up epoch and a cosine schedule, timm's train transforms at 32x32 without
  horizontal flip, label smoothing 0.1, a ``ModelEmaV3`` average with warm-up) and saved in the
  three forms users have: (a) ``<name>/train/model_best.pth.tar`` (with ``last.pth.tar``,
  ``summary.csv``, ``args.yaml``) written by ``timm.utils.CheckpointSaver`` as train.py writes
  them, with ``args`` as train.py records them for the command line in ``corpus.json`` (the flags
  that matter here, with train.py's names and defaults: ``train_py_args.py``); (b)
  ``<name>/<name>.safetensors``, the EMA weights of model_best as a plain state dict; (c)
  ``<name>/hf/``, the same weights written by ``timm.models.save_for_hf`` (its pretrained_cfg is
  timm's default for the architecture, 224 for the ResNets: left as a user's upload has it);
- **the digits models** of ``examples/train_digits.py --seed 0/1/2``: seed 0 is the shipped
  ``odeify/data/digits_resnet.safetensors`` (referenced, not copied), seeds 1 and 2 are trained here.

``corpus.json`` indexes them: the files of each form, validation accuracy (timm's eval transforms at
32x32), training time (wall and CPU seconds) and the commands that made them. A run is
deterministic for a seed and a thread count (its weights bit-identical to what timm's train.py
writes for the same command: a one-off check outside this repository on resnetv2_18 and the quick
corpus, docs/corpus.md), and resumable: a model
already in the index is skipped unless ``--force``.

    python benchmarks/corpus.py                       # the whole corpus into out/corpus
    python benchmarks/corpus.py --quick --out /tmp/c  # seconds: 2 steps per model on 20 images
    python benchmarks/corpus.py --models resnet18 --force
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import timm
import torch
import torch.nn.functional as F
import yaml
from machine import machine_info
from PIL import Image
from timm import utils
from timm.data import create_dataset, create_loader, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from timm.models import save_for_hf
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from timm.task import ClassificationTask
from torch import nn
from train_py_args import PARSER as TRAIN_PY_PARSER

from odeify.core.errors import OdeifyError
from odeify.core.fileio import atomic_write_bytes
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models.checkpoints import read_checkpoint_metadata
from odeify.models.digits import META_DIGITS, digits_split

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "out" / "corpus"
INDEX = "corpus.json"
DATA = "digits_png"
IMG_SIZE = 32
QUICK_PER_CLASS = 2  # --quick: 2 images per digit in each split (20 train, 20 val)

Flags = dict[str, str | tuple[str, ...] | None]  # train.py flag: its value(s), None for a switch
TIMM_MODELS: dict[str, Flags] = {  # corpus name: the train.py flags that choose the model
    "resnet18": {"--model": "resnet18"},
    "resnet26d": {"--model": "resnet26d"},
    "resnetv2_18": {"--model": "resnetv2_18"},  # the smallest pre-activation ResNetV2 timm has
    "resnet50": {"--model": "resnet50"},  # bottlenecks; runs [2, 3, 5, 2]
    "resnet101": {"--model": "resnet101"},  # a deep stage: runs [2, 3, 22, 2] (issue 22's ALF default)
    "vit6": {  # a 6-block ViT-Tiny on 4x4 patches of 8x8 pixels; a ViT from scratch needs more epochs
        "--model": "vit_tiny_patch16_224",
        "--model-kwargs": ("img_size=32", "patch_size=8", "depth=6"),
        "--epochs": "100",  # 30 left it underfit: 84.7%, training loss 1.31 and still falling
    },
    "vit_user": {  # a user's quick ViT, kept out of every recipe choice: 6 blocks on 4x4-pixel patches
        "--model": "vit_tiny_patch16_224",
        "--model-kwargs": ("img_size=32", "patch_size=4", "depth=6"),
        "--epochs": "20",  # a short run, as a user's first try is
    },
}
DIGITS_SEEDS = (0, 1, 2)
SHIPPED_DIGITS_SEED = 0  # odeify/data/digits_resnet.safetensors records train_seed 0
TRAIN_PY_RECIPE: Flags = {  # a user's quick run: the train.py flags of every timm model
    "--img-size": str(IMG_SIZE), "--num-classes": "10", "-b": "64",
    "--opt": "adamw", "--lr": "1e-3", "--weight-decay": "0.05",
    "--sched": "cosine", "--epochs": "14", "--warmup-epochs": "1",
    "--hflip": "0", "--model-ema": None, "--model-ema-warmup": None,
    "--checkpoint-hist": "1", "-j": "0", "--device": "cpu",
}  # fmt: skip
QUICK_RECIPE = {"-b": "8", "--epochs": "1", "--warmup-epochs": "0"}  # --quick: 2 steps at full lr
QUICK_DIGITS_EPOCHS = 1

__all__ = [
    "DEFAULT_OUT",
    "TIMM_MODELS",
    "TRAIN_PY_RECIPE",
    "CorpusError",
    "load_index",
    "main",
    "make_corpus",
    "model_names",
    "train_like_train_py",
    "train_py_args",
    "validation_accuracy",
    "write_digits_folder",
    "write_forms",
]


class CorpusError(OdeifyError):
    """The corpus cannot be made as asked (an unknown model, an index made with other settings)."""


NOT_QUICK = ("resnet50", "resnet101", "vit_user")
"""Models a ``--quick`` corpus leaves out unless named: the same forms and code path as resnet26d's (the
ResNets) and vit6's (vit_user), and the ResNets' files (train.py checkpoints with weights, EMA and
optimizer state, best and last) take 2.2 GB (0.5 and 1.6 GB in the default corpus)."""


def model_names(quick: bool = False) -> list[str]:
    """Every model of the default corpus (of a quick one: without :data:`NOT_QUICK`): the timm
    models, then the digits models by seed."""
    timm_models = [name for name in TIMM_MODELS if not (quick and name in NOT_QUICK)]
    return [*timm_models, *(f"digits_seed{seed}" for seed in DIGITS_SEEDS)]


# ---------------------------------------------------------------------------------------------------
# The data: digits as an ImageFolder of 32x32 RGB PNG files


def write_digits_folder(root: Path, per_class: int | None = None) -> dict[str, int]:
    """Write scikit-learn's digits under ``root/train`` and ``root/val`` as 32x32 RGB PNGs.

    The split is the shipped digits model's (``digits_split``); ``per_class`` keeps the first that
    many images of each digit in each split. Pixels are the digits' 0..16 levels scaled to 0..255 and
    upsampled bilinearly, as ``odeify.models.digits.load_digits`` upsamples them, then rounded; the
    three channels are equal. Written into a temporary folder and renamed, so a folder that exists
    is complete. Returns the image count of each split.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    splits = dict(zip(("train", "val"), digits_split(n=len(data.target)), strict=True))
    if per_class is not None:
        splits = {name: _first_per_class(idx, data.target, per_class) for name, idx in splits.items()}
    counts = {name: len(idx) for name, idx in splits.items()}
    if root.is_dir():
        return counts
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    pixels = torch.from_numpy(data.images * (255 / 16)).float().unsqueeze(1)
    images = F.interpolate(pixels, size=(IMG_SIZE, IMG_SIZE), mode="bilinear", align_corners=False)
    images = images.round().clamp(0, 255).to(torch.uint8).squeeze(1).numpy()
    for name, idx in splits.items():
        for i in idx:
            folder = partial / name / str(data.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[i], mode="L").convert("RGB").save(folder / f"{i:04d}.png")
    partial.rename(root)
    return counts


def _first_per_class(idx: np.ndarray, labels: np.ndarray, per_class: int) -> np.ndarray:
    """The first ``per_class`` indices of each label, in index order."""
    return np.sort(np.concatenate([idx[labels[idx] == label][:per_class] for label in np.unique(labels)]))


# ---------------------------------------------------------------------------------------------------
# train.py's args: its flags that the corpus uses, then what its main() sets before the first save


def train_py_args(argv: Sequence[str]) -> argparse.Namespace:
    """The ``args`` timm's train.py records for the command line ``argv`` (on one CPU process), less
    the flags that change nothing here.

    Parsed with train.py's names and defaults for the flags the corpus uses
    (``benchmarks/train_py_args.py``), then changed as train.py's ``main`` changes it before any
    checkpoint is saved: ``prefetcher``, ``grad_accum_steps`` and what
    ``timm.utils.init_distributed_device`` sets (``distributed``, ``world_size``, ``rank``,
    ``local_rank``, ``device``). The corpus always passes ``--lr`` and ``--num-classes``, the two
    values main() would otherwise fill in.
    """
    args = TRAIN_PY_PARSER.parse_args(list(argv))
    if not args.lr or args.num_classes is None:
        raise CorpusError("the corpus's train.py command lines set --lr and --num-classes")
    args.prefetcher = not args.no_prefetcher
    args.grad_accum_steps = max(1, args.grad_accum_steps)
    utils.init_distributed_device(args)
    return args


def _train_py_argv(name: str, data: Path, out: Path, *, quick: bool, seed: int) -> list[str]:
    """The train.py command line (without ``train.py``) that trains corpus model ``name``."""
    model = TIMM_MODELS[name]
    flags: Flags = {"--data-dir": str(data), **{k: v for k, v in model.items() if k not in TRAIN_PY_RECIPE}}
    flags.update(TRAIN_PY_RECIPE)
    flags.update({k: v for k, v in model.items() if k in TRAIN_PY_RECIPE})  # in the recipe's place
    flags.update({**(QUICK_RECIPE if quick else {}), "--seed": str(seed)})
    flags.update({"--output": str(out / name), "--experiment": "train"})
    argv = []
    for flag, value in flags.items():
        argv += [flag, *([] if value is None else [value] if isinstance(value, str) else value)]
    return argv


# ---------------------------------------------------------------------------------------------------
# Training as train.py trains (one CPU process, no AMP, mixup or gradient accumulation)


def _loaders(args: argparse.Namespace, data_config: dict[str, Any]) -> tuple[Any, Any]:
    """train.py's training and evaluation loaders for ``args`` (its create_loader arguments)."""
    mode = "RGB" if data_config["input_size"][0] == 3 else "L"
    found = {
        split: create_dataset(
            args.dataset, root=args.data_dir, split=split, is_training=training, class_map=args.class_map,
            batch_size=args.batch_size, seed=args.seed, repeats=args.epoch_repeats if training else 0.0,
            input_img_mode=mode,
        )
        for split, training in ((args.train_split, True), (args.val_split, False))
    }  # fmt: skip
    common = dict(
        mean=data_config["mean"], std=data_config["std"], pin_memory=args.pin_mem,
        img_dtype=torch.float32, device=torch.device(args.device), distributed=args.distributed,
        use_prefetcher=args.prefetcher,
    )  # fmt: skip
    train = create_loader(
        found[args.train_split], input_size=data_config["input_size"], batch_size=args.batch_size,
        is_training=True, no_aug=args.no_aug, re_prob=args.reprob, re_mode=args.remode,
        re_count=args.recount, re_split=args.resplit, train_crop_mode=args.train_crop_mode,
        scale=args.scale, ratio=args.ratio, hflip=args.hflip, vflip=args.vflip,
        color_jitter=args.color_jitter, color_jitter_prob=args.color_jitter_prob,
        grayscale_prob=args.grayscale_prob, gaussian_blur_prob=args.gaussian_blur_prob,
        auto_augment=args.aa, num_aug_repeats=args.aug_repeats, num_aug_splits=0,
        interpolation=args.train_interpolation or data_config["interpolation"],
        num_workers=args.workers, worker_seeding=args.worker_seeding,
        num_batches=args.train_batches_per_epoch, **common,
    )  # fmt: skip
    evaluation = _eval_loader(found[args.val_split], args, data_config, common)
    return train, evaluation


def _eval_loader(dataset: Any, args: argparse.Namespace, data_config: dict[str, Any], common: dict) -> Any:
    """train.py's evaluation loader: timm's eval transforms (resize, center crop) at the input size."""
    return create_loader(
        dataset, input_size=data_config["input_size"],
        batch_size=args.validation_batch_size or args.batch_size, is_training=False,
        interpolation=data_config["interpolation"], num_workers=args.workers,
        crop_pct=data_config["crop_pct"], **common,
    )  # fmt: skip


def _train_epoch(task: ClassificationTask, loader: Any, optimizer: Any, scheduler: Any, epoch: int) -> float:
    """One epoch of train.py's ``train_one_epoch``; returns the mean training loss."""
    model = task.get_trainable_module()
    model.train()
    num_updates = epoch * len(loader)
    total, count = 0.0, 0
    optimizer.zero_grad()
    for images, target in loader:
        loss = task(images, target)["loss"]
        loss.backward()
        optimizer.step()
        total, count = total + loss.item() * len(images), count + len(images)
        num_updates += 1
        optimizer.zero_grad()
        task.update_ema(step=num_updates)
        scheduler.step_update(num_updates=num_updates, metric=total / count)
    return total / count


@torch.inference_mode()
def _validate(model: nn.Module, loader: Any) -> dict[str, float]:
    """train.py's ``validate``: mean cross-entropy and top-1/top-5 accuracy in percent."""
    model.eval()
    loss_fn = nn.CrossEntropyLoss()
    sums, count = {"loss": 0.0, "top1": 0.0, "top5": 0.0}, 0
    for images, target in loader:
        output = model(images)
        top1, top5 = utils.accuracy(output, target, topk=(1, 5))
        n = len(target)
        sums = {
            "loss": sums["loss"] + loss_fn(output, target).item() * n,
            "top1": sums["top1"] + top1.item() * n,
            "top5": sums["top5"] + top5.item() * n,
        }
        count += n
    return {key: value / count for key, value in sums.items()}


def train_like_train_py(argv: Sequence[str]) -> dict[str, Any]:
    """Train as ``python train.py ARGV`` does and write its output folder; returns what happened.

    The same calls in the same order as train.py's ``main`` (seeding, ``create_model``,
    ``resolve_data_config``, ``create_loader``, ``ClassificationTask`` with label smoothing,
    ``create_optimizer_v2(**optimizer_kwargs(args))``, the task's ``ModelEmaV3``,
    ``CheckpointSaver(task=...)``, ``create_scheduler_v2``), one CPU process. Each epoch validates
    the model and its EMA and saves a checkpoint ranked by the EMA's top-1, as train.py does.
    """
    args_text = yaml.safe_dump(TRAIN_PY_PARSER.parse_args(list(argv)).__dict__, default_flow_style=False)
    args = train_py_args(argv)
    utils.random_seed(args.seed, args.rank)
    in_chans = args.in_chans if args.in_chans is not None else (args.input_size or (3,))[0]
    model = timm.create_model(
        args.model, pretrained=args.pretrained, in_chans=in_chans, num_classes=args.num_classes,
        drop_rate=args.drop, drop_path_rate=args.drop_path, drop_block_rate=args.drop_block,
        global_pool=args.gp, bn_momentum=args.bn_momentum, bn_eps=args.bn_eps,
        scriptable=args.torchscript, checkpoint_path=args.initial_checkpoint, **args.model_kwargs,
    )  # fmt: skip
    data_config = resolve_data_config(vars(args), model=model)
    loader_train, loader_eval = _loaders(args, data_config)
    task = ClassificationTask(model, criterion=LabelSmoothingCrossEntropy(smoothing=args.smoothing))
    model = task.get_trainable_module()
    optimizer = create_optimizer_v2(model, **optimizer_kwargs(cfg=args), **args.opt_kwargs)
    task.setup_ema(decay=args.model_ema_decay, use_warmup=args.model_ema_warmup)
    output_dir = utils.get_outdir(args.output, args.experiment)
    saver = utils.CheckpointSaver(
        model=model, optimizer=optimizer, args=args, amp_scaler=None,
        checkpoint_dir=output_dir, recovery_dir=output_dir, decreasing=False,
        max_history=args.checkpoint_hist, task=task,
    )  # fmt: skip
    Path(output_dir, "args.yaml").write_text(args_text)
    scheduler, num_epochs = create_scheduler_v2(
        optimizer, **scheduler_kwargs(args, decreasing_metric=False), updates_per_epoch=len(loader_train)
    )
    best_metric = best_epoch = None
    for epoch in range(num_epochs):
        start = time.perf_counter()
        train_metrics = {"loss": _train_epoch(task, loader_train, optimizer, scheduler, epoch)}
        model_metrics = _validate(task.get_eval_model(), loader_eval)
        eval_metrics = _validate(task.get_eval_model(ema=True), loader_eval)
        lrs = [group["lr"] for group in optimizer.param_groups]
        utils.update_summary(
            epoch, train_metrics, eval_metrics, filename=str(Path(output_dir, "summary.csv")),
            lr=sum(lrs) / len(lrs), write_header=best_metric is None,
        )  # fmt: skip
        best_metric, best_epoch = saver.save_checkpoint(epoch, metric=eval_metrics[args.eval_metric])
        scheduler.step(epoch + 1, eval_metrics[args.eval_metric])
        print(
            f"  epoch {epoch:>2}: train loss {train_metrics['loss']:.3f}, val top-1 "
            f"{model_metrics['top1']:.2f}% (EMA {eval_metrics['top1']:.2f}%), lr {lrs[0]:.2e}, "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
    return {"best_epoch": best_epoch, "best_metric": best_metric, "epochs": num_epochs,
            "steps": num_epochs * len(loader_train), "data_config": data_config}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# The three forms of a trained timm model, and their validation accuracy


def _build(args: argparse.Namespace) -> nn.Module:
    """The architecture ``args`` trained, as train.py built it (timm's init; the weights come next)."""
    return timm.create_model(args.model, num_classes=args.num_classes, **args.model_kwargs)


def _read_train_py(path: Path) -> dict[str, Any]:
    """A train.py checkpoint, read the safe way (tensors, containers and argparse.Namespace only)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def write_forms(model_dir: Path, model: nn.Module) -> dict[str, str]:
    """Write form (b), the safetensors state dict, and (c), the Hugging Face folder, of ``model``.

    ``model`` holds the EMA weights of form (a), ``model_dir/train/model_best.pth.tar``. Returns
    every form's path relative to the corpus folder (``model_dir``'s parent).
    """
    plain = model_dir / f"{model_dir.name}.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(plain))
    save_for_hf(model, str(model_dir / "hf"), safe_serialization=True)
    root = model_dir.parent
    return {
        "train_py": str((model_dir / "train" / "model_best.pth.tar").relative_to(root)),
        "train_py_last": str((model_dir / "train" / "last.pth.tar").relative_to(root)),
        "safetensors": str(plain.relative_to(root)),
        "hf": str((model_dir / "hf").relative_to(root)),
    }


def validation_accuracy(model: nn.Module, args: argparse.Namespace) -> float:
    """Top-1 (a fraction) of ``model`` on ``args.data_dir``'s val split, with train.py's eval loader."""
    data_config = resolve_data_config(vars(args), model=model)
    dataset = create_dataset(
        args.dataset, root=args.data_dir, split=args.val_split, is_training=False, input_img_mode="RGB"
    )
    common = dict(mean=data_config["mean"], std=data_config["std"], device=torch.device("cpu"))
    loader = _eval_loader(dataset, args, data_config, {**common, "use_prefetcher": args.prefetcher})
    return _validate(model, loader)["top1"] / 100


# ---------------------------------------------------------------------------------------------------
# Making each model, and the index


@contextlib.contextmanager
def _timed() -> Iterator[dict[str, float]]:
    """Wall and CPU seconds (all threads of this process) spent inside the block."""
    spent: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    yield spent
    spent.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)


def _make_timm_model(name: str, out: Path, data: Path, *, quick: bool, seed: int) -> dict[str, Any]:
    """Train corpus model ``name`` into ``out/name`` and write its forms; its index entry."""
    model_dir = out / name
    shutil.rmtree(model_dir, ignore_errors=True)  # a model not in the index is redone from scratch
    argv = _train_py_argv(name, data, out, quick=quick, seed=seed)
    with _timed() as spent:
        run = train_like_train_py(argv)
    checkpoint = _read_train_py(model_dir / "train" / "model_best.pth.tar")
    args, model = checkpoint["args"], _build(checkpoint["args"])
    accuracy = {}
    for key in ("state_dict", "state_dict_ema"):  # the EMA weights last: the forms hold them
        model.load_state_dict(checkpoint[key])
        accuracy[key] = round(validation_accuracy(model, args), 6)
    forms = write_forms(model_dir, model)
    return {
        "kind": "timm",
        "arch": args.model,
        "model_kwargs": dict(args.model_kwargs),
        "forms": forms,
        "weights": "forms b and c hold state_dict_ema of model_best.pth.tar (form a: load it with ema=True)",
        "val_top1": accuracy["state_dict_ema"],
        "val_top1_state_dict": accuracy["state_dict"],
        "train_py_metric": run["best_metric"],
        "best_epoch": run["best_epoch"],
        "epochs": run["epochs"],
        "steps": run["steps"],
        "data_config": {k: list(v) if isinstance(v, tuple) else v for k, v in run["data_config"].items()},
        "train_seconds": round(spent["wall"], 1),
        "train_cpu_seconds": round(spent["cpu"], 1),
        "train_py_command": shlex.join(["python", "train.py", *argv]),
    }


def _make_digits_model(seed: int, out: Path, *, quick: bool, threads: int) -> dict[str, Any]:
    """The digits model of ``examples/train_digits.py --seed SEED`` (seed 0: the shipped file).

    Its ``val_top1`` is the test accuracy the script records, on the same 359 digits as the PNG
    folder's val split but read as the script reads them (``load_digits``: 1-channel tensors).
    """
    argv = ["--seed", str(seed), "--threads", str(threads)]
    if seed == SHIPPED_DIGITS_SEED:
        path, spent = DEFAULT_MODEL_PATH, {}
        command = "python examples/train_digits.py (the shipped file; not retrained here)"
    else:
        path = out / f"digits_seed{seed}.safetensors"
        argv += ["--out", str(path), *(["--epochs", str(QUICK_DIGITS_EPOCHS)] if quick else [])]
        with (
            _timed() as spent,  # its progress bars and report: the index records what they say
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            _train_digits_main()(argv)
        command = shlex.join(["python", "examples/train_digits.py", *argv])
    record = json.loads(read_checkpoint_metadata(path)[META_DIGITS])
    shown = str(path.relative_to(out)) if path.is_relative_to(out) else str(path)
    return {
        "kind": "digits",
        "arch": "odeify.digits_resnet",
        "forms": {"safetensors": shown},
        "val_top1": record["test_accuracy"],
        "epochs": record["epochs"],
        "train_seconds": round(spent["wall"], 1) if spent else None,
        "train_cpu_seconds": round(spent["cpu"], 1) if spent else None,
        "train_command": command,
    }


def _train_digits_main() -> Any:
    """``main`` of examples/train_digits.py, imported from its file (examples/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_digits", REPO / "examples" / "train_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def load_index(out: Path) -> dict[str, Any]:
    """The corpus index ``out/corpus.json`` ({} when there is none yet)."""
    path = out / INDEX
    return json.loads(path.read_text()) if path.is_file() else {}


def _complete(out: Path, entry: dict[str, Any]) -> bool:
    """Whether every file of an index entry is still there."""
    return all((out / path).exists() or Path(path).exists() for path in entry["forms"].values())


def make_corpus(
    out: Path = DEFAULT_OUT,
    *,
    quick: bool = False,
    models: Sequence[str] | None = None,
    force: bool = False,
    seed: int = 0,
    threads: int | None = None,
    command: str = "",
) -> dict[str, Any]:
    """Make the corpus's ``models`` (default: all) under ``out``; returns the index it writes.

    Models already in ``out/corpus.json`` with their files are kept unless ``force``; an index made
    with other settings (quick or not, the seed) is refused rather than mixed. ``threads`` sets
    torch's CPU threads (None: as they are); the index records the count each model trained with.
    """
    unknown = sorted(set(models or ()) - set(model_names()))
    if unknown:
        raise CorpusError(f"unknown corpus models {unknown}; the corpus has: {', '.join(model_names())}")
    settings = {"quick": quick, "seed": seed}
    index = {} if force and models is None else load_index(out)
    if index and index["settings"] != settings:
        raise CorpusError(
            f"{out / INDEX} was made with {index['settings']}, not {settings}: pass --force to remake "
            f"it, or --out another folder"
        )
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    out.mkdir(parents=True, exist_ok=True)
    counts = write_digits_folder(out / DATA, QUICK_PER_CLASS if quick else None)
    index = {"settings": settings, "data": {"folder": DATA, **counts}, "models": index.get("models", {})}
    for name in models or model_names(quick):
        entry = index["models"].get(name)
        if entry is not None and not force and _complete(out, entry):
            print(f"{name}: in the index, kept (--force remakes it)", flush=True)
            continue
        print(f"{name}: training", flush=True)
        if name in TIMM_MODELS:
            entry = _make_timm_model(name, out, out / DATA, quick=quick, seed=seed)
        else:
            seed_of_digits = int(name.removeprefix("digits_seed"))
            entry = _make_digits_model(seed_of_digits, out, quick=quick, threads=threads)
        machine = machine_info()
        entry.update(command=command, threads=threads, load=machine["load"])
        index["models"][name] = entry
        index.update(
            timm=timm.__version__, torch=torch.__version__, cpu=machine["cpu"], kernels=machine["kernels"]
        )
        atomic_write_bytes(out / INDEX, (json.dumps(index, indent=2) + "\n").encode())
        print(f"{name}: val top-1 {entry['val_top1']:.4f}, {entry['train_seconds']} s", flush=True)
    return index


def _summary(index: dict[str, Any]) -> str:
    """The index as a short table: model, validation accuracy, training time."""
    lines = [
        "| model | val top-1 | without EMA | steps | train s (wall) | train s (CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in index["models"].items():
        raw = entry.get("val_top1_state_dict")
        lines.append(
            f"| {name} | {entry['val_top1']:.2%} | {'' if raw is None else f'{raw:.2%}'} | "
            f"{entry.get('steps', '')} | {entry['train_seconds']} | {entry['train_cpu_seconds']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, make the corpus, print its summary table."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="corpus folder (default: out/corpus)")
    parser.add_argument("--quick", action="store_true", help="tiny steps on a tiny subset: for tests")
    parser.add_argument("--models", help=f"comma-separated subset of: {','.join(model_names())}")
    parser.add_argument("--force", action="store_true", help="remake models already in the index")
    parser.add_argument("--seed", type=int, default=0, help="train.py --seed of the timm models (default 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; see docs)")
    args = parser.parse_args(argv)
    models = args.models.split(",") if args.models else None
    command = shlex.join(["python", "benchmarks/corpus.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        index = make_corpus(
            args.out, quick=args.quick, models=models, force=args.force, seed=args.seed,
            threads=args.threads, command=command,
        )  # fmt: skip
    except CorpusError as exc:
        parser.error(str(exc))
    print(_summary(index))
    print(f"wrote {args.out / INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
