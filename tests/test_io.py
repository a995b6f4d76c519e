"""Saving and loading converted models: self-contained files, exact round trips, atomic writes, errors."""

from __future__ import annotations

import copy
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.fx as fx
from checkpoint_files import train_checkpoint
from torch import nn

import odeify
from odeify.core.errors import ModelLoadError, OdeifyError
from odeify.core.fileio import atomic_path
from odeify.models._testing import make_test_model
from odeify.models.checkpoints import save_checkpoint
from odeify.models.digits import DEFAULT_MODEL_PATH, DIGITS_ARCH, load_digits
from odeify.models.timm_interface import ConvertedModel
from odeify.serialization.io import RECIPE_KEY, load, save

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits_ode():
    return odeify.convert(str(DEFAULT_MODEL_PATH))


def _perturbed(model: nn.Module) -> nn.Module:
    """Knots that differ from anything a rebuild would produce by itself (as after fine-tuning)."""
    with torch.no_grad():
        for stage in odeify.converted_stages(model):
            for knot in stage.knots.values():
                knot.add_(0.01 * torch.randn_like(knot))
    return model


def test_round_trip_keeps_manifestation_and_weights(tmp_path, digits_ode):
    compressed = _perturbed(odeify.retarget(digits_ode, integrator="rk4", knots=2, basis="linear", steps=3))
    path = tmp_path / "digits_ode.safetensors"
    save(compressed, path)
    loaded = load(path)
    x, _ = load_digits("test")
    assert isinstance(loaded, ConvertedModel) and not loaded.training
    assert torch.equal(loaded(x[:16]), compressed(x[:16]))
    settings = [(s.num_knots, s.basis, s.integrator.name, s.steps) for s in odeify.converted_stages(loaded)]
    assert settings == [(2, "linear", "rk4", 3)] * 2


def test_custom_tableau_survives_round_trip(tmp_path, digits_ode):
    third = odeify.Tableau.create("third", [[0, 0], ["2/3", 0]], ["1/4", "3/4"], order=2)
    model = odeify.retarget(digits_ode, integrator=third, steps=2)
    save(model, tmp_path / "m.safetensors")
    loaded = load(tmp_path / "m.safetensors")
    assert all(s.integrator == third for s in odeify.converted_stages(loaded))
    x, _ = load_digits("test")
    assert torch.equal(loaded(x[:8]), model(x[:8]))


def test_recipe_names_an_architecture_never_a_path(tmp_path, digits_ode):
    save(digits_ode, tmp_path / "m.safetensors")
    recipe = json.loads(_recipe_text(tmp_path / "m.safetensors"))
    assert recipe["arch"] == {
        "name": DIGITS_ARCH,
        "kwargs": {
            "layers": [4, 4],
            "channels": [16, 32],
            "stem_width": 8,
            "stem_type": "deep",
            "in_chans": 1,
            "num_classes": 10,
            "img_size": 32,
            "global_pool": "avg",
        },
    }
    assert "/" not in json.dumps(recipe) and str(DEFAULT_MODEL_PATH.name) not in json.dumps(recipe)
    assert set(recipe["versions"]) == {"odeify", "torch", "timm"} and recipe["version"] == 3


def test_module_source_loads_by_name(tmp_path):
    # the demo converts a module it loaded itself: the file still rebuilds from the arch name alone
    module = odeify.load_model(str(DEFAULT_MODEL_PATH))
    converted = odeify.convert(module)
    save(converted, tmp_path / "m.safetensors")
    x, _ = load_digits("test")
    assert torch.equal(load(tmp_path / "m.safetensors")(x[:8]), converted(x[:8]))


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))


class TinyNet(nn.Module):
    """A custom residual network that odeify cannot rebuild by name."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.blocks = nn.Sequential(_Block(8), _Block(8), _Block(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(x))).mean((2, 3)))


def test_custom_module_warns_at_save_and_loads_with_model(tmp_path):
    torch.manual_seed(0)
    converted = _perturbed(odeify.convert(TinyNet(), input_size=(1, 1, 16, 16)))
    path = tmp_path / "tiny.safetensors"
    with pytest.warns(UserWarning, match=r"model=TinyNet\(\.\.\.\)"):
        save(converted, path)
    with pytest.raises(ModelLoadError, match="model="):
        load(path)
    loaded = load(path, model=TinyNet())  # a fresh instance: its random weights are ignored
    x = torch.randn(2, 1, 16, 16)
    assert torch.equal(loaded(x), converted(x))


def test_head_size_after_reset_classifier_is_saved(tmp_path, digits_ode):
    model = odeify.retarget(digits_ode, steps=2)
    model.reset_classifier(3)
    save(model, tmp_path / "m.safetensors")
    loaded = load(tmp_path / "m.safetensors")
    x, _ = load_digits("test")
    assert loaded.num_classes == 3 and torch.equal(loaded(x[:4]), model(x[:4]))


_FRESH_PROCESS = """
import json, sys, torch, safetensors.torch, odeify
expected = safetensors.torch.load_file(sys.argv[2])
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
model = odeify.load(sys.argv[1])
with torch.no_grad():
    out = model(expected["x"])
import pathlib
code = str(pathlib.Path(odeify.__file__).resolve().parents[1])  # odeify's own sources (editable install)
prefixes = (sys.prefix, sys.base_prefix, code, "/proc", "/sys", "/dev")
print(json.dumps({
    "equal": bool(torch.equal(out, expected["y"])),
    "opened": sorted({p for p in opened if p.startswith("/") and not p.startswith(prefixes)}),
}))
"""


def test_load_in_a_fresh_process_without_the_source_checkpoint(tmp_path):
    source = make_test_model("resnet18", num_classes=10)
    checkpoint = train_checkpoint(source, tmp_path / "train", "resnet18", num_classes=10)
    converted = odeify.convert(checkpoint, ema=True, input_size=(1, 3, 32, 32))  # arch and head from the file
    converted = _perturbed(odeify.retarget(converted, integrator="rk4", knots=2, basis="linear"))
    path = tmp_path / "r18_ode.safetensors"
    save(converted, path)
    for leftover in (tmp_path / "train").iterdir():  # the source checkpoint is gone
        leftover.unlink()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        safetensors.torch.save_file({"x": x, "y": converted(x)}, str(tmp_path / "expected.safetensors"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", _FRESH_PROCESS, str(path), str(tmp_path / "expected.safetensors")]
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["equal"]  # bit-identical outputs
    assert set(report["opened"]) <= {str(path)}  # no other file on the machine was read


def test_newer_and_older_formats_are_refused(tmp_path, digits_ode):
    save(digits_ode, tmp_path / "m.safetensors")
    tensors = safetensors.torch.load_file(str(tmp_path / "m.safetensors"))
    recipe = json.loads(_recipe_text(tmp_path / "m.safetensors"))
    newer = tmp_path / "newer.safetensors"
    safetensors.torch.save_file(
        tensors, str(newer), metadata={RECIPE_KEY: json.dumps({**recipe, "version": 7})}
    )
    with pytest.raises(ModelLoadError, match=r"newer odeify \(format version 7"):
        load(newer)
    older = tmp_path / "older.safetensors"
    legacy = {
        "source": str(DEFAULT_MODEL_PATH),
        "load_kwargs": {},
        "input_shape": [1, 1, 32, 32],
        "stages": [],
    }
    safetensors.torch.save_file(tensors, str(older), metadata={RECIPE_KEY: json.dumps(legacy)})
    with pytest.raises(ModelLoadError, match="older odeify"):
        load(older)


def _recipe_text(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()[RECIPE_KEY]


def test_loading_a_plain_checkpoint_says_to_convert_it(tmp_path):
    model = odeify.load_model(str(DEFAULT_MODEL_PATH))
    path = tmp_path / "plain.safetensors"
    save_checkpoint(model, path, arch=DIGITS_ARCH, arch_kwargs={})
    with pytest.raises(ModelLoadError, match="convert"):
        load(path)


def test_missing_directory_and_fifo_paths_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nope.safetensors")
    with pytest.raises(ModelLoadError, match="is a directory"):
        load(tmp_path)
    os.mkfifo(tmp_path / "pipe.safetensors")
    with pytest.raises(ModelLoadError, match="not a regular file"):
        load(tmp_path / "pipe.safetensors")


# --- saving: bad targets and bad models ----------------------------------------------------------------


def test_save_refuses_bad_paths(tmp_path, digits_ode):
    with pytest.raises(OdeifyError, match="is a folder"):
        save(digits_ode, tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OdeifyError, match="is a file, not a folder"):
        save(digits_ode, tmp_path / "afile" / "m.safetensors")
    with pytest.raises(OdeifyError, match="file path"):
        save(digits_ode, "")


def test_save_refuses_models_that_are_not_converted(tmp_path):
    plain = make_test_model(DIGITS_ARCH)
    with pytest.raises(OdeifyError, match="has no ODE stages"):
        save(plain, tmp_path / "m.safetensors")
    with pytest.raises(OdeifyError, match="has no ODE stages"):
        save(fx.symbolic_trace(plain), tmp_path / "m.safetensors")  # a graph, never converted
    assert not (tmp_path / "m.safetensors").exists()


# --- atomic writes and faults ----------------------------------------------------------------------------


def test_failed_save_leaves_previous_file_intact(tmp_path, digits_ode, monkeypatch):
    path = tmp_path / "m.safetensors"
    save(digits_ode, path)
    before = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("odeify.core.fileio.os.replace", broken)  # fail after the new bytes are written
    with pytest.raises(OdeifyError, match="No space left"):
        save(odeify.retarget(digits_ode, steps=2), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


_KILLED_WRITER = """
import sys, time
from odeify.core.fileio import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    with open(tmp, "wb") as fh:
        fh.write(b"half of a large model")
        fh.flush()
        print(tmp, flush=True)
        time.sleep(60)
"""


def test_save_after_a_killed_save_removes_its_temp_file(tmp_path, digits_ode):
    path = tmp_path / "m.safetensors"
    save(digits_ode, path)
    before = path.read_bytes()
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    temp = Path(writer.stdout.readline().strip())
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=30)
    writer.stdout.close()
    assert temp.exists() and path.read_bytes() == before  # the kill left the old file and a temp
    legacy = tmp_path / ".m.tmp-0123abcd.safetensors"  # an older odeify's name, from before this process
    legacy.write_bytes(b"old")
    os.utime(legacy, (time.time() - 3600, time.time() - 3600))
    with atomic_path(tmp_path / "other.safetensors") as live:  # another target's temp is not touched
        save(odeify.retarget(digits_ode, steps=2), path)
        assert live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "other.safetensors"]


def test_timm_model_changed_after_building_is_not_claimed_rebuildable(tmp_path):
    model = make_test_model(DIGITS_ARCH)
    model.layer2 = model.layer2[:3]  # one block fewer than the arch name and kwargs build
    converted = odeify.convert(model)
    with pytest.warns(UserWarning, match="changed after it"):
        save(converted, tmp_path / "m.safetensors")
    x, _ = load_digits("test")
    assert torch.equal(load(tmp_path / "m.safetensors", model=model)(x[:4]), converted(x[:4]))


def test_save_refuses_a_model_whose_output_overflows(tmp_path, digits_ode):
    """Head weights of 3e38: float32 logits of inf, so no probe could check the file (load refuses
    such a file; save said json's 'Out of range float values' before)."""
    model = odeify.retarget(digits_ode, steps=1)
    with torch.no_grad():
        model.fc.weight.fill_(3e38)
    target = tmp_path / "m.safetensors"
    with pytest.raises(OdeifyError, match="round-off at probe point 'output' is not finite") as info:
        save(model, target)
    assert str(info.value).startswith(f"odeify.save refuses to write {target}: ") and not target.exists()


def test_save_writes_the_model_s_own_tensors_copying_only_what_a_file_cannot_take(
    tmp_path, digits_ode, monkeypatch
):
    """A copy of every tensor for the file was 1.6 GiB of save's peak on a 412M-parameter model, and
    safetensors' in-memory file twice that: the file is written from the model's own tensors. One the
    file cannot take as it is (a channels-last convolution weight: not contiguous) is copied."""
    written: dict[str, torch.Tensor] = {}
    write = safetensors.torch.save_file

    def spy(tensors, *args, **kwargs):
        written.update(tensors)
        return write(tensors, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", spy)
    save(digits_ode, tmp_path / "m.safetensors")
    state = digits_ode.state_dict()
    assert all(written[key].data_ptr() == tensor.data_ptr() for key, tensor in state.items())
    last = copy.deepcopy(digits_ode).to(memory_format=torch.channels_last)
    strided = [key for key, tensor in last.state_dict().items() if not tensor.is_contiguous()]
    assert strided
    save(last, tmp_path / "last.safetensors")
    assert all(written[key].is_contiguous() for key in strided)
    again = safetensors.torch.load_file(tmp_path / "last.safetensors")
    assert all(torch.equal(again[key], tensor) for key, tensor in state.items())


def test_a_save_past_the_file_size_limit_names_the_file(tmp_path, digits_ode):
    """safetensors reports an I/O error in its own words: save names the file and the OS's reason,
    and leaves no temporary file."""
    path = tmp_path / "m.safetensors"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(OdeifyError, match=f"cannot write {re.escape(str(path))}: File too large"):
            save(digits_ode, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert list(tmp_path.iterdir()) == []
