"""One fine-tuning run's moving parts: the model, its DDP wrapper, optimizer, weight average, step.

:class:`Trainer` runs one epoch at a time (:meth:`Trainer.train_epoch`: the learning-rate schedule,
the loss, the divergence checks, clipping, the optimizer step and the weight average), and saves and
restores itself (:mod:`odeify.train.state`). :func:`odeify.train.finetune.finetune` drives it. The
optimizer trains the source's tensors of every folded layer (:mod:`odeify.train.parametrization`)
and the model's other parameters.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from odeify.compiler.conversion import converted_stages
from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError, TrainingDiverged
from odeify.train.distributed import Processes
from odeify.train.evaluate import evaluate
from odeify.train.manifestations import refine
from odeify.train.parametrization import SourceCoordinates, param_groups
from odeify.train.peak_memory import EpochPeakMemory
from odeify.train.progress import DEFAULT_LOG_INTERVAL, BatchProgress, loss_name
from odeify.train.recipe import EMA_WARMUP_POWER, Recipe
from odeify.train.schedule import learning_rate_factor
from odeify.train.state import STATE_FILE, EpochRecord, ema_rng, write_epoch_outputs, write_state
from odeify.train.torch_compile import TorchCompile

if TYPE_CHECKING:
    from timm.utils import ModelEmaV3

__all__ = ["Trainer", "check_precision", "reseed", "stage_shape", "validate", "validation"]


class Trainer:
    """The model, its (DDP) training wrapper, optimizer, weight average and step counter; one epoch at a time.

    Under torchrun every rank holds the same weights, so every rank keeps its own (identical) average.
    With ``compiled`` (:mod:`odeify.train.torch_compile`), the model trains and validates through
    ``torch.compile``, compiled after the average is made and before DDP wraps it (timm's order), and
    the average and the teacher run compiled too; :attr:`model` and :attr:`output` stay the modules
    themselves (what is saved, averaged and optimized).
    """

    def __init__(
        self,
        model: fx.GraphModule,
        recipe: Recipe,
        procs: Processes,
        total_steps: int,
        teacher: nn.Module | None,
        compiled: TorchCompile | None = None,
    ) -> None:
        self.recipe, self.procs, self.total_steps = recipe, procs, total_steps
        self.compiled = compiled
        self.teacher = self._compile(teacher.to(procs.device)) if teacher is not None else None
        self.step = 0
        self.model = _in_layout(model, recipe)
        check_precision(model, recipe)
        self.scaler = torch.amp.GradScaler(procs.device.type, enabled=recipe.amp == "float16")
        self.mixup = _mixup(recipe, getattr(model, "num_classes", None))
        self.sources = SourceCoordinates(self.model)
        self.optimizer, self.trained = self._optimizer()
        self.ema = self._ema()
        self._compile_models()

    @property
    def output(self) -> fx.GraphModule:
        """The model the run validates, returns and saves: the weight average if kept, else the weights."""
        return self.ema.module if self.ema is not None else self.model

    @property
    def validated_output(self) -> nn.Module:
        """What validates :attr:`output`: it, or its compiled form."""
        return self.compiled_ema if self.ema is not None else self.running

    def _compile(self, module: nn.Module) -> nn.Module:
        return self.compiled(module) if self.compiled is not None else module

    def _compile_models(self) -> None:
        """The compiled model (:attr:`running`, which trains and validates), its DDP wrapper, and the
        weight average's compiled form; each the module itself when the run does not compile."""
        self.running = self._compile(self.model)
        self.wrapped = self._wrap()
        self.compiled_ema = self._compile(self.ema.module) if self.ema is not None else None

    def _ema(self) -> ModelEmaV3 | None:
        """timm's weight average of the (unwrapped) model with warm-up; None when the recipe keeps none."""
        if not self.recipe.ema:
            return None
        from timm.utils import ModelEmaV3

        return ModelEmaV3(
            self.model, decay=self.recipe.ema_decay, use_warmup=True, warmup_power=EMA_WARMUP_POWER
        )

    def _optimizer(self) -> tuple[torch.optim.Optimizer, dict[str, nn.Parameter]]:
        """timm's optimizer over the source tensors and the other parameters, and those tensors by name."""
        from timm.optim import create_optimizer_v2

        recipe = self.recipe
        groups, trained = param_groups(self.model, self.sources, recipe.weight_decay)
        eps = {} if recipe.opt_eps is None else {"eps": recipe.opt_eps}  # timm drops it where unused
        optimizer = create_optimizer_v2(
            groups, recipe.optimizer, lr=recipe.lr, weight_decay=recipe.weight_decay, **eps
        )
        return optimizer, trained

    def _wrap(self) -> nn.Module:
        if self.procs.world_size == 1:
            return self.running
        ids = [self.procs.device.index] if self.procs.device.type == "cuda" else None
        # every buffer is the same on every rank and none changes in forward (BatchNorm is folded)
        # at a depth with fewer steps than knots, some knots take no part in a batch
        unused = self.recipe.depths is not None
        return DistributedDataParallel(
            self.running, device_ids=ids, broadcast_buffers=False, find_unused_parameters=unused
        )

    def replace_model(self, model: fx.GraphModule) -> int:
        """Train ``model`` from now on with a new optimizer that keeps the state of unchanged parameters.

        Returns how many parameters kept their optimizer state (same name and shape).
        """
        old_params, old_sources = self.trained, self.sources
        old_state = self.optimizer.state
        self.model = _in_layout(model.to(self.procs.device), self.recipe)
        self.sources = SourceCoordinates(self.model)
        self.sources.adopt(old_sources)
        self.optimizer, self.trained = self._optimizer()
        kept = 0
        for name, param in self.trained.items():
            old = old_params.get(name)
            if old is not None and old.shape == param.shape and old in old_state:
                self.optimizer.state[param] = {
                    k: v.clone() if torch.is_tensor(v) else v for k, v in old_state[old].items()
                }
                kept += 1
        if self.ema is not None:  # the same refinement of the average keeps its shapes the model's
            self.ema.module = refine(self.ema.module).to(self.procs.device).eval()
        self._compile_models()
        return kept

    def train_epoch(
        self, loader, batches: int, epoch: int, show: bool, log_interval: int = DEFAULT_LOG_INTERVAL,
        before_batch: Callable[[int], None] | None = None,
    ) -> EpochRecord:  # fmt: skip
        """One pass over ``batches`` batches; the loss and accuracy are averaged over all ranks.

        ``show``: report progress (:class:`odeify.train.progress.BatchProgress`); ``before_batch(i)``
        runs before batch ``i`` (the depth switch of :mod:`odeify.train.depths`)."""
        recipe, device = self.recipe, self.procs.device
        params = list(self.trained.values())
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples
        self.running.train()
        loss = loss_name(recipe, self.teacher is not None)
        bar = BatchProgress(batches, epoch, recipe.epochs, show=show, interval=log_interval, loss=loss)
        peak = EpochPeakMemory(device)
        peak.start()
        started = time.perf_counter()
        for index, (x, y) in enumerate(loader):
            if index == batches:
                break
            if before_batch is not None:
                before_batch(index)
            lr = recipe.lr * learning_rate_factor(self.step, self.total_steps, recipe.warmup)
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            x = x.to(device, dtype=model_dtype(self.model), non_blocking=True)  # as timm's --model-dtype
            y = y.to(device, non_blocking=True)
            if recipe.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            inputs, target = self.mixup(x, y) if self.mixup is not None else (x, y)
            with _autocast(device, recipe):
                logits = self.wrapped(inputs)
                loss = self._loss(logits, inputs, target)
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            where = f"epoch {epoch}, batch {index + 1}/{batches} (optimizer step {self.step + 1})"
            if not torch.isfinite(loss):
                raise TrainingDiverged(
                    f"fine-tuning stopped at {where}: the loss is {loss.item()}. {_advice(x, y)}"
                )
            self.sources.pull()  # gradients in the source's coordinates, still scaled
            self.scaler.unscale_(self.optimizer)
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            if not torch.isfinite(norm) and not self.scaler.is_enabled():  # float16: the scaler skips
                raise TrainingDiverged(
                    f"fine-tuning stopped at {where}: {_bad_gradient(self.model)}. {_advice(x, y)}"
                )
            if recipe.clip_grad_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(params, recipe.clip_grad_norm, norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.sources.push()
            self.step += 1
            if self.ema is not None:
                self.ema.update(self.model, step=self.step)
            n = len(y)
            correct = (logits.detach().argmax(1) == y).sum().item()
            totals += torch.tensor([loss.item() * n, correct, n], dtype=torch.float64)
            bar.update((totals[0] / totals[2]).item(), (totals[1] / totals[2]).item(), lr)
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
            peak_memory_mib=peak.mib(),
            torchcompile=self.compile_label,
            **stage_shape(self.model),
        )

    @property
    def compile_label(self) -> str | None:
        """How the run compiles, as its epoch records note it (None: eager)."""
        return self.compiled.label if self.compiled is not None else None

    def _loss(self, logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy, mixed with the distillation loss against the teacher when the recipe asks."""
        recipe = self.recipe
        smoothing = 0.0 if y.is_floating_point() else recipe.label_smoothing  # Mixup's targets are smoothed
        loss = F.cross_entropy(logits, y, label_smoothing=smoothing)
        if self.teacher is None:
            return loss
        with torch.no_grad():
            target = F.log_softmax(self.teacher(x) / recipe.temperature, dim=1)
        student = F.log_softmax(logits / recipe.temperature, dim=1)
        kl = F.kl_div(student, target, log_target=True, reduction="batchmean") * recipe.temperature**2
        return (1 - recipe.distill) * loss + recipe.distill * kl

    def save(
        self, folder: Path, epoch: int, history: list[EpochRecord], run: dict, started_from: dict
    ) -> None:
        """Write the state, then last, best (if this epoch improved) and history, on rank 0; every rank
        waits for it. ``last`` and ``best`` hold :attr:`output` (the weight average when kept); the
        state holds both, and ``started_from`` (the run's fingerprint)."""
        if self.procs.is_main:
            _check_finite_weights(self.model, epoch)
            if self.ema is not None:
                _check_finite_weights(self.output, epoch)
            write_state(folder / STATE_FILE, self, epoch, history, run, started_from)
            write_epoch_outputs(folder, self.output, history)
        if self.procs.world_size > 1:
            dist.barrier()

    def load(self, state: dict) -> None:
        """Restore weights, weight average, optimizer state and step count from a read training state."""
        device = self.procs.device
        self.model.load_state_dict({k: v.to(device) for k, v in state["model"].items()})
        self.sources.load({k: v.to(device) for k, v in state["sources"].items()})
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        if self.ema is not None:
            self.ema.module.load_state_dict({k: v.to(device) for k, v in state["ema"].items()})
            rng = ema_rng(self.ema)
            if rng is not None and state.get("ema_rng") is not None:
                rng.set_state(state["ema_rng"])


_NOTHING_SAVED = "Nothing from this epoch was saved: the files from the last completed epoch are untouched."
_ADVICE = (
    f"{_NOTHING_SAVED} Lower the learning rate (--lr), keep gradient clipping on, or use a finer "
    "manifestation (more --steps)."
)
IGNORE_INDEX = -100  # cross-entropy's default: labels it skips
LARGE_INPUT = 1e4  # inputs past this magnitude are not normalised images


def _advice(x: torch.Tensor, y: torch.Tensor) -> str:
    """What to do about a non-finite loss or gradient: fix the data when the batch is the cause, else
    lower the learning rate. Runs only once training has stopped, never in the loop."""
    if not bool(torch.isfinite(x).all()):
        return (
            f"The batch holds non-finite inputs (NaN or inf): check the data, not the learning rate. "
            f"{_NOTHING_SAVED}"
        )
    if bool((y == IGNORE_INDEX).all()):
        return (
            f"Every label in the batch is the ignore index {IGNORE_INDEX}, so the loss averages over no "
            f"sample: check the labels. {_NOTHING_SAVED}"
        )
    largest = float(x.abs().max())
    if largest > LARGE_INPUT:
        return (
            f"The batch's inputs reach {largest:.3g} in magnitude: normalise the data (timm's transforms do) "
            f"before lowering the learning rate. {_NOTHING_SAVED}"
        )
    return _ADVICE


def _bad_gradient(model: nn.Module) -> str:
    """'the gradient of <param> (stage <name>) is nan': the first parameter with a non-finite gradient."""
    owner = {id(p): s.stage_name for s in converted_stages(model) for p in s.parameters()}
    for name, param in model.named_parameters():
        if param.grad is not None and not torch.isfinite(param.grad).all():
            value = "nan" if torch.isnan(param.grad).any() else "inf"
            where = f"stage '{owner[id(param)]}'" if id(param) in owner else "outside the ODE stages"
            return f"the gradient of {name} ({where}) is {value}"
    return "the gradient norm is not finite"


def _check_finite_weights(model: nn.Module, epoch: int) -> None:
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise TrainingDiverged(
            f"after epoch {epoch} the weights {', '.join(bad[:3])} hold NaN or inf values; nothing was "
            f"saved for this epoch. {_ADVICE}"
        )


def check_precision(model: nn.Module, recipe: Recipe) -> None:
    """Refuse what the recipe's precision and augmentation cannot train (a ConfigError naming the fix).

    Under autocast the memory-free backward modes would rebuild each step's state at another
    precision than the forward pass computed it, so their gradients would not be the forward's:
    ``amp`` trains with ``backprop`` or ``checkpoint`` (which replays the forward under the same
    autocast). timm's Mixup pairs each sample with another: batches of an even size.
    """
    if recipe.amp is not None:
        memory_free = sorted({s.stage_name for s in converted_stages(model) if s.backward in _REBUILT})
        if memory_free:
            raise ConfigError(
                f"--amp ({recipe.amp} autocast) cannot train stages with a reverse or reversible backward "
                f"({', '.join(memory_free)}): they rebuild states at full precision. Use --backward "
                "checkpoint (also memory-saving), or train without --amp."
            )
    if (recipe.mixup or recipe.cutmix) and recipe.batch_size % 2:
        raise ConfigError(
            f"--mixup/--cutmix mix each sample with another of its batch: the batch size must be even, "
            f"not {recipe.batch_size} (--batch-size)."
        )


_REBUILT = ("reverse", "reversible")  # backward modes that recompute states instead of storing them


def _autocast(device: torch.device, recipe: Recipe):
    """torch.autocast in the recipe's ``amp`` dtype; a context that does nothing without ``amp``."""
    dtype = getattr(torch, recipe.amp) if recipe.amp is not None else None
    return torch.autocast(device.type, dtype=dtype, enabled=recipe.amp is not None)


def _in_layout(model: fx.GraphModule, recipe: Recipe) -> fx.GraphModule:
    """``model`` in channels-last memory format when the recipe asks (timm's --channels-last)."""
    return model.to(memory_format=torch.channels_last) if recipe.channels_last else model


def _mixup(recipe: Recipe, num_classes: int | None):
    """timm's Mixup/CutMix for the recipe's alphas (label smoothing applied to its soft targets), or None."""
    if not (recipe.mixup or recipe.cutmix):
        return None
    from timm.data import Mixup

    if not num_classes:
        raise ConfigError("--mixup/--cutmix need the model's class count (model.num_classes); it has none.")
    return Mixup(
        mixup_alpha=recipe.mixup, cutmix_alpha=recipe.cutmix, label_smoothing=recipe.label_smoothing,
        num_classes=num_classes,
    )  # fmt: skip


def validate(model: nn.Module, loader, procs: Processes) -> float:
    """Validation accuracy, computed on rank 0 and shared with every rank."""
    return validation(model, loader, procs)[0]


def validation(model: nn.Module, loader, procs: Processes) -> tuple[float, float]:
    """Validation accuracy and mean loss, computed on rank 0 and shared with every rank."""
    value = torch.zeros(2, dtype=torch.float64, device=procs.device)  # nccl broadcasts CUDA tensors only
    if procs.is_main:
        result = evaluate(model, loader, device=procs.device)
        value[0], value[1] = result.accuracy, result.loss
    if procs.world_size > 1:
        dist.broadcast(value, 0)
    return value[0].item(), value[1].item()


def stage_shape(model: nn.Module) -> dict[str, dict[str, int]]:
    """Each stage's knot and step counts: what a history record notes of the model."""
    stages = converted_stages(model)
    return {
        "knots": {s.stage_name: s.num_knots for s in stages},
        "steps": {s.stage_name: s.steps for s in stages},
    }


def reseed(seed: int, epoch: int, rank: int) -> None:
    """Seed every global RNG from (seed, epoch, rank): what an epoch draws does not depend on history."""
    value = (seed * 1_000_003 + epoch * 7_919 + rank) % 2**32
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)
