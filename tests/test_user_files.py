"""A user's files: the data config a timm model was trained with reaches odeify's eval (issue 21, s1).

The quick corpus's resnet18 (benchmarks/corpus.py: trained at 32x32 by timm's train.py recipe,
saved as train.py saves it, as a plain safetensors state dict and as a Hugging Face folder whose
config.json says 224) is converted and evaluated by the command line. The oracle is timm alone:
the eager timm model with the file's weights, on the validation images prepared by timm's eval
transforms from train.py's own ``args`` (``resolve_data_config``), as train.py validates.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import timm
import timm.data
import torch
import torch.nn.functional as F
from precision import as_float64, assert_as_accurate_as

from odeify.cli.parser import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import corpus  # noqa: E402  (benchmarks/ is not a package)

pytestmark = pytest.mark.usefixtures("one_thread")

FP32_FACTOR = 4.0
"""odeify eval's float32 loss may be this many times as far from eager timm's float64 loss as eager
timm's own float32 loss is (8-ulp floor). Measured ratios 0.004 to 0.044 on the quick corpus: both
losses are within the 8-ulp floor of float64 (AMD EPYC, 1 thread)."""
SIZES_APART = 1e-4
"""The same weights evaluated at 224x224 (timm's default data config) instead of the trained 32x32:
their loss moves 5.5e-4 to 9.3e-4 relative on the quick corpus (barely trained, so close to uniform),
far beyond float32 round-off (about 1e-7): the test can tell the two sizes apart."""


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The quick corpus's resnet18 (its train.py checkpoints hold full-size models: removed after)."""
    out = tmp_path_factory.mktemp("corpus")
    corpus.make_corpus(out, quick=True, models=["resnet18"])
    yield out
    shutil.rmtree(out)


def _checkpoint(out: Path) -> dict:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(out / "resnet18" / "train" / "model_best.pth.tar", weights_only=True)


def _eager_loss(
    out: Path, weights: str, input_size: tuple[int, int, int] | None = None
) -> tuple[float, float, float]:
    """Loss in float32 and in float64, and accuracy, of eager timm resnet18 with the checkpoint's
    ``weights`` on val, prepared as train.py prepares it (its args' data config), or at ``input_size``."""
    ckpt = _checkpoint(out)
    args = ckpt["args"]
    model = timm.create_model(args.model, num_classes=args.num_classes).eval()
    model.load_state_dict(ckpt[weights])
    recorded = (
        vars(args) if input_size is None else {**vars(args), "img_size": None, "input_size": input_size}
    )
    config = timm.data.resolve_data_config(recorded, model=model)
    dataset = timm.data.create_dataset("", root=str(out / "digits_png" / "val"), input_img_mode="RGB")
    dataset.transform = timm.data.create_transform(**config, is_training=False)
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    y = torch.tensor([dataset[i][1] for i in range(len(dataset))])
    with torch.no_grad():
        logits = model(x)
        exact = F.cross_entropy(as_float64(model)(x.double()), y).item()
    return F.cross_entropy(logits, y).item(), exact, int((logits.argmax(1) == y).sum()) / len(y)


def _odeify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


FORMS = {  # the form, the flags a user gives convert (only what the file does not record), its weights
    "train_py": ("resnet18/train/model_best.pth.tar", [], "state_dict"),
    "train_py_ema": ("resnet18/train/model_best.pth.tar", ["--ema"], "state_dict_ema"),
    "safetensors": (
        "resnet18/resnet18.safetensors", ["--arch", "resnet18", "--img-size", "32"], "state_dict_ema"
    ),
    "hf": ("resnet18/hf", ["--img-size", "32"], "state_dict_ema"),
}  # fmt: skip


@pytest.mark.parametrize("form", list(FORMS))
def test_convert_then_eval_gives_the_source_accuracy(
    quick: Path, form: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, flags, weights = FORMS[form]
    converted = tmp_path / "ode.safetensors"
    code, out, err = _odeify(capsys, "convert", str(quick / path), *flags, "-o", str(converted))
    assert code == 0, err
    assert "random 1x3x32x32 input" in err  # traced and verified at the trained size
    assert ("using the EMA weights ('state_dict_ema')" in out) == ("--ema" in flags)
    code, out, err = _odeify(capsys, "eval", str(converted), "--data", str(quick / "digits_png"), "--json")
    assert code == 0, err
    assert "warning" not in err  # the data config and the traced size agree
    result = json.loads(out)
    loss, exact, accuracy = _eager_loss(quick, weights)
    assert result["samples"] == 20 and result["accuracy"] == pytest.approx(accuracy, abs=1e-9)
    _assert_as_accurate(result["loss"], loss, exact)
    wrong, _, _ = _eager_loss(quick, weights, (3, 224, 224))  # the test can tell 224 from 32
    assert abs(wrong - exact) > SIZES_APART * exact


def test_the_hf_folder_at_its_recorded_224_warns_naming_both_sizes(
    quick: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    converted = tmp_path / "ode.safetensors"
    code, _, err = _odeify(
        capsys, "convert", str(quick / "resnet18/hf"), "--input-size", "3", "32", "32", "-o", str(converted)
    )
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("odeify: warning:")]
    assert len(warnings) == 1 and "3x224x224" in warnings[0] and "3x32x32" in warnings[0]
    assert ".py:" not in err  # a plain line, not Python's warning with its source line
    # eval at another size than the traced one: one warning, naming both, and the flag's size is used
    code, out, err = _odeify(
        capsys, "eval", str(converted), "--data", str(quick / "digits_png"), "--img-size", "48", "--json"
    )
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("odeify: warning:")]
    assert len(warnings) == 1 and "3x48x48" in warnings[0] and "3x32x32" in warnings[0]
    loss_48, exact_48, _ = _eager_loss(quick, "state_dict_ema", (3, 48, 48))
    _assert_as_accurate(json.loads(out)["loss"], loss_48, exact_48)


def _assert_as_accurate(got: float, plain: float, exact: float) -> None:
    """odeify's float32 loss judged by eager timm's float64 one, against eager float32's own error."""
    as_tensor = lambda v: {"loss": torch.tensor(v, dtype=torch.float64)}  # noqa: E731
    assert_as_accurate_as(
        as_tensor(got), {"loss": torch.tensor(plain, dtype=torch.float32)}, as_tensor(exact), FP32_FACTOR
    )


def test_convert_records_the_data_config_flags(
    quick: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import odeify

    converted = tmp_path / "ode.safetensors"
    flags = [
        "--mean",
        "0.5",
        "--std",
        "0.25",
        "0.5",
        "0.75",
        "--interpolation",
        "bilinear",
        "--crop-pct",
        "1.0",
    ]
    code, _, err = _odeify(capsys, "convert", str(quick / "resnet18/train/model_best.pth.tar"), *flags,
                           "-o", str(converted))  # fmt: skip
    assert code == 0, err
    cfg = timm.data.resolve_model_data_config(odeify.load(converted))
    assert cfg["input_size"] == (3, 32, 32)  # from train.py's args.img_size
    assert (tuple(cfg["mean"]), tuple(cfg["std"])) == ((0.5, 0.5, 0.5), (0.25, 0.5, 0.75))
    assert (cfg["interpolation"], cfg["crop_pct"]) == ("bilinear", 1.0)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--input-size", "3", "32", "32", "--img-size", "32"], "give one"),
        (["--std", "0", "1", "1"], "expected a number above 0"),
        (["--mean", "0.5", "0.5"], "one per channel"),
        (["--crop-pct", "3"], "expected a number in (0, 2]"),
    ],
)
def test_bad_data_config_flags_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _odeify(capsys, "convert", "resnet18", "--num-classes", "10", *flags)
    assert code == 2 and message in err


def test_train_py_args_give_the_data_config_as_timm_reads_them() -> None:
    from odeify.core.errors import ModelLoadError
    from odeify.models.data_config import train_args_data_config

    def read(**recorded: object) -> dict:
        unset = dict.fromkeys(("input_size", "img_size", "in_chans", "mean", "std", "crop_pct"))
        args = argparse.Namespace(**{**unset, "interpolation": "", **recorded})
        ours = train_args_data_config(args, "ckpt")
        timms = timm.data.resolve_data_config(vars(args))  # the oracle, for every entry the args set
        assert all(
            tuple(v) == tuple(timms[k]) if isinstance(v, tuple) else v == timms[k] for k, v in ours.items()
        )
        return ours

    assert read(img_size=32) == {"input_size": (3, 32, 32)}
    assert read(img_size=32, in_chans=1, mean=[0.5], std=[0.2]) == {
        "input_size": (1, 32, 32), "mean": (0.5,), "std": (0.2,),
    }  # fmt: skip
    assert read(img_size=32, input_size=[3, 40, 48], mean=[0.5], crop_pct=1.0, interpolation="bilinear") == {
        "input_size": (3, 40, 48), "mean": (0.5, 0.5, 0.5), "crop_pct": 1.0, "interpolation": "bilinear",
    }  # fmt: skip
    assert read() == {}  # nothing set: the architecture's defaults stay, as in train.py
    with pytest.raises(ModelLoadError, match="img_size"):
        read(img_size=0)
    with pytest.raises(ModelLoadError, match="std"):
        read(std=[0.0, 1.0, 1.0])
