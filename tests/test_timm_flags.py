"""timm train.py's flags on ``odeify finetune`` (issue 21, s2 and s3): each group parsed with timm's
meaning, recorded with the run, restored by ``--resume``, and doing what timm's flag does.

Oracles: timm itself (``create_transform`` with the same arguments builds the same augmentation),
the same run in full precision or the default layout (autocast changes the loss by bfloat16's
round-off, channels-last by float32's), and the recorded run read back from the training state.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import timm.data
import torch
from PIL import Image
from precision import as_float64, assert_as_accurate_as

import odeify
from odeify.cli.parser import build_parser, main
from odeify.core.errors import ConfigError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.train.datasets import Augmentation, open_data
from odeify.train.finetune import DEFAULT_RECIPE, finetune, for_training, read_run
from odeify.train.trainer import check_precision

pytestmark = pytest.mark.usefixtures("one_thread")

BFLOAT16_LOSS = 2e-2
"""|train loss under bfloat16 autocast - in float64| / float64's, on one batch of the same weights
(the shipped digits model, Euler 1 step, batch 32). Measured 3.1e-3 against float32 (AMD EPYC, 1
thread); bfloat16 keeps 8 bits of mantissa, a relative round-off of 3.9e-3 per operation: 5 of those.
Above 0: autocast ran."""
CHANNELS_LAST_FACTOR = 4.0
"""The channels-last float32 loss may be this many times as far from the float64 loss as the
contiguous float32 loss is (8-ulp floor): the convolutions may sum in another order. Measured: the
same loss here (AMD EPYC, 1 thread)."""


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("flags") / "digits_ode.safetensors"
    assert main(["convert", "-o", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder of the digits as 8x8 grayscale PNGs: 4 per class in train/, 2 in val/."""
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("digits_png")
    digits = load_digits()
    for label in range(10):
        indices = np.flatnonzero(digits.target == label)[:6]
        for i, index in enumerate(indices):
            split = root / ("train" if i < 4 else "val") / str(label)
            split.mkdir(parents=True, exist_ok=True)
            pixels = (digits.images[index] * (255 / 16)).round().astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(split / f"{index}.png")
    return root


def _parse(*argv: str):
    return build_parser().parse_args(["finetune", *argv])


def test_timm_spellings_parse_to_odeify_settings() -> None:
    args = _parse("--data-dir", "d", "-b", "8", "-j", "2", "--opt", "sgd", "--sched", "cosine",
                  "--warmup-epochs", "1", "--clip-grad", "none", "--amp", "--amp-dtype", "bfloat16",
                  "--channels-last", "--device", "cpu", "--model-ema", "--model-ema-decay", "0.99",
                  "--smoothing", "0.1", "--output", "o", "--experiment", "e",
                  "--log-interval", "5", "--opt-eps", "1e-6", "--torchcompile",
                  "--torchcompile-mode", "max-autotune")  # fmt: skip
    assert (args.data, args.batch_size, args.workers, args.optimizer) == ("d", 8, 2, "sgd")
    precision = (args.clip_grad_norm, args.use_amp, args.amp_dtype, args.channels_last)
    assert precision == (
        0.0,
        True,
        "bfloat16",
        True,
    )
    assert (args.device, args.model_ema, args.ema_decay, args.label_smoothing) == ("cpu", True, 0.99, 0.1)
    assert (args.out, args.experiment, args.log_interval, args.opt_eps) == ("o", "e", 5, 1e-6)
    assert (args.torchcompile, args.torchcompile_mode) == ("inductor", "max-autotune")  # alone: timm's const
    assert _parse("--torchcompile", "aot_eager").torchcompile == "aot_eager"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sched", "step"], "invalid choice: 'step'"),
        (["--amp-dtype", "bfloat16", "--data", "digits"], "pass --amp too"),
        (
            ["--warmup-epochs", str(DEFAULT_RECIPE.epochs), "--data", "digits"],
            f"must be below the run's {DEFAULT_RECIPE.epochs} epochs",
        ),
        (["--device", "cuda:7", "--data", "digits"], "CUDA device(s)"),
        (["--hflip", "0", "--data", "digits"], "apply to an image folder"),
        (["--torchcompile", "nosuch", "--data", "digits"], "torch._dynamo.list_backends() names"),
        (["--torchcompile-mode", "max-autotune", "--data", "digits"], "pass --torchcompile too"),
        (["--model-emma"], "did you mean --model-ema?"),
        (["--lrr", "0.1"], "did you mean --lr?"),
    ],
)
def test_timm_flags_refused_name_the_fix(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["finetune", *argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "did you mean" in message:  # the subcommand's usage, not odeify's top-level one
        assert err.startswith("usage: odeify finetune")


def test_augmentation_flags_build_timms_transform(converted: Path, folder: Path) -> None:
    model = odeify.load(converted)
    augmentation = Augmentation(scale=(0.5, 1.0), ratio=(0.9, 1.1), hflip=0.0, vflip=0.25, color_jitter=0.1,
                                aa="rand-m9-mstd0.5", reprob=0.3)  # fmt: skip
    data = open_data(folder, model, augmentation)
    config = timm.data.resolve_model_data_config(model)
    expected = timm.data.create_transform(**config, is_training=True, scale=(0.5, 1.0), ratio=(0.9, 1.1),
                                          hflip=0.0, vflip=0.25, color_jitter=0.1,
                                          auto_augment="rand-m9-mstd0.5", re_prob=0.3)  # fmt: skip
    assert repr(data.train.transform) == repr(expected)
    assert "RandomHorizontalFlip" not in repr(data.train.transform)
    default = open_data(folder, model).train.transform
    assert repr(default) == repr(timm.data.create_transform(**config, is_training=True))
    assert "RandomResizedCrop" not in repr(
        open_data(folder, model, Augmentation(no_aug=True)).train.transform
    )
    with pytest.raises(odeify.OdeifyError, match="--aa"):
        open_data(folder, model, Augmentation(aa="no-such-policy"))


def test_every_group_is_recorded_and_restored_by_resume(
    converted: Path, folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "runs" / "e1"
    argv = ["finetune", str(converted), "--data-dir", str(folder), "--steps", "1", "--epochs", "1", "-b", "4",
            "--max-batches", "1", "--opt", "sgd", "--warmup-epochs", "0", "--clip-grad", "2", "--smoothing",
            "0.1", "--hflip", "0", "--scale", "0.5", "1", "--reprob", "0.25", "--mixup", "0.2", "--amp",
            "--amp-dtype", "bfloat16", "--backward", "checkpoint", "--model-ema", "--channels-last",
            "--img-size", "8", "--output", str(tmp_path / "runs"), "--experiment", "e1",
            "--opt-eps", "1e-6"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    recorded = read_run(run)
    expected = {"optimizer": "sgd", "warmup": 0.0, "clip_grad_norm": 2.0, "label_smoothing": 0.1,
                "mixup": 0.2, "amp": "bfloat16", "ema_decay": 0.9998, "channels_last": True,
                "opt_eps": 1e-6}  # fmt: skip
    assert {k: recorded["recipe"][k] for k in expected} == expected
    cli = recorded["cli"]
    assert (cli["hflip"], cli["scale"], cli["reprob"], cli["img_size"]) == (0.0, [0.5, 1.0], 0.25, 8)
    # resume with no flags at all: every one of them comes back from the record, and the run continues
    assert main(["finetune", "--resume", "--out", str(run), "--epochs", "2", "--max-batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "extending the run from 1 to 2 epochs" in out
    again = read_run(run)
    assert {k: again["recipe"][k] for k in expected} == expected and again["cli"] == cli
    assert len(json.loads((run / "history.json").read_text())) == 3
    # a flag given on resume that differs is named
    assert main(["finetune", "--resume", "--out", str(run), "--epochs", "2", "--hflip", "0.5"]) == 2
    assert "cli.hflip: recorded 0.0, now 0.5" in capsys.readouterr().err


def _first_loss(model, data, recipe) -> float:
    result = finetune(model, data, recipe, max_batches=1, progress=False, seed=0)
    return result.history[1].train_loss


@pytest.mark.parametrize("layout", ["amp", "channels_last"])
def test_precision_and_layout_change_the_loss_by_their_round_off(converted: Path, layout: str) -> None:
    data = open_data("digits", odeify.load(converted))
    recipe = replace(DEFAULT_RECIPE, epochs=1, distill=0.0, batch_size=32)

    def model():  # noqa: ANN202
        return for_training(odeify.load(converted), "checkpoint", steps=1)

    reference = _first_loss(model(), data, recipe)
    exact = _first_loss(as_float64(model()), data, recipe)
    if layout == "amp":
        loss = _first_loss(model(), data, replace(recipe, amp="bfloat16"))
        assert 0 < abs(loss - exact) <= BFLOAT16_LOSS * exact  # autocast ran, at bfloat16's error
    else:
        trained = model()
        loss = _first_loss(trained, data, replace(recipe, channels_last=True))
        as_loss = lambda v, dtype: {"loss": torch.tensor(v, dtype=dtype)}  # noqa: E731
        assert_as_accurate_as(
            as_loss(loss, torch.float64),
            as_loss(reference, torch.float32),
            as_loss(exact, torch.float64),
            CHANNELS_LAST_FACTOR,
        )
        conv = next(p for p in trained.parameters() if p.ndim == 4 and p.shape[-1] > 1)
        assert conv.is_contiguous(memory_format=torch.channels_last)


def test_amp_refuses_the_backward_modes_that_rebuild_states(converted: Path) -> None:
    model = for_training(odeify.load(converted), "reversible", integrator="reversible_heun", steps=1)
    with pytest.raises(ConfigError, match="--backward checkpoint"):
        check_precision(model, replace(DEFAULT_RECIPE, amp="bfloat16"))
    with pytest.raises(ConfigError, match="batch size must be even"):
        check_precision(model, replace(DEFAULT_RECIPE, mixup=0.2, batch_size=5))


def test_eval_takes_timms_short_flags(converted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(converted), "--data-dir", "digits", "-b", "100", "-j", "0", "--device", "cpu",
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["batches"] == 4  # 359 digits in batches of 100
    assert DEFAULT_MODEL_PATH.is_file()


def test_opt_eps_reaches_the_optimizer(native, digits) -> None:
    """A model that computes its teacher's function (the converted digits model at native depth,
    distilling from its source) has a vanishing gradient, which AdamW at its own eps (1e-8) turns
    into steps of about the lr; opt_eps=1e-6 damps them. Measured (AMD EPYC, one step, no weight
    decay): the largest relative parameter change 2.9e-3 at 1e-8, 2.2e-4 at 1e-6 (13x)."""

    def largest_change(opt_eps: float | None) -> float:
        model = copy.deepcopy(native)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        recipe = replace(DEFAULT_RECIPE, epochs=1, batch_size=16, weight_decay=0.0, opt_eps=opt_eps)
        trained = finetune(model, digits, recipe, max_batches=1, progress=False, seed=0).model
        return max(
            float((p.detach() - before[name]).norm() / before[name].norm())
            for name, p in trained.named_parameters()
            if name in before and before[name].norm() > 0
        )

    assert largest_change(1e-6) < largest_change(None) / 4
