"""The corpus of user-like models (benchmarks/corpus.py): every form it writes, read by odeify's loaders.

The quick corpus (2 training steps per timm model on 20 images, 1 epoch per digits model) is made
once for the module. Oracles: timm's meaning of train.py's args (``resolve_data_config`` reading
the input size back, the values train.py gives the flags), timm building the architecture and torch
reading the files without odeify, and the eager timm model in float64 for the converted one.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import timm
import torch
from PIL import Image

import odeify
from odeify.models import DEFAULT_MODEL_PATH
from odeify.runtime.split_stage import SplitStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import corpus  # noqa: E402  (benchmarks/ is not a package)

pytestmark = pytest.mark.usefixtures("one_thread")

FP64_TOLERANCE = 2e-14
"""max|converted - eager| / max|eager| in float64 at native depth; measured at most 1.3e-15 on the quick
corpus (AMD EPYC, 1 thread; the ViT's split stage: 0 in each form, it runs timm's operations), the
same 2e-14 that tests/test_convert.py allows over the timm zoo. Zeroing
the weights timm zero-initialises changes resnet18's and resnet26d's output by 3.4e-3 and 1.7e-3."""

ODEIFY_READS = {
    "model", "num_classes", "model_kwargs", "in_chans", "gp", "input_size",
    "img_size", "mean", "std", "interpolation", "crop_pct",
}  # fmt: skip
"""The keys of train.py's ``args`` that odeify reads, with train.py's meanings: the architecture's
(``_train_args_kwargs`` in odeify/models/checkpoints.py; ``model`` also as the checkpoint's ``arch``)
and the data config's, which ``timm.data.resolve_data_config`` reads (``train_args_data_config`` in
odeify/models/data_config.py; tests/test_user_files.py checks that eval uses them)."""

FORMS = ("train_py", "safetensors", "hf")
ZERO_INIT_LAST = ("resnet18", "resnet26d")  # timm zero-initialises their residual branches' last BN
VIT_KWARGS = {"img_size": 32, "patch_size": 8, "depth": 6}
QUICK_TIMM_MODELS = [name for name in corpus.TIMM_MODELS if name not in corpus.NOT_QUICK]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """The quick corpus, removed afterwards: its train.py checkpoints hold full-size models (0.9 GB)."""
    out = tmp_path_factory.mktemp("corpus")
    yield out, corpus.make_corpus(out, quick=True)
    shutil.rmtree(out)


def checkpoint(out: Path, name: str) -> dict:
    """The model_best.pth.tar of corpus model ``name``, read by torch alone."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(out / name / "train" / "model_best.pth.tar", weights_only=True)


def eager(out: Path, name: str) -> torch.nn.Module:
    """The oracle: timm's architecture with the EMA weights of model_best, built without odeify."""
    args = checkpoint(out, name)["args"]
    model = timm.create_model(args.model, num_classes=args.num_classes, **args.model_kwargs)
    model.load_state_dict(checkpoint(out, name)["state_dict_ema"])
    return model.eval()


def test_quick_corpus_writes_every_form(quick: tuple[Path, dict]) -> None:
    out, index = quick
    assert list(index["models"]) == corpus.model_names(quick=True)
    assert index["data"] == {"folder": "digits_png", "train": 20, "val": 20}
    for split in ("train", "val"):
        images = sorted((out / "digits_png" / split).glob("*/*.png"))
        assert len(images) == 20 and len({path.parent.name for path in images}) == 10
        with Image.open(images[0]) as image:
            assert (image.format, image.mode, image.size) == ("PNG", "RGB", (32, 32))
    for name in QUICK_TIMM_MODELS:
        forms = index["models"][name]["forms"]
        assert all((out / forms[key]).is_file() for key in ("train_py", "train_py_last", "safetensors"))
        assert {p.name for p in (out / forms["hf"]).iterdir()} == {"config.json", "model.safetensors"}
        assert 0 <= index["models"][name]["val_top1"] <= 1
        assert index["models"][name]["train_seconds"] > 0
    shipped = index["models"]["digits_seed0"]
    assert Path(shipped["forms"]["safetensors"]) == DEFAULT_MODEL_PATH and shipped["train_seconds"] is None
    assert not (out / "digits_seed0.safetensors").exists()  # the shipped model is referenced, not copied
    for seed in (1, 2):
        assert (out / index["models"][f"digits_seed{seed}"]["forms"]["safetensors"]).is_file()


@pytest.mark.parametrize("name", QUICK_TIMM_MODELS)
def test_train_py_args_hold_what_odeify_reads(quick: tuple[Path, dict], name: str) -> None:
    out, index = quick
    ckpt = checkpoint(out, name)
    saved = {"epoch", "arch", "optimizer", "version", "args", "state_dict", "state_dict_ema", "metric"}
    assert saved <= set(ckpt)
    args = ckpt["args"]
    assert isinstance(args, argparse.Namespace) and ODEIFY_READS <= set(vars(args))
    # what `train.py --img-size 32 --num-classes 10 ...` records: the flags typed, None for the rest
    assert (args.model, ckpt["arch"]) == (index["models"][name]["arch"],) * 2
    assert (args.img_size, args.num_classes) == (32, 10)
    assert (args.input_size, args.mean, args.std, args.crop_pct) == (None,) * 4
    assert args.interpolation == ""
    assert (args.opt, args.lr, args.weight_decay, args.sched, args.hflip, args.model_ema) == (
        "adamw", 1e-3, 0.05, "cosine", 0.0, True,
    )  # fmt: skip
    assert args.model_kwargs == (VIT_KWARGS if name == "vit6" else {})
    assert (args.in_chans, args.gp) == (None, None)  # the model's defaults: 3 channels, its own pooling
    # timm reads the input size back from these args, as its train.py and validate.py do
    model = timm.create_model(args.model, num_classes=args.num_classes, **args.model_kwargs)
    assert timm.data.resolve_data_config(vars(args), model=model)["input_size"] == (3, 32, 32)
    assert index["models"][name]["train_py_command"].startswith("python train.py --data-dir ")


@pytest.mark.parametrize("name", QUICK_TIMM_MODELS)
def test_forms_hold_the_ema_weights_which_differ_from_the_model(quick: tuple[Path, dict], name: str) -> None:
    out, index = quick
    ckpt = checkpoint(out, name)
    ema, raw = ckpt["state_dict_ema"], ckpt["state_dict"]
    assert ema.keys() == raw.keys()
    assert any(not torch.equal(ema[k], raw[k]) for k in ema if ema[k].is_floating_point())
    forms = index["models"][name]["forms"]
    for weights in (out / forms["safetensors"], out / forms["hf"] / "model.safetensors"):
        found = safetensors.torch.load_file(weights)
        assert found.keys() == ema.keys() and all(torch.equal(found[k], ema[k]) for k in ema)
    config = json.loads((out / forms["hf"] / "config.json").read_text())
    # save_for_hf writes timm's default data config for the architecture: 224 for the ResNets (the
    # ViT's is its own fixed 32x32 input); the corpus does not correct it, as a user's upload would not
    assert config["pretrained_cfg"]["input_size"] == ([3, 32, 32] if name == "vit6" else [3, 224, 224])


def _load(out: Path, index: dict, name: str, form: str) -> torch.nn.Module:
    """Corpus model ``name`` loaded from ``form`` the way a user of that form calls odeify."""
    entry = index["models"][name]
    path = out / entry["forms"][form]
    if form == "train_py":
        return odeify.load_model(path, ema=True)
    if form == "safetensors":
        return odeify.load_model(path, arch=entry["arch"], num_classes=10, **entry["model_kwargs"])
    return odeify.load_model(path)


LOAD_CASES = [(name, form) for name in QUICK_TIMM_MODELS for form in FORMS]
CONVERT_CASES = [(name, form) for name in ("resnet18", "vit6") for form in FORMS] + [
    ("resnet26d", "train_py"),
    ("resnetv2_18", "hf"),
]


@pytest.mark.parametrize(("name", "form"), LOAD_CASES)
def test_each_form_loads_the_ema_weights(quick: tuple[Path, dict], name: str, form: str) -> None:
    """The architecture a form records (the ViT's patch_size and depth too) is the one timm built."""
    out, index = quick
    reference = eager(out, name)
    loaded = _load(out, index, name, form)
    assert type(loaded) is type(reference) and not loaded.training
    found, want = loaded.state_dict(), reference.state_dict()
    assert found.keys() == want.keys() and all(torch.equal(found[k], v) for k, v in want.items())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same operations on the same weights: bit for bit
        assert torch.equal(loaded(x), reference(x))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def without_zero_init_branches(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """``model`` with the weights timm initialises to zero (the last BN of each residual branch) zeroed
    again: the function a conversion that lost the branches' training would compute."""
    fresh = timm.create_model(args.model, num_classes=args.num_classes, **args.model_kwargs).state_dict()
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        for key, param in zeroed.named_parameters():
            if key.endswith("weight") and not fresh[key].any():
                param.zero_()
    return zeroed


@pytest.mark.parametrize(("name", "form"), CONVERT_CASES)
def test_converted_forms_are_exact_at_native_depth(quick: tuple[Path, dict], name: str, form: str) -> None:
    """Every form of resnet18, one per other architecture (their forms load the same weights, above)."""
    out, index = quick
    reference = eager(out, name).double()
    converted = odeify.convert(_load(out, index, name, form).double(), input_size=(3, 32, 32))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        want, got = reference(x), converted(x)
        lost = without_zero_init_branches(reference, checkpoint(out, name)["args"])(x)
    assert relative_error(got, want) <= FP64_TOLERANCE
    if name == "vit6":  # exact because its 6 blocks are one split stage, not because nothing was lifted
        stage = converted.get_submodule("blocks_ode")
        assert isinstance(stage, SplitStage) and (stage.num_fields, stage.depth) == (2, 6)
    if name in ZERO_INIT_LAST:  # not a trivial pass: 2 steps in, those branches already change the output
        assert relative_error(lost, want) > 1e6 * FP64_TOLERANCE


def test_the_corpus_keeps_what_it_made_and_remakes_it_bit_for_bit(quick: tuple[Path, dict]) -> None:
    out, index = quick
    weights = out / index["models"]["resnetv2_18"]["forms"]["safetensors"]
    before, stamp = safetensors.torch.load_file(weights), weights.stat().st_mtime_ns
    assert corpus.make_corpus(out, quick=True)["models"] == index["models"]  # nothing retrained
    assert weights.stat().st_mtime_ns == stamp
    remade = corpus.make_corpus(out, quick=True, models=["resnetv2_18"], force=True)
    after = safetensors.torch.load_file(weights)
    assert weights.stat().st_mtime_ns != stamp and all(torch.equal(after[k], v) for k, v in before.items())
    assert remade["models"].keys() == index["models"].keys()
    with pytest.raises(corpus.CorpusError, match="--force"):
        corpus.make_corpus(out, quick=False, models=["resnetv2_18"])
    with pytest.raises(corpus.CorpusError, match="unknown corpus models"):
        corpus.make_corpus(out, quick=True, models=["resnet1000"])


def test_command_line_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        corpus.main(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert "--quick" in usage and "--force" in usage and "corpus.json" in usage
