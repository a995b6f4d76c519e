"""odeify.models.loading and odeify.models.checkpoints (names/files -> modules), odeify.core.fileio."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from odeify.core.errors import ModelLoadError, OdeifyError
from odeify.core.fileio import atomic_path, atomic_write_bytes
from odeify.models._testing import make_test_model
from odeify.models.checkpoints import read_checkpoint_metadata, save_checkpoint
from odeify.models.digits import DEFAULT_MODEL_PATH, DIGITS_ARCH, digits_split, load_digits
from odeify.models.loading import load_model
from odeify.models.timm_interface import default_input_size


def _digits_test_model(seed: int = 0, **kwargs: object) -> nn.Module:
    """The digits arch with random non-trivial weights: small and fast."""
    return make_test_model(DIGITS_ARCH, seed=seed, **kwargs)


def _x(model: nn.Module, batch: int = 2) -> torch.Tensor:
    """A fixed random input of the model's default size."""
    _, c, h, w = default_input_size(model)
    return torch.randn(batch, c, h, w, generator=torch.Generator().manual_seed(1))


# --- names -----------------------------------------------------------------------------------------


def test_unknown_name_suggests_close_names() -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model("resnet5")
    msg = str(info.value)
    assert "resnet50" in msg and "Did you mean" in msg
    assert "checkpoint" in msg  # hint that a file path works too


def test_timm_name_builds_eval_model_with_kwargs() -> None:
    model = load_model("resnet10t", num_classes=7, in_chans=1)
    assert not model.training
    assert default_input_size(model) == (1, 1, 176, 176)  # timm cfg size; channels from in_chans
    assert model(torch.randn(1, 1, 64, 64)).shape == (1, 7)


def test_bad_kwargs_and_bad_tag_are_model_load_errors() -> None:
    with pytest.raises(ModelLoadError, match="no_such_kwarg"):
        load_model("resnet10t", no_such_kwarg=1)
    with pytest.raises(ModelLoadError, match="tag"):
        load_model("resnet50.not_a_tag")


def test_module_source_is_returned_in_eval_mode() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout()).train()
    assert load_model(model) is model and not model.training


def test_pretrained_conflicts_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="DEFAULT_MODEL_PATH"):
        load_model(DIGITS_ARCH, pretrained=True)
    with pytest.raises(ModelLoadError, match="not both"):
        load_model("resnet10t", pretrained=True, checkpoint=tmp_path / "w.safetensors")
    with pytest.raises(ModelLoadError, match="Drop pretrained"):
        load_model(str(DEFAULT_MODEL_PATH), pretrained=True)


# --- checkpoint files --------------------------------------------------------------------------------


def test_missing_file_error_names_path(tmp_path: Path) -> None:
    for missing in (tmp_path / "nope.safetensors", str(tmp_path / "nope.pth"), "nope.pth"):
        with pytest.raises(ModelLoadError, match="not found") as info:
            load_model(missing)
        assert "nope" in str(info.value)
    with pytest.raises(ModelLoadError, match="not found"):
        load_model("resnet10t", checkpoint=tmp_path / "nope.safetensors")


def test_safetensors_round_trip(tmp_path: Path) -> None:
    model = make_test_model("resnet10t", num_classes=10)
    path = tmp_path / "r10.safetensors"
    save_checkpoint(model, path, "resnet10t", {"num_classes": 10}, metadata={"note": "hi"})
    meta = read_checkpoint_metadata(path)
    assert meta["odeify_arch"] == "resnet10t" and json.loads(meta["odeify_kwargs"]) == {"num_classes": 10}
    assert meta["note"] == "hi"
    loaded = load_model(path)
    assert not loaded.training
    x = _x(model)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    # checkpoint= on a timm name reads the same file
    again = load_model("resnet10t", checkpoint=path, num_classes=10)
    pairs = zip(again.state_dict().values(), model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    # and checkpoint= on a module overwrites its weights
    fresh = load_model("resnet10t", num_classes=10)
    load_model(fresh, checkpoint=path)
    assert torch.equal(fresh.conv1[0].weight, model.conv1[0].weight)


def test_float64_checkpoint_stays_float64(tmp_path: Path) -> None:
    model = _digits_test_model(dtype=torch.float64)
    path = tmp_path / "d64.safetensors"
    save_checkpoint(model, path, DIGITS_ARCH, {})
    loaded = load_model(path)
    assert next(loaded.parameters()).dtype == torch.float64
    x = _x(model).double()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_pth_requires_arch_and_accepts_wrappers(tmp_path: Path) -> None:
    model = _digits_test_model()
    raw, wrapped = tmp_path / "raw.pth", tmp_path / "wrapped.pt"
    torch.save(model.state_dict(), raw)
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, wrapped)
    with pytest.raises(ModelLoadError, match="arch="):
        load_model(raw)
    x = _x(model)
    for path in (raw, wrapped):
        loaded = load_model(path, arch=DIGITS_ARCH)
        with torch.no_grad():
            assert torch.equal(loaded(x), model(x))
    bare = tmp_path / "plain.safetensors"  # a safetensors file without odeify metadata needs arch= too
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, bare)
    with pytest.raises(ModelLoadError, match="arch="):
        load_model(bare)
    assert isinstance(load_model(bare, arch=DIGITS_ARCH), nn.Module)


def test_mismatched_state_dict_lists_keys_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "d.pth"
    torch.save(_digits_test_model().state_dict(), path)
    with pytest.raises(ModelLoadError) as info:
        load_model(path, arch=DIGITS_ARCH, layers=[2, 4])  # the file has 4 blocks in stage 1
    msg = str(info.value)
    assert "unexpected keys" in msg and "layer1.2." in msg and "Fix" in msg
    with pytest.raises(ModelLoadError) as info:
        load_model(path, arch=DIGITS_ARCH, num_classes=5)
    assert "shape mismatch" in str(info.value) and "fc.weight" in str(info.value)
    # the head and stem sizes are read from the file, and the user is told so
    with pytest.raises(ModelLoadError) as info, pytest.warns(UserWarning, match="num_classes=10"):
        load_model(path, arch="resnet10t")
    assert "missing keys" in str(info.value) and "unexpected keys" in str(info.value)


def test_corrupt_safetensors_is_model_load_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(path)


# --- atomic writes -----------------------------------------------------------------------------------


def test_atomic_write_replaces_and_keeps_mode(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    atomic_write_bytes(path, b"old")
    os.chmod(path, 0o640)
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_atomic_path_failure_leaves_old_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old contents")
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".safetensors" and tmp != path
        tmp.write_bytes(b"half a new fi")
        raise RuntimeError("disk full")
    assert path.read_bytes() == b"old contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_failed_save_checkpoint_keeps_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _digits_test_model()
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(model, path, DIGITS_ARCH, {})
    before = path.read_bytes()

    import odeify.core.fileio

    real_open = open

    def crashing_open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        handle = real_open(file, mode, *args, **kwargs)  # type: ignore[call-overload]
        if "w" in mode:
            handle.write(b"partial")
            handle.close()
            raise OSError("simulated crash midway")
        return handle

    monkeypatch.setattr(odeify.core.fileio, "open", crashing_open, raising=False)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(_digits_test_model(seed=1), path, DIGITS_ARCH, {})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]
    with pytest.raises(OdeifyError, match="JSON"):
        save_checkpoint(model, path, DIGITS_ARCH, {"bad": object()})


# --- make_test_model -----------------------------------------------------------------------------------


def test_make_test_model_resnet18_has_nontrivial_blocks() -> None:
    rng_before = torch.random.get_rng_state()
    model = make_test_model("resnet18")
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # global RNG untouched
    assert not model.training
    block = model.layer1[1]
    assert block.bn2.weight.abs().min() >= 0.5  # timm would zero-init it
    for bn in (block.bn1, block.bn2, model.bn1):
        assert bn.running_mean.abs().max() > 0
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
        assert bn.running_var.min() >= 0.5 and bn.running_var.max() <= 1.5
        assert bn.bias.abs().max() > 0
    x = torch.relu(torch.randn(1, 64, 16, 16, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        out = block(x)
    assert (out - x).abs().max() > 0.1  # the residual branch changes its input
    # deterministic in seed; different seeds differ; dtype honoured
    same = make_test_model("resnet18")
    other = make_test_model("resnet18", seed=1, dtype=torch.float64)
    assert torch.equal(same.layer1[1].bn2.weight, block.bn2.weight)
    assert other.layer1[1].bn2.weight.dtype == torch.float64
    assert not torch.equal(other.layer1[1].bn2.weight.float(), block.bn2.weight)


def test_make_test_model_without_zero_init_last_kwarg() -> None:
    # NF-ResNet takes no zero_init_last and zero-inits its last conv gains: they get re-randomised.
    model = make_test_model("nf_resnet26")
    gains = [p for n, p in model.named_parameters() if n.endswith("conv3.gain")]
    assert gains and all(g.min() >= 0.5 for g in gains)


# --- the shipped digits model ----------------------------------------------------------------------------


def test_shipped_digits_model_accuracy() -> None:
    model = load_model(DEFAULT_MODEL_PATH)
    assert not model.training
    x, y = load_digits("test")
    assert default_input_size(model) == (1, *x.shape[1:]) == (1, 1, 32, 32)
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    assert acc >= 0.95
    meta = json.loads(read_checkpoint_metadata(DEFAULT_MODEL_PATH)["odeify_digits"])
    assert meta["test_indices"] == digits_split()[1].tolist()  # same held-out split as load_digits
    assert DEFAULT_MODEL_PATH.stat().st_size < 2 * 2**20


def test_load_digits_splits() -> None:
    x_train, y_train = load_digits("train", size=16)
    x_test, y_test = load_digits("test", size=8)
    assert x_train.shape[1:] == (1, 16, 16) and x_test.shape[1:] == (1, 8, 8)
    assert len(y_train) + len(y_test) == 1797 and len(y_test) == 359
    assert set(digits_split()[0]).isdisjoint(digits_split()[1])
    with pytest.raises(OdeifyError, match="split"):
        load_digits("val")
