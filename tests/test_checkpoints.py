"""Checkpoints in: every way a timm user holds weights loads, checked against timm's own loaders.

Files are made here with timm's tools (``tests/checkpoint_files.py``); the oracle for each format is
what timm itself loads from the same file (``timm.models.load_checkpoint``, ``local-dir:`` models).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import safetensors.torch
import timm
import torch
from checkpoint_files import hf_folder, plain_pth, plain_safetensors, train_checkpoint
from precision import as_float64, assert_as_accurate_as
from timm.models import load_checkpoint
from torch import nn

import odeify
import odeify.models.loading
from odeify.core.errors import ModelLoadError
from odeify.models._testing import make_test_model
from odeify.models.checkpoints import META_ARCH, META_KWARGS
from odeify.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _x(chans: int = 3) -> torch.Tensor:
    return torch.randn(2, chans, 32, 32, generator=torch.Generator().manual_seed(3))


def _same_outputs(a: nn.Module, b: nn.Module, chans: int = 3) -> bool:
    with torch.no_grad():
        return torch.equal(a.eval()(_x(chans)), b.eval()(_x(chans)))


@pytest.fixture(scope="module")
def r18() -> nn.Module:
    return make_test_model("resnet18", num_classes=10)


@pytest.fixture(scope="module")
def train_file(r18: nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_checkpoint(r18, tmp_path_factory.mktemp("train"), "resnet18", num_classes=10)


def _timm_loaded(path: Path, use_ema: bool) -> nn.Module:
    """What timm's own loader makes of a training checkpoint (the oracle)."""
    model = timm.create_model("resnet18", num_classes=10)
    load_checkpoint(model, str(path), use_ema=use_ema)
    return model.eval()


def test_train_py_checkpoint_names_its_arch_and_head(train_file: Path) -> None:
    loaded = load_model(train_file)  # no arch=, no num_classes=: the checkpoint's arch and args say
    assert not loaded.training and loaded.num_classes == 10
    assert _same_outputs(loaded, _timm_loaded(train_file, use_ema=False))
    assert not _same_outputs(loaded, _timm_loaded(train_file, use_ema=True))  # the EMA weights differ


def test_train_py_checkpoint_ema_weights(train_file: Path, r18: nn.Module) -> None:
    assert _same_outputs(load_model(train_file, ema=True), _timm_loaded(train_file, use_ema=True))
    on_name = load_model("resnet18", checkpoint=train_file, ema=True)  # weights for a timm name
    assert _same_outputs(on_name, _timm_loaded(train_file, use_ema=True))
    fresh = make_test_model("resnet18", num_classes=10, seed=5)
    assert _same_outputs(load_model(fresh, checkpoint=train_file), _timm_loaded(train_file, use_ema=False))


def test_missing_ema_weights_are_named(tmp_path: Path, r18: nn.Module) -> None:
    path = tmp_path / "w.pth"
    torch.save({"state_dict": r18.state_dict(), "epoch": 3}, path)
    with pytest.raises(ModelLoadError, match="no EMA weights") as info:
        load_model(path, arch="resnet18", ema=True)
    assert "--ema" in str(info.value)
    with pytest.raises(ModelLoadError, match="checkpoint="):
        load_model("resnet18", ema=True)


@pytest.mark.parametrize("writer", [plain_pth, plain_safetensors], ids=["pth", "safetensors"])
def test_plain_state_dict_needs_arch_and_reads_the_head(tmp_path: Path, writer) -> None:
    model = make_test_model("resnet18", num_classes=7)
    path = writer(model, tmp_path / f"r18{'.pth' if writer is plain_pth else '.safetensors'}")
    with pytest.raises(ModelLoadError, match="arch=") as info:
        load_model(path)
    assert "--arch resnet18" in str(info.value)
    with pytest.warns(UserWarning, match=r"num_classes=7 \(from fc.weight \(7, 512\)\)"):
        loaded = load_model(path, arch="resnet18")
    assert loaded.num_classes == 7 and _same_outputs(loaded, model)
    explicit = load_model(path, arch="resnet18", num_classes=7)  # no warning needed
    assert _same_outputs(explicit, model)
    with pytest.raises(ModelLoadError, match="shape mismatch") as info:
        load_model(path, arch="resnet18", num_classes=5)
    assert "fc.weight" in str(info.value) and "--num-classes" in str(info.value)


def test_wrapped_state_dicts_are_cleaned(tmp_path: Path) -> None:
    model = make_test_model("resnet18", num_classes=7)
    path = tmp_path / "ddp.pt"
    torch.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()}}, path)
    assert _same_outputs(load_model(path, arch="resnet18", num_classes=7), model)


def test_hugging_face_folder(tmp_path: Path) -> None:
    model = make_test_model("resnet18", num_classes=5, in_chans=1)
    folder = hf_folder(model, tmp_path / "r18-gray")
    loaded = load_model(folder)
    timm_loaded = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()  # timm's own reading
    assert _same_outputs(loaded, timm_loaded, chans=1) and _same_outputs(loaded, model, chans=1)
    for key in ("input_size", "mean", "std", "crop_pct", "interpolation", "num_classes"):
        assert _plain(loaded.pretrained_cfg[key]) == _plain(timm_loaded.pretrained_cfg[key]), key
    assert timm.data.resolve_model_data_config(loaded)["mean"] == (0.449,)  # the folder's 1-channel mean


def _plain(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


class _Payload:
    """Unpickling this would write a file: the refusal test checks that it never does."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pickled_objects_are_refused_without_running_them(tmp_path: Path, r18: nn.Module) -> None:
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pth.tar"
    torch.save({"state_dict": r18.state_dict(), "arch": "resnet18", "hook": _Payload(str(marker))}, path)
    with pytest.raises(ModelLoadError, match="does not unpickle") as info:
        load_model(path)
    assert "pathlib" in str(info.value)  # names what it refused
    assert not marker.exists()


def test_directory_and_fifo_say_what_they_are(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="is a directory") as info:
        load_model(tmp_path, arch="resnet18")
    assert "config.json" in str(info.value)
    fifo = tmp_path / "pipe.pth"
    os.mkfifo(fifo)
    with pytest.raises(ModelLoadError, match="named pipe"):
        load_model(fifo, arch="resnet18")
    with pytest.raises(ModelLoadError, match="named pipe"):
        load_model("resnet18", checkpoint=fifo)
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope.safetensors")


def test_build_kwargs_from_files_are_allowlisted(tmp_path: Path, r18: nn.Module) -> None:
    state = {k: v.contiguous() for k, v in r18.state_dict().items()}
    cases = {
        "checkpoint_path": {"checkpoint_path": "/etc/passwd"},
        "pretrained": {"pretrained": True},
        "layers": {"layers": [20000, 4]},
        "must be a JSON object": ["num_classes", 10],
    }
    for expected, kwargs in cases.items():
        path = tmp_path / "k.safetensors"
        meta = {META_ARCH: "resnet18", META_KWARGS: json.dumps(kwargs)}
        safetensors.torch.save_file(state, str(path), metadata=meta)
        started = time.perf_counter()
        with pytest.raises(ModelLoadError, match=expected):
            load_model(path)
        assert time.perf_counter() - started < 5
    train = tmp_path / "t.pth.tar"
    args = argparse.Namespace(model="resnet18", num_classes=10, model_kwargs={"pretrained_cfg": {}})
    torch.save({"state_dict": r18.state_dict(), "arch": "resnet18", "args": args}, train)
    with pytest.raises(ModelLoadError, match="pretrained_cfg"):
        load_model(train)


VIT = "vit_tiny_patch16_224"
VIT_FILE_KWARGS = {
    "img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48, "num_heads": 3, "mlp_ratio": 2.5,
    "init_values": 1e-5, "reg_tokens": 1, "class_token": True, "no_embed_class": True, "qkv_bias": False,
    "qk_norm": True, "pre_norm": True, "final_norm": False, "fc_norm": True, "pos_drop_rate": 0.1,
    "patch_drop_rate": 0.1,
}  # fmt: skip
"""Every ViT build kwarg a file may carry, none at timm's default for vit_tiny_patch16_224."""


def test_vit_build_kwargs_from_files_build_what_timm_builds(tmp_path: Path) -> None:
    """A train.py checkpoint (``args.model_kwargs``) and a save_for_hf folder (``model_args``) of a
    ViT built with every allowed ViT kwarg load as timm builds and loads them (issue 23)."""
    model = make_test_model(VIT, num_classes=10, **VIT_FILE_KWARGS)
    default = timm.create_model(VIT, num_classes=10).state_dict()
    assert {k: v.shape for k, v in model.state_dict().items()} != {k: v.shape for k, v in default.items()}
    train = train_checkpoint(model, tmp_path / "train", VIT, num_classes=10, model_kwargs=VIT_FILE_KWARGS)
    folder = hf_folder(model, tmp_path / "hf")
    oracle = timm.create_model(VIT, num_classes=10, **VIT_FILE_KWARGS)
    load_checkpoint(oracle, str(train), use_ema=True)  # timm's own loader of the train.py form
    for loaded, want in ((load_model(train, ema=True), oracle), (load_model(folder), model)):
        assert type(loaded) is type(want) and loaded.state_dict().keys() == want.state_dict().keys()
        assert all(torch.equal(v, want.state_dict()[k]) for k, v in loaded.state_dict().items())
        assert _same_outputs(loaded, want)  # the same operations on the same weights: bit for bit


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"depth": 65}, "'depth' must be an integer in [1, 64]"),
        ({"patch_size": 0}, "'patch_size' must be an integer or [H, W] in [1, 4096]"),
        ({"patch_size": [8, 8, 8]}, "'patch_size' must be an integer or [H, W]"),
        ({"embed_dim": 10**6}, "'embed_dim' must be an integer in [1, 4096]"),
        ({"num_heads": 0}, "'num_heads' must be an integer in [1, 64]"),
        ({"mlp_ratio": float("nan")}, "'mlp_ratio' must be a number in (0, 16]"),
        ({"mlp_ratio": 1e9}, "'mlp_ratio' must be a number in (0, 16]"),
        ({"init_values": -1.0}, "'init_values' must be null or a LayerScale init in (0, 1]"),
        ({"reg_tokens": 10**6}, "'reg_tokens' must be an integer in [0, 16]"),
        ({"class_token": "yes"}, "'class_token' must be true or false"),
        ({"fc_norm": 1}, "'fc_norm' must be true, false or null"),
        ({"embed_layer": "os.system"}, "'embed_layer' is not one odeify takes from a file"),
    ],
)
def test_vit_build_kwargs_out_of_range_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    model = make_test_model(VIT, num_classes=10, **VIT_FILE_KWARGS)
    args = argparse.Namespace(model=VIT, num_classes=10, model_kwargs={**VIT_FILE_KWARGS, **kwargs})
    torch.save({"state_dict": model.state_dict(), "arch": VIT, "args": args}, tmp_path / "t.pth.tar")
    folder = tmp_path / "hf"
    folder.mkdir()
    config = {"architecture": VIT, "num_classes": 10, "model_args": {**VIT_FILE_KWARGS, **kwargs}}
    (folder / "config.json").write_text(json.dumps(config))
    plain_safetensors(model, folder / "model.safetensors")
    for path in (tmp_path / "t.pth.tar", folder):
        with pytest.raises(ModelLoadError) as info:
            load_model(path)
        assert message in str(info.value), str(info.value)


def test_pretrained_offline_fails_fast_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    # as on a fresh machine
    monkeypatch.setattr(odeify.models.loading, "_cached_hub_weights", lambda repo: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE") as info:
        load_model("resnet18", pretrained=True)
    assert time.perf_counter() - started < 3
    msg = str(info.value)
    assert "checkpoint=" in msg and "odeify convert resnet18 --checkpoint" in msg and "--arch resnet18" in msg
    # no HF_HUB_OFFLINE: a hub whose name does not resolve, or that never answers, is found out in seconds
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="hub.invalid, but it is not reachable"):
        load_model("resnet18", pretrained=True)
    assert time.perf_counter() - started < 3

    answered = threading.Event()

    def silent(*args: object, **kwargs: object) -> None:
        answered.wait(30)  # a hub that never answers; then times out as urlopen does
        raise TimeoutError("timed out")

    monkeypatch.setattr(urllib.request, "urlopen", silent)
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="did not answer within 2 s"):
        load_model("resnet18", pretrained=True)
    assert time.perf_counter() - started < odeify.models.loading.PROBE_TIMEOUT_S + 2
    answered.set()  # let the abandoned probe thread end now, not in a later test


def test_pretrained_weights_in_the_local_cache_load_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = make_test_model("resnet18")  # stands in for timm's resnet18.a1_in1k, as the hub cache holds it
    cached = plain_safetensors(weights, tmp_path / "model.safetensors")
    monkeypatch.setattr(odeify.models.loading, "_cached_hub_weights", lambda repo: cached)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _same_outputs(load_model("resnet18", pretrained=True), weights)
    headless = load_model("resnet18", pretrained=True, num_classes=5)  # timm drops the 1000-class head
    assert headless.fc.out_features == 5 and torch.equal(headless.conv1.weight, weights.conv1.weight)


def test_analyze_and_convert_take_the_same_arguments(tmp_path: Path) -> None:
    model = make_test_model("resnet18", num_classes=7)
    path = plain_pth(model, tmp_path / "r18.pth")
    plan = odeify.analyze(path, arch="resnet18", num_classes=7, input_size=(3, 32, 32))
    assert plan.run_lengths == [2, 1, 1, 1]  # layer1: both blocks; layers 2-4: all but the first
    converted = odeify.convert(path, arch="resnet18", num_classes=7, input_size=(3, 32, 32))
    x = _x()
    with torch.no_grad():
        out, ref, exact = converted(x), model(x), as_float64(model)(x.double())
    # measured: 0.62x of the 8-ulp floor
    assert_as_accurate_as({"logits": out}, {"logits": ref}, {"logits": exact}, 2.0)


def test_hub_and_local_dir_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = hf_folder(make_test_model("resnet18", num_classes=3), tmp_path / "r18")
    assert load_model(f"local-dir:{folder}").num_classes == 3  # timm's spelling of a folder
    with pytest.raises(ModelLoadError, match="on the hub"):
        load_model("hf-hub:timm/resnet18.a1_in1k")  # a name, not a missing file
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        load_model("hf-hub:timm/resnet18.a1_in1k", pretrained=True)


# -- issue 18: what a checkpoint may ask for, and tensors odeify cannot load --------------------------
def test_train_args_model_kwargs_must_be_a_dict(tmp_path: Path, r18: nn.Module) -> None:
    args = argparse.Namespace(model="resnet18", num_classes=10, model_kwargs=["drop_rate", 0.1])
    torch.save({"state_dict": r18.state_dict(), "arch": "resnet18", "args": args}, tmp_path / "t.pth.tar")
    with pytest.raises(ModelLoadError, match="args.model_kwargs must be a dict of build kwargs"):
        load_model(tmp_path / "t.pth.tar")


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("meta", "is a meta tensor (no values)"),
        ("sparse", "is a torch.sparse_coo tensor"),
        ("quantized", "is a quantized tensor"),
        ("complex", "is a torch.complex64 tensor"),
    ],
)
def test_tensors_odeify_cannot_load_are_named(
    tmp_path: Path, r18: nn.Module, kind: str, message: str
) -> None:
    weight = r18.state_dict()["fc.weight"]
    odd = {
        "meta": lambda: torch.empty(weight.shape, device="meta"),
        "sparse": lambda: weight.to_sparse(),
        "quantized": lambda: torch.quantize_per_tensor(weight, 0.1, 0, torch.qint8),
        "complex": lambda: weight.to(torch.complex64),
    }[kind]
    with pytest.warns(UserWarning) if kind == "quantized" else _quiet():
        state = {**r18.state_dict(), "fc.weight": odd()}
    torch.save(state, tmp_path / "w.pth")
    with pytest.raises(ModelLoadError, match="fc.weight") as info:
        load_model(tmp_path / "w.pth", arch="resnet18", num_classes=10)
    assert message in str(info.value)


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_bool_weights_are_refused_not_cast(tmp_path: Path, r18: nn.Module) -> None:
    state = {k: v.contiguous() for k, v in r18.state_dict().items()}
    state["fc.weight"] = state["fc.weight"] > 0  # loading would have made these 0 and 1
    safetensors.torch.save_file(state, str(tmp_path / "w.safetensors"))
    with pytest.raises(ModelLoadError, match=r"non-floating tensors .* fc.weight \(torch.bool\)"):
        load_model(tmp_path / "w.safetensors", arch="resnet18", num_classes=10)


@pytest.mark.parametrize(
    ("key", "shape"), [("fc.weight", (50_000_000, 0)), ("conv1.weight", (64, 50_000_000, 0, 0))]
)
def test_a_head_or_stem_size_read_from_a_tensor_has_a_files_bounds(tmp_path: Path, r18, key, shape) -> None:
    """An empty tensor of shape [5e7, 0] in a tiny file asked for a 5e7-class head (issue 18, part 5)."""
    state = {k: v.contiguous() for k, v in r18.state_dict().items()} | {key: torch.empty(shape)}
    safetensors.torch.save_file(state, str(tmp_path / "w.safetensors"))
    assert (tmp_path / "w.safetensors").stat().st_size < 50 * 2**20
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="read from its tensor shapes") as info:
        load_model(tmp_path / "w.safetensors", arch="resnet18")
    assert "must be an integer in [0, 100000]" in str(info.value) or "in [1, 64]" in str(info.value)
    assert time.perf_counter() - started < 10


def test_a_model_larger_than_the_budget_is_refused_before_it_is_built(monkeypatch) -> None:
    started = time.perf_counter()
    with pytest.raises(odeify.ConfigError, match="ODEIFY_MAX_MODEL_BYTES") as info:
        load_model("resnet18", num_classes=50_000_000)
    assert (
        "95.6 GiB" in str(info.value) and time.perf_counter() - started < 10
    )  # (512 + 1) x 5e7 x 4 bytes + 45 MB
    monkeypatch.setenv("ODEIFY_MAX_MODEL_BYTES", str(2**20))  # the limit is the variable's
    with pytest.raises(odeify.ConfigError, match="over the limit of 1.0 MiB"):
        load_model("resnet18")
    monkeypatch.setenv("ODEIFY_MAX_MODEL_BYTES", str(2**31))
    assert load_model("resnet18").num_classes == 1000


BAD_DATA_CONFIG = {
    "std 0": ({"std": [0.0]}, "'std' must be 1 to 64 positive finite numbers"),
    "negative std": ({"std": [-0.2]}, "'std' must be 1 to 64 positive"),
    "NaN mean": ({"mean": [float("nan")]}, "'mean' must be 1 to 64 finite numbers"),
    "mean of the wrong length": ({"mean": [0.4, 0.5]}, "mean has 2 entries for inputs of 1 channel"),
    "input size 0": ({"input_size": [1, 0, 224]}, "'input_size' must be [C, H, W]"),
    "negative input size": ({"input_size": [1, -224, 224]}, "'input_size' must be [C, H, W]"),
    "input size 1e308": ({"input_size": [1, 1e308, 224]}, "'input_size' must be [C, H, W]"),
    "input size 1e5": ({"input_size": [1, 100_000, 100_000]}, "'input_size' must be [C, H, W]"),
    "input size strings": ({"input_size": ["1", "224", "224"]}, "'input_size' must be [C, H, W]"),
    "input size [32, 32]": (
        {"input_size": [32, 32]},
        "'input_size' must be [C, H, W]",
    ),  # was read as 224x224
    "unknown interpolation": ({"interpolation": "magic"}, "'interpolation' must be one of"),
    "NaN crop_pct": ({"crop_pct": float("nan")}, "'crop_pct' must be a number in [0.5, 2.0], not nan"),
    "negative crop_pct": ({"crop_pct": -0.5}, "'crop_pct' must be a number in [0.5, 2.0]"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA_CONFIG))
def test_a_folders_data_config_is_checked_where_it_is_read(tmp_path: Path, case: str) -> None:
    folder = hf_folder(make_test_model("resnet18", num_classes=5, in_chans=1), tmp_path / "r18")
    config = json.loads((folder / "config.json").read_text())
    change, message = BAD_DATA_CONFIG[case]
    config["pretrained_cfg"].update(change)
    (folder / "config.json").write_text(json.dumps(config))  # json writes NaN as timm's save_for_hf would
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="pretrained_cfg") as info:
        load_model(folder)
    assert message in str(info.value) and time.perf_counter() - started < 10
