"""The fine-tuning recipe: optimizer, schedule, regularisation and epochs, validated where it is made.

:data:`DEFAULT_RECIPE` was chosen from the measurements of ``benchmarks/finetune.py``
(docs/finetuning.md has them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from odeify.core.errors import ConfigError
from odeify.numerics.schemes import AsyncLeapfrog
from odeify.numerics.tableaus import Integrator
from odeify.train.depth_list import depths_text

__all__ = [
    "ALF_LR",
    "AMP_DTYPES",
    "DEFAULT_LR",
    "DEFAULT_RECIPE",
    "DEPTHS_LR",
    "EMA_WARMUP_POWER",
    "Recipe",
    "default_lr",
    "uses_alf",
    "with_lr",
]

AMP_DTYPES = (None, "bfloat16", "float16")  # timm train.py's --amp-dtype names; None: no autocast

EMA_WARMUP_POWER = 2 / 3
"""timm's warm-up of the weight average: the decay after optimizer step ``t + 1`` is
``min(ema_decay, 1 - (1 + t) ** -EMA_WARMUP_POWER)``; after 66 steps it is 0.94, so the average of a
3-epoch run of 22 batches weighs its last epoch 0.79 and its first 0.02."""


@dataclass(frozen=True)
class Recipe:
    """How :func:`finetune` trains: optimizer, learning-rate schedule, regularisation, epochs.

    The learning rate rises linearly from 0 over the first ``warmup`` fraction of all steps to ``lr``,
    then follows a cosine to 0 at the last step. ``lr=None`` (the default) is the peak chosen for the
    model's integrators and ``depths``, :func:`default_lr` (as timm's train.py leaves ``--lr`` unset to
    derive it).
    ``weight_decay`` applies to weight matrices and convolution kernels only (timm's grouping: biases,
    norms and knot biases are not decayed).
    The loss is ``(1 - distill) * cross-entropy + distill * T^2 * KL(teacher || model)`` at
    temperature ``T``: with a teacher (the converted model at native depth, which is the source
    network), the coarse model learns the source's function, not only its labels.

    ``ema_decay``: keep an exponential moving average of the weights, updated after every optimizer
    step with timm's ``ModelEmaV3`` and its warm-up (:data:`EMA_WARMUP_POWER`): the decay grows
    with the step count up to ``ema_decay``, so the average follows the recent weights, not the
    coarse start. The run then returns, validates and saves the average (the last step's weights are
    validated too). ``None`` or ``0``: no average.

    timm train.py's precision and layout flags: ``amp`` runs the forward pass and the loss under
    ``torch.autocast`` in ``"bfloat16"`` or ``"float16"`` (with a gradient scaler, which skips a
    step whose scaled gradients overflow, as timm does), ``None`` in full precision;
    ``channels_last`` trains with the model and batches in channels-last memory format.
    ``mixup``/``cutmix``: timm's ``Mixup`` alphas (0: off), trained on soft targets.
    ``opt_eps``: the optimizer's epsilon (timm's ``--opt-eps``; None: the optimizer's own, AdamW's
    1e-8). A model that already computes its teacher's function has a vanishing distillation
    gradient, which Adam divides by its own size and turns into steps of about the learning rate;
    a larger epsilon (1e-6) leaves such a model where it is (docs/finetuning.md).
    ``depths``: train one file for several depths at once, e.g. ``"native,x0.5,x0.25"`` (each batch at
    a depth drawn at random, training native's knots or that depth's own correction; every depth
    validated, the worst one deciding the best epoch: :mod:`odeify.train.depths`); None trains the
    model at the depth it runs.
    """

    epochs: int = 6
    batch_size: int = 64
    optimizer: str = "adamw"
    lr: float | None = None
    warmup: float = 0.1
    weight_decay: float = 0.05
    label_smoothing: float = 0.0
    clip_grad_norm: float | None = 5.0
    distill: float = 1.0
    temperature: float = 2.0
    ema_decay: float | None = None
    amp: str | None = None
    channels_last: bool = False
    mixup: float = 0.0
    cutmix: float = 0.0
    opt_eps: float | None = None
    depths: str | None = None

    @property
    def ema(self) -> bool:
        """Whether the recipe keeps a weight average (``ema_decay`` neither None nor 0)."""
        return bool(self.ema_decay)

    def __post_init__(self) -> None:
        if self.depths is not None:  # canonical text, so a resumed run's record compares equal
            object.__setattr__(self, "depths", depths_text(self.depths))
        checks = {
            "epochs": self.epochs >= 1,
            "batch_size": self.batch_size >= 1,
            "lr": self.lr is None or (math.isfinite(self.lr) and self.lr > 0),
            "warmup": 0 <= self.warmup < 1,
            "weight_decay": math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "label_smoothing": 0 <= self.label_smoothing < 1,
            "clip_grad_norm": self.clip_grad_norm is None or self.clip_grad_norm > 0,
            "distill": 0 <= self.distill <= 1,
            "temperature": math.isfinite(self.temperature) and self.temperature > 0,
            "ema_decay": self.ema_decay is None or 0 <= self.ema_decay < 1,
            "amp": self.amp in AMP_DTYPES,
            "mixup": math.isfinite(self.mixup) and self.mixup >= 0,
            "cutmix": math.isfinite(self.cutmix) and self.cutmix >= 0,
            "opt_eps": self.opt_eps is None or (math.isfinite(self.opt_eps) and self.opt_eps > 0),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            got = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise ConfigError(
                f"invalid fine-tuning setting(s): {got}. epochs and batch_size must be positive integers, "
                "lr a positive number or None, warmup in [0, 1), weight_decay >= 0, label_smoothing in "
                "[0, 1), clip_grad_norm positive or None, distill in [0, 1], temperature positive, "
                "ema_decay in [0, 1) or None, amp None, 'bfloat16' or 'float16', mixup and cutmix >= 0, "
                "opt_eps positive or None."
            )


DEFAULT_RECIPE = Recipe()
"""The recipe chosen by benchmarks/finetune.py on the corpus of user-like models (issue 20; see
docs/finetuning.md for the measurements): the peak learning rate of :func:`default_lr`, and 6
epochs, the shortest schedule at the 3e-4 peak that brought the furthest coarse starts of the digits
models within 0.5 point of their source."""

DEFAULT_LR = 3e-4
"""The peak learning rate where no stage integrates with ALF: 1e-3 (the recipe before, chosen on the
digits models alone) moved validation accuracy by 1.1 to 2.8 points in one step, 3e-4 by at most
0.84 over 4 seeds of the corpus."""

ALF_LR = 5e-5
"""The peak learning rate where a stage integrates with ALF, measured on the corpus (ALF at native
steps, 4 seeds; docs/finetuning.md): one step at 3e-4 took resnet18 from 98.33 to 83.84% and
resnetv2_18 from 98.61 to 74.09% (Euler: 97.77 and 99.44); at 1e-4 one step still moved resnet18 by
1.1 to 2.2 points in 3 seeds of 4, at 7e-5 resnetv2_18 by 1.1 (up) in 2. At 5e-5 one step moves no
model by a point (at most 0.84), and 6 epochs bring 21 of 24 runs within 0.5 point of the source
(resnetv2_18 ends one image short in 3 seeds), as many as 3e-4 did. ALF's parasitic mode
(docs/design.md) makes its function more sensitive to the weights than the network's own."""


DEPTHS_LR = 1e-4
"""The highest peak learning rate of a run fine-tuned for several depths (``Recipe.depths``): its knots
serve every depth, each trained on a share of the batches. Measured by benchmarks/any_depth.py (2
seeds; results/any_depth.md), 3e-4 against 1e-4: targets missed on the corpus 7 against 3 (the ViT's
half depth after 1 epoch 91.36 against 93.18, a file per depth 93.18; every native depth within one
image of its source at 1e-4, 2-3 images below at 3e-4), on resnet50 (not used to choose) 1 against 1;
the cost, digits_seed0's half depth one image lower after 3 epochs (98.89 against 99.16)."""


def default_lr(integrators: Iterable[Integrator], depths: bool = False) -> float:
    """The peak learning rate of a recipe without one, for a model whose stages use ``integrators``
    (ALF with either start counts as ALF, and so does a splitting of ALF sub-steps), fine-tuned for
    several depths or not (``depths``: at most :data:`DEPTHS_LR`)."""
    peak = ALF_LR if uses_alf(integrators) else DEFAULT_LR
    return min(peak, DEPTHS_LR) if depths else peak


def uses_alf(integrators: Iterable[Integrator]) -> bool:
    """Whether any of ``integrators`` steps with ALF: ALF with either start, or a splitting of ALF
    sub-steps."""
    alf = AsyncLeapfrog().name
    return any(isinstance(i, AsyncLeapfrog) or getattr(i, "substep", None) == alf for i in integrators)


def with_lr(recipe: Recipe, integrators: Iterable[Integrator]) -> Recipe:
    """``recipe`` with its peak learning rate set: its own, else :func:`default_lr`'s for ``integrators``
    (and for ``recipe.depths``)."""
    if recipe.lr is not None:
        return recipe
    return replace(recipe, lr=default_lr(integrators, depths=recipe.depths is not None))


CALIBRATION_IMAGES = 256
"""Calibration images by default (``odeify.calibrate``, ``--calibrate-images``): a few hundred, as
post-training reconstruction reads (BRECQ and AdaRound use 1024 ImageNet images); measured on the
corpus's 32x32 models."""

CALIBRATION_MEMORY_MIB = 128
"""MiB of activations calibration holds in memory by default (``odeify.calibrate(memory=...)`` in
bytes, ``--calibrate-memory`` in MiB); the rest goes to a temporary file
(benchmarks/results/calibration_memory.md)."""

CALIBRATION_STEPS = 50
"""Adam steps per stage by default (``odeify.calibrate(iterations=...)``, ``--calibrate-steps``). At 50
(of batch 64) a corpus model's calibration costs 0.20x to 1.49x the CPU time of one epoch of the
default fine-tuning recipe, by model and compression: the ResNets 0.20x to 1.04x, the digits model
0.98x to 1.43x, the ViT 1.04x to 1.49x; 32 images a step loses up to 10 ViT images
(benchmarks/results/calibration_budget.md). A model of one deep stage fits on: the ViT at half the
steps calibrates to 92.76 / 91.36% at 50 steps and 94.15 / 92.20% at 100 (to the output; to the
stages alone 90.53 / 90.53% and 93.04 / 91.64%), at twice the time (docs/calibration.md); a larger
learning rate does not replace the steps."""

CALIBRATION_OBJECTIVES = ("output", "stage")
"""What calibration matches (``odeify.calibrate(objective=...)``, ``--calibrate-objective``):
``"output"`` (the default, :data:`CALIBRATION_OBJECTIVE`), each stage's output and, on the network's
last stage, the network's output too; ``"stage"``, each stage's output only."""

CALIBRATION_OBJECTIVE = "output"
"""The default objective. A ViT's head reads the class token alone, so the stage loss spends 64 of
its 65 tokens on what the output never sees: fitting the output too lifts the corpus ViT at a third
of its steps from 89.42 / 87.74% to 93.59 / 94.15%, and a user's quick ViT at every compression. On
the corpus's ResNets and digits models (their pooling reads every position) it moves a row by at
most two images of 359 (a layer-drop student's by three). It loses on the ViT's 2 knots (87.19 /
89.42% against 89.97 / 90.25%), which trail the 2-block student calibrated to the output either
way (docs/calibration.md)."""
