"""Fine-tune a converted model: the default recipe and the training loop behind ``odeify finetune``.

A converted model run coarser than native (fewer steps or knots, another integrator) loses some
accuracy; a few epochs of training get it back, memory-free when its stages use a memory-free
backward mode. :data:`DEFAULT_RECIPE` was chosen from the measurements of
``benchmarks/finetune.py`` (docs/finetuning.md has them).

The loop, :func:`finetune`:

- trains every parameter (knots, stem, downsampling blocks, head) with timm's
  ``create_optimizer_v2`` and a per-step learning rate (linear warm-up, then cosine);
- with ``recipe.ema_decay``, keeps an exponential moving average of the weights (timm's
  ``ModelEmaV3`` with its warm-up, updated after every optimizer step) and returns and saves the
  average, which is less noisy than the last step's weights; the history records both accuracies;
- evaluates on the validation split before training and after every epoch;
- with ``out``: after every epoch writes, atomically and in this order, the training state
  (``train_state.safetensors``: model, weight average, optimizer, epoch, step, history; resumable),
  the model (``last.safetensors``, readable by ``odeify.load``; the weight average when the recipe
  keeps one), ``best.safetensors`` when validation accuracy improved, and ``history.json``. A crash
  or kill leaves the previous epoch's files intact;
- ``resume=True`` continues the run recorded in ``out`` exactly: the global RNGs are reseeded from
  (seed, epoch, rank) at every epoch start and the batch order depends only on (seed, epoch), so
  the resumed epochs draw what an uninterrupted run draws;
- stops with :class:`TrainingDiverged` (naming the epoch, step and stage) at the first non-finite
  loss or gradient, before the optimizer applies it and without writing anything;
- ``refine_at``: at the start of those epochs doubles every stage's knots and steps (refinement
  evaluates the current weight path, so the function barely changes); the optimizer is rebuilt
  for the new knot tensors, keeping the state of every parameter whose shape did not change; the
  weight average is refined the same way;
- runs unchanged under ``torchrun``: DistributedDataParallel (gloo on CPU, nccl on GPU), a
  DistributedSampler shard per rank, progress, evaluation and saving on rank 0.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from odeify.compiler.conversion import converted_stages, retarget
from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError, OdeifyError
from odeify.core.fileio import atomic_write_bytes
from odeify.serialization.io import save
from odeify.train.datasets import LabelledData, make_loader
from odeify.train.evaluate import evaluate

if TYPE_CHECKING:
    from timm.utils import ModelEmaV3

__all__ = [
    "BEST_FILE",
    "DEFAULT_RECIPE",
    "HISTORY_FILE",
    "LAST_FILE",
    "STATE_FILE",
    "EpochRecord",
    "FineTuneResult",
    "Processes",
    "Recipe",
    "TrainingDiverged",
    "finetune",
    "learning_rate_factor",
    "native_depth",
    "read_run",
    "refine",
    "start_processes",
    "stop_processes",
]

LAST_FILE = "last.safetensors"
BEST_FILE = "best.safetensors"
STATE_FILE = "train_state.safetensors"
HISTORY_FILE = "history.json"
STATE_KEY = "odeify_train_state"
STATE_VERSION = 1
EMA_WARMUP_POWER = 2 / 3
"""timm's warm-up of the weight average: the decay after optimizer step ``t + 1`` is
``min(ema_decay, 1 - (1 + t) ** -EMA_WARMUP_POWER)``; after 66 steps it is 0.94, so the average of a
3-epoch run of 22 batches weighs its last epoch 0.79 and its first 0.02."""


class TrainingDiverged(OdeifyError):
    """A loss or gradient became NaN or infinite; the run stopped before applying it."""


@dataclass(frozen=True)
class Recipe:
    """How :func:`finetune` trains: optimizer, learning-rate schedule, regularisation, epochs.

    The learning rate rises linearly from 0 over the first ``warmup`` fraction of all steps, then
    follows a cosine to 0 at the last step. ``weight_decay`` applies to weight matrices and
    convolution kernels only (timm's grouping: biases, norms and knot biases are not decayed).
    The loss is ``(1 - distill) * cross-entropy + distill * T^2 * KL(teacher || model)`` at
    temperature ``T``: with a teacher (the converted model at native depth, which is the source
    network), the coarse model learns the source's function, not only its labels.

    ``ema_decay``: keep an exponential moving average of the weights, updated after every optimizer
    step with timm's ``ModelEmaV3`` and its warm-up (:data:`EMA_WARMUP_POWER`): the decay grows
    with the step count up to ``ema_decay``, so the average follows the recent weights, not the
    coarse start. The run then returns, validates and saves the average (the last step's weights are
    validated too). ``None`` or ``0``: no average.
    """

    epochs: int = 3
    batch_size: int = 64
    optimizer: str = "adamw"
    lr: float = 1e-3
    warmup: float = 0.1
    weight_decay: float = 0.05
    label_smoothing: float = 0.0
    clip_grad_norm: float | None = 5.0
    distill: float = 1.0
    temperature: float = 2.0
    ema_decay: float | None = None

    @property
    def ema(self) -> bool:
        """Whether the recipe keeps a weight average (``ema_decay`` neither None nor 0)."""
        return bool(self.ema_decay)

    def __post_init__(self) -> None:
        checks = {
            "epochs": self.epochs >= 1,
            "batch_size": self.batch_size >= 1,
            "lr": math.isfinite(self.lr) and self.lr > 0,
            "warmup": 0 <= self.warmup < 1,
            "weight_decay": math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "label_smoothing": 0 <= self.label_smoothing < 1,
            "clip_grad_norm": self.clip_grad_norm is None or self.clip_grad_norm > 0,
            "distill": 0 <= self.distill <= 1,
            "temperature": math.isfinite(self.temperature) and self.temperature > 0,
            "ema_decay": self.ema_decay is None or 0 <= self.ema_decay < 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            got = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise ConfigError(
                f"invalid fine-tuning setting(s): {got}. epochs and batch_size must be positive integers, "
                "lr a positive number, warmup in [0, 1), weight_decay >= 0, label_smoothing in [0, 1), "
                "clip_grad_norm positive or None, distill in [0, 1], temperature positive, ema_decay in "
                "[0, 1) or None."
            )


DEFAULT_RECIPE = Recipe()
"""The recipe chosen by benchmarks/finetune.py (see docs/finetuning.md for the measurements)."""


@dataclass
class EpochRecord:
    """One line of a run's history; epoch 0 is the model before fine-tuning (validation only).

    ``val_accuracy`` is the accuracy of the model the run returns and saves: the weight average when
    the recipe keeps one, whose last step's weights then score ``val_accuracy_raw`` (else None).
    """

    epoch: int
    val_accuracy: float
    train_loss: float | None = None
    train_accuracy: float | None = None
    seconds: float | None = None
    lr: float | None = None
    val_accuracy_raw: float | None = None
    knots: dict[str, int] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)


@dataclass
class FineTuneResult:
    """The trained model (the last epoch's, not the best), the history, and the best epoch.

    ``model`` is the weight average when the recipe keeps one (``Recipe.ema_decay``).
    """

    model: fx.GraphModule
    history: list[EpochRecord]

    @property
    def best(self) -> EpochRecord:
        """The record with the highest validation accuracy (the earliest among equals)."""
        return max(self.history, key=lambda r: (r.val_accuracy, -r.epoch))


@dataclass(frozen=True)
class Processes:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun) and its device."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def start_processes() -> Processes:
    """Join the torchrun job described by the environment (gloo on CPU, nccl on GPU), if any."""
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return Processes(device=torch.device("cuda" if cuda else "cpu"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return Processes(dist.get_rank(), dist.get_world_size(), device)


def stop_processes() -> None:
    """Leave the torchrun job, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def learning_rate_factor(step: int, total: int, warmup: float) -> float:
    """The schedule at optimizer step ``step`` of ``total``: linear warm-up, then cosine to 0."""
    warm = int(warmup * total)
    if step < warm:
        return (step + 1) / (warm + 1)
    progress = (step - warm) / max(1, total - warm)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def refine(model: fx.GraphModule) -> fx.GraphModule:
    """A new model with every stage's knots and steps doubled (the current weight path, resampled)."""
    stages = converted_stages(model)
    return retarget(
        model,
        knots={s.stage_name: 2 * s.num_knots for s in stages},
        steps={s.stage_name: 2 * s.steps for s in stages},
    )


def native_depth(model: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``model`` run as Euler at native depth (one step per block): the distillation teacher.

    With one knot per block, as converted, this is the source network itself.
    """
    return retarget(model, integrator="euler", steps="native", backward="backprop").eval()


def _check_classes(model: nn.Module, data: LabelledData) -> None:
    classes = getattr(model, "num_classes", None)
    if classes is not None and classes != data.num_classes:
        raise ConfigError(
            f"the model predicts {classes} classes but {data.name} has {data.num_classes}: distilling from "
            "the model at native depth needs the same classes. Fine-tune without distillation (recipe "
            "distill=0, CLI --distill 0) after resetting the classifier (model.reset_classifier)."
        )


def finetune(
    model: fx.GraphModule,
    data: LabelledData,
    recipe: Recipe = DEFAULT_RECIPE,
    *,
    out: str | os.PathLike[str] | None = None,
    resume: bool = False,
    refine_at: Sequence[int] = (),
    seed: int = 0,
    max_batches: int | None = None,
    workers: int = 0,
    processes: Processes | None = None,
    teacher: nn.Module | None = None,
    run_info: Mapping[str, Any] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = tqdm.write,
) -> FineTuneResult:
    """Fine-tune ``model`` (a converted model) on ``data`` with ``recipe``; see the module docstring.

    ``teacher``: what the recipe distills from (``recipe.distill > 0``); default: ``model`` at native
    depth as it is now (:func:`native_depth`); pass the model from before a knot compression, which
    is closer to the source. ``max_batches`` cuts each epoch short (quick tries). ``run_info`` is
    recorded with the run and must match on resume, with every other setting (a resumed run
    continues the recorded one). ``log`` receives one line per epoch and per event (rank 0 only).
    """
    refine_epochs = _check_arguments(model, recipe, refine_at, max_batches)
    teacher = _teacher(model, data, recipe, teacher)
    procs = processes or Processes()
    folder = Path(out) if out is not None else None
    run = {
        "recipe": asdict(recipe),
        "refine_at": refine_epochs,
        "seed": seed,
        "max_batches": max_batches,
        "world_size": procs.world_size,
        **(run_info or {}),
    }
    loader = make_loader(
        data.train, recipe.batch_size, train=True, seed=seed, rank=procs.rank, world_size=procs.world_size,
        workers=workers,
    )  # fmt: skip
    val_loader = make_loader(data.val, max(recipe.batch_size, 256), train=False, workers=workers)
    batches = min(len(loader), max_batches or len(loader))
    if batches == 0:
        raise ConfigError(
            f"the training split has {len(data.train)} samples per {procs.world_size} process(es): not one "
            f"full batch of {recipe.batch_size}. Lower --batch-size."
        )
    if procs.is_main:
        log(_header(model, procs))
    trainer = _Trainer(model.to(procs.device), recipe, procs, batches * recipe.epochs, teacher)
    if resume:
        history = _resume(trainer, _require_folder(folder), run, refine_epochs, log)
    else:
        history = _begin(trainer, val_loader, folder, log)
    for epoch in range(len(history), recipe.epochs + 1):
        if epoch in refine_epochs:
            before = _shape(trainer.model)
            kept = trainer.replace_model(refine(trainer.model))
            if procs.is_main:
                optimizer = type(trainer.optimizer).__name__
                log(_refine_message(epoch, before, _shape(trainer.model), kept, optimizer))
        _reseed(seed, epoch, procs.rank)
        loader.sampler.set_epoch(epoch)
        record = trainer.train_epoch(loader, batches, epoch, progress and procs.is_main)
        _validate_epoch(trainer, record, val_loader)
        history.append(record)
        best = max(h.val_accuracy for h in history[:-1])
        if folder is not None:
            trainer.save(folder, epoch, history, run, improved=record.val_accuracy > best)
        if procs.is_main:
            log(_epoch_line(record, recipe.epochs, best, folder))
    return FineTuneResult(trainer.output, history)


def _validate_epoch(trainer: _Trainer, record: EpochRecord, val_loader) -> None:
    """Fill in ``record``'s accuracies: the returned model's and, with a weight average, the raw weights'."""
    record.val_accuracy = _validate(trainer.output, val_loader, trainer.procs)
    if trainer.ema is not None:
        record.val_accuracy_raw = _validate(trainer.model, val_loader, trainer.procs)


def _check_arguments(
    model: nn.Module, recipe: Recipe, refine_at: Sequence[int], max_batches: int | None
) -> list[int]:
    """Refuse what cannot be trained before any work; returns the refinement epochs, sorted."""
    if not converted_stages(model):
        raise ConfigError(
            "finetune takes a converted model (odeify.convert / odeify.load); this one has no ODE stages."
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("finetune got a model without trainable parameters (every requires_grad is False).")
    refine_epochs = sorted(set(refine_at))
    if any(not 2 <= e <= recipe.epochs for e in refine_epochs):
        raise ConfigError(
            f"refine_at epochs must lie in 2..{recipe.epochs} (refining happens at the start of an epoch, "
            f"after at least one epoch at the coarse depth); got {list(refine_at)}."
        )
    if max_batches is not None and max_batches < 1:
        raise ConfigError(f"max_batches must be a positive integer or None; got {max_batches!r}.")
    return refine_epochs


def _teacher(
    model: nn.Module, data: LabelledData, recipe: Recipe, teacher: nn.Module | None
) -> nn.Module | None:
    """The model to distill from, in eval mode; None when the recipe does not distill."""
    if recipe.distill == 0:
        return None
    _check_classes(model, data)
    return (teacher if teacher is not None else native_depth(model)).eval()


def _begin(
    trainer: _Trainer, val_loader, folder: Path | None, log: Callable[[str], None]
) -> list[EpochRecord]:
    """Evaluate the model (and the teacher) before training: the history's epoch 0."""
    procs = trainer.procs
    start = EpochRecord(0, _validate(trainer.model, val_loader, procs), **_shape(trainer.model))
    if folder is not None and procs.is_main:
        save(trainer.model, folder / BEST_FILE)
    teacher = _validate(trainer.teacher, val_loader, procs) if trainer.teacher is not None else None
    if procs.is_main:
        log(f"epoch 0 (before fine-tuning): val accuracy {start.val_accuracy:.2%}")
        if teacher is not None:
            log(_teacher_line(teacher, start.val_accuracy, trainer.recipe))
    return [start]


def _resume(
    trainer: _Trainer, folder: Path, run: dict, refine_epochs: list[int], log: Callable[[str], None]
) -> list[EpochRecord]:
    """Restore the run recorded in ``folder`` (refinements, weights, optimizer); returns its history."""
    state = _read_state(folder / STATE_FILE)
    _check_same_run(state["run"], run, folder)
    for epoch in refine_epochs:
        if epoch <= state["epoch"]:
            trainer.replace_model(refine(trainer.model))
    trainer.load(state)
    if trainer.procs.is_main:
        log(f"resumed {folder} after epoch {state['epoch']} (optimizer step {trainer.step})")
    return [EpochRecord(**r) for r in state["history"]]


class _Trainer:
    """The model, its (DDP) training wrapper, optimizer, weight average and step counter; one epoch at a time.

    Under torchrun every rank holds the same weights, so every rank keeps its own (identical) average.
    """

    def __init__(
        self,
        model: fx.GraphModule,
        recipe: Recipe,
        procs: Processes,
        total_steps: int,
        teacher: nn.Module | None,
    ) -> None:
        self.recipe, self.procs, self.total_steps = recipe, procs, total_steps
        self.teacher = teacher.to(procs.device) if teacher is not None else None
        self.step = 0
        self.model = model
        self.optimizer = self._optimizer()
        self.wrapped = self._wrap()
        self.ema = self._ema()

    @property
    def output(self) -> fx.GraphModule:
        """The model the run validates, returns and saves: the weight average if kept, else the weights."""
        return self.ema.module if self.ema is not None else self.model

    def _ema(self) -> ModelEmaV3 | None:
        """timm's weight average of the (unwrapped) model with warm-up; None when the recipe keeps none."""
        if not self.recipe.ema:
            return None
        from timm.utils import ModelEmaV3

        return ModelEmaV3(
            self.model, decay=self.recipe.ema_decay, use_warmup=True, warmup_power=EMA_WARMUP_POWER
        )

    def _optimizer(self) -> torch.optim.Optimizer:
        from timm.optim import create_optimizer_v2

        return create_optimizer_v2(
            self.model, self.recipe.optimizer, lr=self.recipe.lr, weight_decay=self.recipe.weight_decay
        )

    def _wrap(self) -> nn.Module:
        if self.procs.world_size == 1:
            return self.model
        ids = [self.procs.device.index] if self.procs.device.type == "cuda" else None
        return DistributedDataParallel(self.model, device_ids=ids)

    def replace_model(self, model: fx.GraphModule) -> int:
        """Train ``model`` from now on with a new optimizer that keeps the state of unchanged parameters.

        Returns how many parameters kept their optimizer state (same name and shape).
        """
        old_params = dict(self.model.named_parameters())
        old_state = self.optimizer.state
        self.model = model.to(self.procs.device)
        self.optimizer = self._optimizer()
        kept = 0
        for name, param in self.model.named_parameters():
            old = old_params.get(name)
            if old is not None and old.shape == param.shape and old in old_state:
                self.optimizer.state[param] = {
                    k: v.clone() if torch.is_tensor(v) else v for k, v in old_state[old].items()
                }
                kept += 1
        self.wrapped = self._wrap()
        if self.ema is not None:  # the same refinement of the average keeps its shapes the model's
            self.ema.module = refine(self.ema.module).to(self.procs.device).eval()
        return kept

    def train_epoch(self, loader, batches: int, epoch: int, show: bool) -> EpochRecord:
        """One pass over ``batches`` batches; the loss and accuracy are averaged over all ranks."""
        recipe, device = self.recipe, self.procs.device
        params = [p for p in self.model.parameters() if p.requires_grad]
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples
        self.model.train()
        bar = tqdm(total=batches, desc=f"epoch {epoch}/{recipe.epochs}", disable=not show, leave=False)
        started = time.perf_counter()
        for index, (x, y) in enumerate(loader):
            if index == batches:
                break
            lr = recipe.lr * learning_rate_factor(self.step, self.total_steps, recipe.warmup)
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            x = x.to(device, dtype=model_dtype(self.model), non_blocking=True)  # as timm's --model-dtype
            y = y.to(device, non_blocking=True)
            logits = self.wrapped(x)
            loss = self._loss(logits, x, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            where = f"epoch {epoch}, batch {index + 1}/{batches} (optimizer step {self.step + 1})"
            if not torch.isfinite(loss):
                raise TrainingDiverged(
                    f"fine-tuning stopped at {where}: the loss is {loss.item()}. {_ADVICE}"
                )
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            if not torch.isfinite(norm):
                raise TrainingDiverged(
                    f"fine-tuning stopped at {where}: {_bad_gradient(self.model)}. {_ADVICE}"
                )
            if recipe.clip_grad_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(params, recipe.clip_grad_norm, norm)
            self.optimizer.step()
            self.step += 1
            if self.ema is not None:
                self.ema.update(self.model, step=self.step)
            n = len(y)
            correct = (logits.detach().argmax(1) == y).sum().item()
            totals += torch.tensor([loss.item() * n, correct, n], dtype=torch.float64)
            bar.update()
            bar.set_postfix(
                loss=f"{totals[0] / totals[2]:.3f}", acc=f"{totals[1] / totals[2]:.1%}", lr=f"{lr:.2g}"
            )
        bar.close()
        seconds = time.perf_counter() - started
        if self.procs.world_size > 1:  # on the device: nccl reduces CUDA tensors only
            totals = totals.to(self.procs.device)
            dist.all_reduce(totals)
            totals = totals.cpu()
        return EpochRecord(
            epoch=epoch,
            val_accuracy=math.nan,
            train_loss=(totals[0] / totals[2]).item(),
            train_accuracy=(totals[1] / totals[2]).item(),
            seconds=seconds,
            lr=lr,
            **_shape(self.model),
        )

    def _loss(self, logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy, mixed with the distillation loss against the teacher when the recipe asks."""
        recipe = self.recipe
        loss = F.cross_entropy(logits, y, label_smoothing=recipe.label_smoothing)
        if self.teacher is None:
            return loss
        with torch.no_grad():
            target = F.log_softmax(self.teacher(x) / recipe.temperature, dim=1)
        student = F.log_softmax(logits / recipe.temperature, dim=1)
        kl = F.kl_div(student, target, log_target=True, reduction="batchmean") * recipe.temperature**2
        return (1 - recipe.distill) * loss + recipe.distill * kl

    def save(self, folder: Path, epoch: int, history: list[EpochRecord], run: dict, improved: bool) -> None:
        """Write state, last, best (if ``improved``) and history on rank 0; every rank waits for it.

        ``last`` and ``best`` hold :attr:`output` (the weight average when kept); the state holds both.
        """
        if self.procs.is_main:
            _check_finite_weights(self.model, epoch)
            if self.ema is not None:
                _check_finite_weights(self.output, epoch)
            _write_state(folder / STATE_FILE, self, epoch, history, run)
            save(self.output, folder / LAST_FILE)
            if improved:
                save(self.output, folder / BEST_FILE)
            text = json.dumps([asdict(r) for r in history], indent=1)
            atomic_write_bytes(folder / HISTORY_FILE, text.encode())
        if self.procs.world_size > 1:
            dist.barrier()

    def load(self, state: dict) -> None:
        """Restore weights, weight average, optimizer state and step count from a read training state."""
        device = self.procs.device
        self.model.load_state_dict({k: v.to(device) for k, v in state["model"].items()})
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        if self.ema is not None:
            self.ema.module.load_state_dict({k: v.to(device) for k, v in state["ema"].items()})
            rng = _ema_rng(self.ema)
            if rng is not None and state.get("ema_rng") is not None:
                rng.set_state(state["ema_rng"])


_ADVICE = (
    "Nothing from this epoch was saved: the files from the last completed epoch are untouched. Lower the "
    "learning rate (--lr), keep gradient clipping on, or use a finer manifestation (more --steps)."
)


def _bad_gradient(model: nn.Module) -> str:
    """'the gradient of <param> (stage <name>) is nan': the first parameter with a non-finite gradient."""
    owner = {id(p): s.stage_name for s in converted_stages(model) for p in s.parameters()}
    for name, param in model.named_parameters():
        if param.grad is not None and not torch.isfinite(param.grad).all():
            value = "nan" if torch.isnan(param.grad).any() else "inf"
            where = f"stage '{owner[id(param)]}'" if id(param) in owner else "outside the ODE stages"
            return f"the gradient of {name} ({where}) is {value}"
    return "the gradient norm is not finite"


def _ema_rng(ema: ModelEmaV3) -> torch.Generator | None:
    """The RNG of timm's stochastic rounding of bfloat16 averages (recent timm): saved for an exact resume."""
    return getattr(ema, "_sr_generator", None)


def _check_finite_weights(model: nn.Module, epoch: int) -> None:
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise TrainingDiverged(
            f"after epoch {epoch} the weights {', '.join(bad[:3])} hold NaN or inf values; nothing was "
            f"saved for this epoch. {_ADVICE}"
        )


def _validate(model: nn.Module, loader, procs: Processes) -> float:
    """Validation accuracy, computed on rank 0 and shared with every rank."""
    value = torch.zeros(1, dtype=torch.float64, device=procs.device)  # nccl broadcasts CUDA tensors only
    if procs.is_main:
        value[0] = evaluate(model, loader, device=procs.device).accuracy
    if procs.world_size > 1:
        dist.broadcast(value, 0)
    return value.item()


def _shape(model: nn.Module) -> dict[str, dict[str, int]]:
    stages = converted_stages(model)
    return {
        "knots": {s.stage_name: s.num_knots for s in stages},
        "steps": {s.stage_name: s.steps for s in stages},
    }


def _reseed(seed: int, epoch: int, rank: int) -> None:
    """Seed every global RNG from (seed, epoch, rank): what an epoch draws does not depend on history."""
    value = (seed * 1_000_003 + epoch * 7_919 + rank) % 2**32
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)


def _header(model: nn.Module, procs: Processes) -> str:
    stages = "; ".join(
        f"{s.stage_name}: {s.integrator.name}, {s.steps} steps, {s.num_knots} {s.basis} knots, "
        f"backward {s.backward}"
        for s in converted_stages(model)
    )
    return f"fine-tuning on {procs.world_size} process(es) on {procs.device.type}: {stages}"


def _teacher_line(teacher_accuracy: float, start: float, recipe: Recipe) -> str:
    line = (
        f"distilling (weight {recipe.distill:g}, temperature {recipe.temperature:g}) from the model at "
        f"native depth: val accuracy {teacher_accuracy:.2%}"
    )
    if teacher_accuracy < start:
        line += " -- below the model's own; fine-tune without distillation (distill=0, --distill 0) instead"
    return line


def _refine_message(epoch: int, before: dict, after: dict, kept: int, optimizer: str) -> str:
    changes = ", ".join(
        f"{name} knots {before['knots'][name]}->{after['knots'][name]}, steps {before['steps'][name]}->"
        f"{after['steps'][name]}"
        for name in after["knots"]
    )
    return (
        f"epoch {epoch}: refined every stage ({changes}). A new {optimizer} takes over: the {kept} "
        "parameters outside the knot stacks keep their optimizer state, the refined knot stacks start "
        "with fresh moments; the learning-rate schedule continues."
    )


def _epoch_line(record: EpochRecord, epochs: int, best_before: float, folder: Path | None) -> str:
    mark = " (best)" if record.val_accuracy > best_before else ""
    saved = f"; saved {folder / LAST_FILE}" if folder is not None else ""
    raw = (
        ""
        if record.val_accuracy_raw is None
        else f" (weight average; last step {record.val_accuracy_raw:.2%})"
    )
    return (
        f"epoch {record.epoch}/{epochs}: train loss {record.train_loss:.4f}, train accuracy "
        f"{record.train_accuracy:.2%}, val accuracy {record.val_accuracy:.2%}{raw}{mark}, "
        f"{record.seconds:.1f} s{saved}"
    )


# -- the resumable training state ------------------------------------------------------------------
def _write_state(path: Path, trainer: _Trainer, epoch: int, history: list[EpochRecord], run: dict) -> None:
    """Model, weight average and optimizer tensors and a JSON record in one safetensors file (no pickles)."""
    tensors = _prefixed("model.", trainer.model)
    if trainer.ema is not None:
        tensors |= _prefixed("ema.", trainer.ema.module)
        rng = _ema_rng(trainer.ema)
        if rng is not None:
            tensors["ema_rng"] = rng.get_state()
    optimizer = trainer.optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in optimizer["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optim.{index}.{key}"] = value.detach().cpu().clone()
            else:
                scalars.setdefault(str(index), {})[key] = value
    record = {
        "version": STATE_VERSION,
        "epoch": epoch,
        "step": trainer.step,
        "history": [asdict(r) for r in history],
        "run": run,
        "param_groups": optimizer["param_groups"],
        "optimizer_scalars": scalars,
    }
    data = safetensors.torch.save(tensors, metadata={STATE_KEY: json.dumps(record)})
    atomic_write_bytes(path, data)


def _prefixed(prefix: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict on the CPU, each name under ``prefix`` (one file holds several)."""
    return {prefix + k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _unprefixed(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict :func:`_prefixed` wrote under ``prefix``."""
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def _read_record(path: Path) -> dict:
    """The JSON record of the training state at ``path`` (epoch, history, run; no tensors read)."""
    if not path.is_file():
        raise ConfigError(
            f"cannot resume: {path} does not exist. --resume continues a run whose --out folder holds the "
            f"{STATE_FILE} written after each epoch; start without --resume to begin a new run."
        )
    try:
        with safe_open(str(path), framework="pt") as handle:
            record = json.loads((handle.metadata() or {})[STATE_KEY])
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise ConfigError(
            f"cannot resume: {path} is not a training state written by odeify finetune ({exc})."
        ) from exc
    if not isinstance(record, dict) or record.get("version") != STATE_VERSION:
        version = record.get("version") if isinstance(record, dict) else None
        raise ConfigError(
            f"cannot resume: {path} has training-state version {version}, this odeify reads version "
            f"{STATE_VERSION}."
        )
    record["run"] = _with_recipe_defaults(record["run"])
    return record


def _read_state(path: Path) -> dict:
    """The training state at ``path`` as plain dicts: model, average and optimizer state dicts, epoch, run."""
    record = _read_record(path)
    try:
        tensors = safetensors.torch.load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise ConfigError(
            f"cannot resume: {path} is not a training state written by odeify finetune ({exc})."
        ) from exc
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, values in record["optimizer_scalars"].items():
        state.setdefault(int(index), {}).update(values)
    record["model"] = _unprefixed("model.", tensors)
    record["ema"] = _unprefixed("ema.", tensors)
    record["ema_rng"] = tensors.get("ema_rng")
    record["optimizer"] = {"state": state, "param_groups": record["param_groups"]}
    return record


def read_run(folder: str | os.PathLike[str]) -> dict:
    """The settings recorded with the run in ``folder`` (its ``run_info`` plus recipe, seed, refine_at)."""
    return _read_record(Path(folder) / STATE_FILE)["run"]


def _with_recipe_defaults(run: dict) -> dict:
    """``run`` with the Recipe fields added since it was recorded, at their defaults.

    A run recorded before a field existed (``ema_decay``) ran as that field's default does, so it
    resumes as the same run instead of being refused as a different one.
    """
    recipe = run.get("recipe") if isinstance(run, dict) else None
    if not isinstance(recipe, dict):
        return run
    return {**run, "recipe": {**_jsonable(asdict(Recipe())), **recipe}}


def _require_folder(folder: Path | None) -> Path:
    if folder is None:
        raise ConfigError("resume=True needs out=: the folder of the run to continue.")
    return folder


def _check_same_run(recorded: dict, current: dict, folder: Path | None) -> None:
    """Refuse to resume with settings that differ from the recorded run's (it would not be that run)."""
    differing = sorted(k for k in {*recorded, *current} if recorded.get(k) != _jsonable(current.get(k)))
    if differing:
        detail = "; ".join(f"{k}: recorded {recorded.get(k)!r}, now {current.get(k)!r}" for k in differing)
        raise ConfigError(
            f"cannot resume {folder}: the settings differ from the recorded run ({detail}). Resume with the "
            "recorded settings, or start a new run in another --out folder."
        )


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


def recipe_with(recipe: Recipe, **changes: Any) -> Recipe:
    """``recipe`` with the given fields changed; ``None`` values keep the recipe's own."""
    known = {f.name for f in fields(Recipe)}
    return replace(recipe, **{k: v for k, v in changes.items() if v is not None and k in known})
