"""API calls that were accepted and did something else than asked (issue 39): each is refused, naming
the problem and the fix."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import odeify
from odeify.core.errors import ConfigError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models.digits import DIGITS_SIZE
from odeify.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def source() -> torch.nn.Module:
    return load_model(DEFAULT_MODEL_PATH)


def test_a_forward_hook_on_the_source_is_refused(source: torch.nn.Module) -> None:
    x = torch.randn(2, 1, DIGITS_SIZE, DIGITS_SIZE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = source(x)
    for module, register in ((source, "register_forward_pre_hook"), (source.layer1, "register_forward_hook")):
        hook = getattr(module, register)(lambda m, *args: (args[0][0] * 2,) if len(args) == 1 else None)
        try:
            with torch.no_grad():
                changed = not torch.equal(source(x), plain)
            assert changed == (module is source)  # the pre-hook changes the output; the other returns None
            with pytest.raises(ConfigError, match="forward hook or pre-hook, which the converted model"):
                odeify.convert(source)
        finally:
            hook.remove()
    odeify.convert(source)  # without hooks


def test_meta_tensors_are_refused_at_convert_and_save(source: torch.nn.Module, tmp_path: Path) -> None:
    converted = odeify.convert(source)
    with pytest.raises(ConfigError, match=r"odeify\.convert: the model's tensors are on the meta device"):
        odeify.convert(copy.deepcopy(source).to("meta"))
    target = tmp_path / "m.safetensors"
    with pytest.raises(ConfigError, match=r"odeify\.save: the model's tensors are on the meta device"):
        odeify.save(converted.to("meta"), target)
    assert not target.exists()


def test_set_backward_without_a_mode_is_refused(source: torch.nn.Module) -> None:
    converted = odeify.convert(source)
    with pytest.raises(ConfigError, match="set_backward takes a backward mode .* not None"):
        odeify.set_backward(converted, None)
    assert odeify.set_backward(converted, "checkpoint") is converted


def test_a_legal_long_file_name_is_written(tmp_path: Path) -> None:
    import os

    from odeify.core.fileio import atomic_write_bytes

    name = "m" * (255 - len(".safetensors")) + ".safetensors"  # the longest legal name
    target = tmp_path / name
    atomic_write_bytes(target, b"data")  # its temporary's name was 30 bytes past the limit
    assert target.read_bytes() == b"data" and [p.name for p in tmp_path.iterdir()] == [name]
    # a temporary left by a killed writer, its pid of 10 digits: the file system takes the name (so it
    # fits), and the next write recognises and removes it
    stale = tmp_path / f".{'m' * 209}.tmp-{'0' * 8}-{'9' * 10}-{'a' * 8}.safetensors"
    stale.touch()
    os.utime(stale, (0, 0))
    atomic_write_bytes(target, b"again")
    assert [p.name for p in tmp_path.iterdir()] == [name]
    with pytest.raises(OSError, match="too long"):
        atomic_write_bytes(tmp_path / ("m" + name), b"data")  # an illegal name is still refused


def test_resume_while_the_run_is_alive_names_its_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    from odeify.cli.parser import main
    from odeify.core.lock import LOCK_FILE, folder_lock

    run = tmp_path / "run"
    with folder_lock(run):  # a live first run, still in its first epoch: no state written yet
        assert main(["finetune", "--data", "digits", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"pid {os.getpid()}" in err and str(run / LOCK_FILE) in err and "not found" not in err
    assert main(["finetune", "--data", "digits", "--out", str(run), "--resume"]) == 2  # the lock is free
    assert "not found" in capsys.readouterr().err


def test_a_probe_of_another_dtype_is_named_by_its_dtype(source: torch.nn.Module, tmp_path: Path) -> None:
    import safetensors
    import safetensors.torch

    from odeify.core.errors import ModelLoadError
    from odeify.serialization.probe import PROBE_PREFIX

    path = tmp_path / "m.safetensors"
    odeify.save(odeify.convert(source), path)
    with safetensors.safe_open(str(path), "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    name = next(k for k in tensors if k.startswith(PROBE_PREFIX))
    tensors[name] = tensors[name].half()  # same shape, another dtype
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ModelLoadError) as refused:
        odeify.load(path)
    shape = tuple(tensors[name].shape)  # the same on both sides: only the dtypes tell them apart
    assert f"saved ({shape}, torch.float16), rebuilt ({shape}, torch.float32)" in str(refused.value)
