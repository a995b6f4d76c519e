"""Resuming fine-tuning after faults (issue 18, parts 2, 6, 7, 8): a kill inside an epoch's write
sequence is finished, a damaged state is one clear error, a changed model, teacher or data is
refused naming what changed, and two runs never share a folder.

The oracles: an uninterrupted run with the same seed (bit-identical files), and the damage itself
(each refusal must name the field that was damaged).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch.utils.data import TensorDataset

import odeify
from odeify.core.errors import ConfigError
from odeify.core.fileio import _HOST
from odeify.core.lock import LOCK_FILE, folder_lock
from odeify.train.datasets import open_data
from odeify.train.finetune import (
    BEST_FILE,
    DEFAULT_RECIPE,
    HISTORY_FILE,
    LAST_FILE,
    STATE_FILE,
    STATE_KEY,
    finetune,
)
from odeify.train.state import read_record, read_state

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = replace(
    DEFAULT_RECIPE, epochs=2, batch_size=16, lr=1e-3
)  # 1e-3: the last epoch improves (part 2 needs it)
COMMON = {"max_batches": 3, "progress": False, "calibrate_first": False}


def coarse(native: torch.nn.Module) -> torch.nn.Module:
    return odeify.retarget(native, steps=1, backward="checkpoint")


@pytest.fixture(scope="module")
def finished(native, digits, tmp_path_factory) -> tuple[Path, list]:
    """An uninterrupted 2-epoch run: its folder and history."""
    folder = tmp_path_factory.mktemp("whole")
    return folder, finetune(coarse(native), digits, QUICK, out=folder, **COMMON).history


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path))


def _same_files(a: Path, b: Path) -> None:
    for name in (LAST_FILE, BEST_FILE, STATE_FILE):
        one, two = _tensors(a / name), _tensors(b / name)
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one), name
    untimed = [
        [{**r, "seconds": None, "peak_memory_mib": None} for r in json.loads((f / HISTORY_FILE).read_text())]
        for f in (a, b)
    ]
    assert untimed[0] == untimed[1]


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


# -- part 2: a kill after the state and before the epoch's other files --------------------------------
class Killed(BaseException):
    """Stands for SIGKILL inside one process: nothing after it runs, no handler sees it."""


def test_a_kill_in_the_final_epochs_write_sequence_is_finished_by_resume(
    native, digits, finished, tmp_path: Path, monkeypatch, caplog
) -> None:
    whole, history = finished
    assert history[-1].val_accuracy > max(r.val_accuracy for r in history[:-1])  # the last epoch is best
    import odeify.train.trainer as trainer

    def killed_after_the_state(folder, model, records):
        if records[-1].epoch == QUICK.epochs:  # the final epoch: its state is written, nothing else
            leftover = folder / f".history.tmp-{_HOST}-{_dead_pid()}-0123abcd.json"
            leftover.write_text("[{")  # a history write killed half way
            raise Killed
        real(folder, model, records)

    real = trainer.write_epoch_outputs
    monkeypatch.setattr(trainer, "write_epoch_outputs", killed_after_the_state)
    with pytest.raises(Killed):
        finetune(coarse(native), digits, QUICK, out=tmp_path, **COMMON)
    monkeypatch.setattr(trainer, "write_epoch_outputs", real)
    assert read_record(tmp_path / STATE_FILE)["epoch"] == QUICK.epochs
    assert len(json.loads((tmp_path / HISTORY_FILE).read_text())) == QUICK.epochs  # epoch 2 missing
    assert not torch.equal(*(_tensors(f / BEST_FILE)["fc.weight"] for f in (tmp_path, whole)))  # stale best

    with caplog.at_level(logging.INFO, logger="odeify"):
        resumed = finetune(coarse(native), digits, QUICK, out=tmp_path, resume=True, **COMMON)
    assert [r.epoch for r in resumed.history] == [0, 1, 2]
    _same_files(tmp_path, whole)  # best, last, history and state as if never killed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [BEST_FILE, LAST_FILE, STATE_FILE, HISTORY_FILE, "summary.csv"]
    )
    assert "after epoch 2 (optimizer step 6); removed 1 temporary file" in caplog.text


_KILLED_IN_HISTORY = """
import os, signal, sys
from dataclasses import replace
import odeify, odeify.train.trainer as trainer
from odeify.core.fileio import atomic_path
from odeify.models import DEFAULT_MODEL_PATH
from odeify.train.datasets import open_data
from odeify.train.finetune import DEFAULT_RECIPE, finetune
real = trainer.write_epoch_outputs
def outputs(folder, model, history):
    if history[-1].epoch == 2:
        with atomic_path(folder / "history.json") as tmp:
            tmp.write_text("[{")
            os.kill(os.getpid(), signal.SIGKILL)
    real(folder, model, history)
trainer.write_epoch_outputs = outputs
native = odeify.convert(str(DEFAULT_MODEL_PATH))
model = odeify.retarget(native, steps=1, backward="checkpoint")
finetune(model, open_data("digits", native), replace(DEFAULT_RECIPE, epochs=2, batch_size=16, lr=1e-3),
         out=sys.argv[1], max_batches=3, progress=False, calibrate_first=False)
"""


@pytest.mark.slow
def test_sigkill_inside_the_final_history_write_then_resume(native, digits, finished, tmp_path: Path) -> None:
    whole, _ = finished
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", _KILLED_IN_HISTORY, str(tmp_path)], env=env, timeout=600)
    assert done.returncode == -signal.SIGKILL
    assert any(p.name.startswith(".history.tmp-") for p in tmp_path.iterdir())  # what the kill left
    torch.set_num_threads(1)
    finetune(coarse(native), digits, QUICK, out=tmp_path, resume=True, **COMMON)
    _same_files(tmp_path, whole)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


# -- parts 6 and 7: a damaged training state is one clear error ---------------------------------------
def _record(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        return json.loads(handle.metadata()[STATE_KEY])


def _rewrite(path: Path, edit: Callable[[dict], object] | None = None, text: str | None = None,
             tensors: Callable[[dict], dict] | None = None) -> None:  # fmt: skip
    record = _record(path)
    if edit is not None:
        edit(record)
    state = _tensors(path)
    if tensors is not None:
        state = tensors(state)
    path.write_bytes(safetensors.torch.save(state, metadata={STATE_KEY: text or json.dumps(record)}))


def _set(*keys: str, value: object) -> Callable[[dict], None]:
    def edit(record: dict) -> None:
        for key in keys[:-1]:
            record = record[key]
        record[keys[-1]] = value

    return edit


def _pop(*keys: str) -> Callable[[dict], None]:
    def edit(record: dict) -> None:
        for key in keys[:-1]:
            record = record[key]
        record.pop(keys[-1])

    return edit


DAMAGE = {
    "no run": ({"edit": _pop("run")}, "it has no 'run'"),
    "no optimizer_scalars": ({"edit": _pop("optimizer_scalars")}, "it has no 'optimizer_scalars'"),
    "no param_groups": ({"edit": _pop("param_groups")}, "it has no 'param_groups'"),
    "empty param_groups": ({"edit": _set("param_groups", value=[])}, "param_groups must be a non-empty list"),
    "history entry not a record": ({"edit": _set("history", value=[0, 1, 2])}, "history entry 0 must be"),
    "history accuracy a string": (
        {"edit": lambda r: r["history"][1].update(val_accuracy="high")},
        "history entry 1: val_accuracy must be a number in [0, 1]",
    ),
    "history one epoch short": (
        {"edit": lambda r: r["history"].pop()},
        "history must list the epochs 0 to 2",
    ),
    "cli not an object": (
        {"edit": _set("run", "cli", value="odeify finetune")},
        "cli settings must be an object",
    ),
    "cli steps a float": (
        {"edit": _set("run", "cli", value={"steps": 2.5})},
        "its cli setting steps is 2.5, which the command line never records",
    ),
    "cli scale not a list": (
        {"edit": _set("run", "cli", value={"scale": 0.5})},
        "its cli setting scale is 0.5, which the command line never records",
    ),
    "batch_size a string": (
        {"edit": _set("run", "recipe", "batch_size", value="16")},
        "batch_size must be int",
    ),
    "lr a string": ({"edit": _set("run", "recipe", "lr", value="1e-3")}, "lr must be float"),
    "seed a string": ({"edit": _set("run", "seed", value="0")}, "its seed must be a non-negative integer"),
    "refine_at a string": ({"edit": _set("run", "refine_at", value="2")}, "its refine_at must be a list"),
    "negative step": ({"edit": _set("step", value=-1)}, "its step must be a non-negative integer"),
    "epoch past the recipe": ({"edit": _set("epoch", value=7)}, "its history must list the epochs 0 to 7"),
    "newer version": ({"edit": _set("version", value=2)}, "written by a newer odeify"),
    "version a string": ({"edit": _set("version", value="1")}, "its version must be an integer"),
    "duplicate key": ({"text": '{"version": 1, "version": 1}'}, "'version' appears twice"),
    "record a list": ({"text": "[1, 2]"}, "the record must be a JSON object"),
    "record not JSON": ({"text": "{'epoch': 1"}, "not valid JSON"),
    "odd tensor name": ({"tensors": lambda t: {**t, "evil": torch.zeros(1)}}, "a tensor named 'evil'"),
    "optimizer tensor of no parameter": (
        {"tensors": lambda t: {**t, "optim.9999.exp_avg": torch.zeros(1)}},
        "optim.9999.exp_avg is for parameter 9999",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_state_is_one_clear_error_naming_the_field(finished, tmp_path: Path, case: str) -> None:
    whole, _ = finished
    path = tmp_path / STATE_FILE
    shutil.copy(whole / STATE_FILE, path)
    damage, message = DAMAGE[case]
    _rewrite(path, **damage)
    with pytest.raises(ConfigError, match="cannot resume") as info:
        read_state(path)
    assert message in str(info.value), str(info.value)


def _resume_with(native, digits, folder: Path, **changes) -> None:
    model = changes.pop("model", None) or coarse(native)
    finetune(model, changes.pop("data", digits), QUICK, out=folder, resume=True, **COMMON, **changes)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("model tensor of another shape", "its model tensor fc.weight is torch.float32 (3, 32)"),
        ("optimizer tensor of another shape", "has shape (5,), the parameter"),
    ],
)
def test_tensors_of_another_shape_are_named(native, digits, finished, tmp_path, case, message) -> None:
    shutil.copytree(finished[0], tmp_path / "run")
    path = tmp_path / "run" / STATE_FILE
    if case.startswith("model"):
        _rewrite(path, tensors=lambda t: {**t, "model.fc.weight": torch.zeros(3, 32)})
    else:
        key = next(k for k in _tensors(path) if k.endswith(".exp_avg"))
        _rewrite(path, tensors=lambda t: {**t, key: torch.zeros(5)})
    with pytest.raises(ConfigError, match="does not fit this run") as info:
        _resume_with(native, digits, tmp_path / "run")
    assert message in str(info.value), str(info.value)


# -- part 7: the run must continue from the same model, teacher and data --------------------------
def _changed_weights(native):
    model = coarse(native)
    with torch.no_grad():
        model.fc.bias.add_(0.01)
    return {"model": model}


def _swapped_labels(native, digits):
    x, y = digits.train.tensors
    return {"data": replace(digits, train=TensorDataset(x, y.roll(1)))}


def _three_classes(digits):
    def keep(split: TensorDataset) -> TensorDataset:
        x, y = split.tensors
        return TensorDataset(x[y < 3], y[y < 3])

    return {"data": replace(digits, train=keep(digits.train), val=keep(digits.val), num_classes=3)}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("rk4 model", "stage 'layer1' was 'euler, 1 step, 4 constant knots, backward checkpoint', now 'rk4"),
        ("2-knot model", "now 'euler, 1 step, 2 constant knots"),
        # the kept source (the teacher) is the changed model's start: it changed too
        (
            "other weights",
            "the model's weights differ from the ones the run began with (fc.bias, fc.source_bias)",
        ),
        ("other teacher", "the teacher differs from the one the run distilled from"),
        (
            "same data, labels swapped",
            "the data's train split changed (recorded 1438 samples, now 1438; the same",
        ),
        ("three classes", "the data's classes changed (recorded 10, now 3)"),
    ],
)
def test_resume_refuses_another_model_teacher_or_data(
    native, digits, finished, tmp_path, case, message
) -> None:
    shutil.copytree(finished[0], tmp_path / "run")
    changes = {
        "rk4 model": lambda: {"model": odeify.retarget(coarse(native), integrator="rk4")},
        "2-knot model": lambda: {"model": odeify.retarget(coarse(native), knots=2)},
        "other weights": lambda: _changed_weights(native),
        "other teacher": lambda: {"teacher": odeify.retarget(native, steps=2)},
        "same data, labels swapped": lambda: _swapped_labels(native, digits),
        "three classes": lambda: _three_classes(digits),
    }[case]()
    with pytest.raises(ConfigError, match="would not continue the recorded one") as info:
        _resume_with(native, digits, tmp_path / "run", **changes)
    assert message in str(info.value), str(info.value)


def test_an_image_folder_with_swapped_contents_is_refused(native, tmp_path: Path) -> None:
    from PIL import Image

    root = tmp_path / "data"
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 16), ("val", 4)):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                pixels = (torch.rand(32, 32, generator=generator) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels, mode="L").save(root / split / label / f"{i}.png")
    recipe = replace(QUICK, epochs=1)
    finetune(coarse(native), open_data(root, native), recipe, out=tmp_path / "run", **COMMON)
    os.replace(root / "train" / "a" / "0.png", root / "train" / "b" / "moved.png")  # same path, same size
    with pytest.raises(ConfigError, match="the data's train split changed"):
        finetune(coarse(native), open_data(root, native), recipe, out=tmp_path / "run", resume=True, **COMMON)


# -- part 8: a training state that is not a file says what it is -----------------------------------
def test_a_state_that_is_not_a_file_says_what_it_is(tmp_path: Path) -> None:
    (tmp_path / "dir" / STATE_FILE).mkdir(parents=True)
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / STATE_FILE)
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / STATE_FILE).symlink_to("/dev/zero")
    for folder, what in (("dir", "is a directory"), ("fifo", "is a named pipe (FIFO)"),
                         ("link", "is a character device (a link to /dev/zero)")):  # fmt: skip
        with pytest.raises(ConfigError, match="cannot resume") as info:
            read_record(tmp_path / folder / STATE_FILE)
        assert what in str(info.value) and "does not exist" not in str(info.value)


# -- part 7: one run per folder ----------------------------------------------------------------------
def test_a_second_run_into_a_locked_folder_is_refused_naming_the_first(native, digits, tmp_path) -> None:
    with (
        folder_lock(tmp_path),
        pytest.raises(ConfigError, match=rf"another fine-tuning run \(pid {os.getpid()} "),
    ):
        finetune(coarse(native), digits, replace(QUICK, epochs=1), out=tmp_path, **COMMON)
    assert not (tmp_path / BEST_FILE).exists()  # refused before writing anything


def test_the_lock_of_a_killed_run_is_taken_over(native, digits, tmp_path: Path, caplog) -> None:
    dead = _dead_pid()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "there", "pid": dead}))
    with caplog.at_level(logging.INFO, logger="odeify"):
        finetune(coarse(native), digits, replace(QUICK, epochs=1), out=tmp_path, **COMMON)
    assert f"locked by pid {dead} on there, which no longer holds the lock" in caplog.text
    assert not (tmp_path / LOCK_FILE).exists() and (tmp_path / LAST_FILE).exists()


def test_a_run_into_a_folder_that_holds_one_needs_resume(native, digits, finished) -> None:
    with pytest.raises(ConfigError, match="already holds a fine-tuning run"):
        finetune(coarse(native), digits, QUICK, out=finished[0], **COMMON)


def test_an_old_state_without_fingerprints_resumes(native, digits, finished, tmp_path: Path) -> None:
    """Written before fingerprints were recorded: resumed unchecked by them, as the same run."""
    shutil.copytree(finished[0], tmp_path / "run")
    _rewrite(tmp_path / "run" / STATE_FILE, edit=_pop("started_from"))
    history = finetune(coarse(native), digits, QUICK, out=tmp_path / "run", resume=True, **COMMON).history
    assert [asdict(r) for r in history] == [asdict(r) for r in finished[1]]
