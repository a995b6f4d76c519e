"""The fine-tuning loop (odeify.train.finetune): checkpoints, exact resume, divergence, refinement, DDP.

Runs on the shipped digits model, a few small batches per epoch. The oracles: a run resumed
after a crash (in-process, and after SIGKILL in a subprocess) against an uninterrupted run with
the same seed (bit-identical knots), accuracies recomputed by an independent argmax loop,
refined knots against the basis' own resampling, and two torchrun processes against one process
on their combined batch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import safetensors.torch
import torch
from crash_after import CrashAfter
from safetensors import safe_open
from torch.utils.data import TensorDataset

import odeify
from odeify.core.lock import LOCK_FILE
from odeify.models import DEFAULT_MODEL_PATH
from odeify.train.datasets import LabelledData
from odeify.train.finetune import (
    BEST_FILE,
    DEFAULT_RECIPE,
    EMA_WARMUP_POWER,
    LAST_FILE,
    STATE_FILE,
    STATE_KEY,
    TrainingDiverged,
    finetune,
    learning_rate_factor,
    refine,
)
from odeify.train.parametrization import SourceCoordinates, param_groups
from odeify.train.recipe import ALF_LR, DEFAULT_LR

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = replace(DEFAULT_RECIPE, epochs=2, batch_size=16)
BATCHES = 3
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def coarse(native: torch.nn.Module) -> torch.nn.Module:
    """Euler, one step per stage, exact memory-saving backward: 90.5% before fine-tuning."""
    return odeify.retarget(native, steps=1, backward="checkpoint")


class _Calls(logging.Handler):
    """Calls ``fn`` with every message the ``odeify`` logger emits."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def emit(self, record: logging.LogRecord) -> None:
        self.fn(record.getMessage())


@contextmanager
def on_log(fn) -> Iterator[None]:
    """Within the block, ``fn(message)`` for every line the fine-tuning run logs."""
    logger = logging.getLogger("odeify")
    handler, level = _Calls(fn), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def accuracy(model: torch.nn.Module, dataset: TensorDataset) -> float:
    """Independent of odeify.train.evaluate: one batch, argmax, compare."""
    x, y = dataset.tensors
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).double().mean().item()


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """A file's tensors, without a saved model's probe values (what it computed when saved)."""
    return {k: v for k, v in safetensors.torch.load_file(str(path)).items() if not k.startswith("@probe/")}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- recipe and schedule ---------------------------------------------------------------------------
def test_learning_rate_warms_up_linearly_then_follows_a_cosine_to_zero() -> None:
    total, warmup = 100, 0.1  # 10 warm-up steps
    assert learning_rate_factor(0, total, warmup) == pytest.approx(1 / 11)
    assert learning_rate_factor(9, total, warmup) == pytest.approx(10 / 11)
    assert learning_rate_factor(10, total, warmup) == pytest.approx(1.0)
    assert learning_rate_factor(55, total, warmup) == pytest.approx(0.5)  # halfway through the cosine
    assert learning_rate_factor(99, total, warmup) == pytest.approx((1 + math.cos(math.pi * 89 / 90)) / 2)
    assert learning_rate_factor(0, total, 0.0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "change",
    [
        {"epochs": 0},
        {"lr": 0.0},
        {"lr": math.nan},
        {"warmup": 1.0},
        {"weight_decay": -1.0},
        {"distill": 2.0},
        {"ema_decay": 1.0},
        {"ema_decay": -0.1},
        {"ema_decay": math.nan},
    ],
)
def test_recipe_refuses_bad_settings(change: dict) -> None:
    with pytest.raises(odeify.ConfigError, match=next(iter(change))):
        replace(DEFAULT_RECIPE, **change)


def test_distills_from_the_source_network_by_default(native: torch.nn.Module, digits: LabelledData) -> None:
    lines: list[str] = []
    with on_log(lines.append):
        finetune(coarse(native), digits, replace(QUICK, epochs=1), max_batches=1, progress=False)
    source = odeify.load_model(DEFAULT_MODEL_PATH)
    teacher = next(line for line in lines if line.startswith("distilling"))
    assert f"val accuracy {accuracy(source, digits.val):.2%}" in teacher  # native depth = the source


def test_other_classes_reset_the_classifier_and_train_on_labels(
    native: torch.nn.Module, digits: LabelledData
) -> None:
    """Python users get what the command line does: a new head for the data's classes, no teacher."""
    three = _three_classes(digits)
    lines: list[str] = []
    model = coarse(native)
    with on_log(lines.append):
        result = finetune(model, three, replace(QUICK, epochs=1), max_batches=1, progress=False)
    assert result.model.num_classes == 3 and result.model(three.val.tensors[0][:2]).shape == (2, 3)
    assert any("classifier was" in line and "without distillation" in line for line in lines)
    assert not any(line.startswith("distilling") for line in lines)


def _three_classes(digits: LabelledData) -> LabelledData:
    """The digits 0, 1 and 2 only: a data set with other classes than the model's ten."""

    def keep(split: TensorDataset) -> TensorDataset:
        x, y = split.tensors
        mask = y < 3
        return TensorDataset(x[mask], y[mask])

    return replace(digits, train=keep(digits.train), val=keep(digits.val), num_classes=3)


def test_refine_at_must_leave_a_coarse_epoch(native: torch.nn.Module, digits: LabelledData) -> None:
    with pytest.raises(odeify.ConfigError, match="refine_at"):
        finetune(coarse(native), digits, QUICK, refine_at=[1], progress=False)


# -- training, checkpoints, resume -----------------------------------------------------------------
def test_finetune_trains_and_writes_loadable_checkpoints(
    native: torch.nn.Module, digits: LabelledData, tmp_path: Path
) -> None:
    start = coarse(native)
    before = {name: p.detach().clone() for name, p in start.named_parameters()}
    result = finetune(
        start, digits, QUICK, out=tmp_path, max_batches=BATCHES, progress=False, calibrate_first=False
    )
    history = result.history
    assert [r.epoch for r in history] == [0, 1, 2]
    assert history[0].val_accuracy == pytest.approx(accuracy(coarse(native), digits.val))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [BEST_FILE, LAST_FILE, STATE_FILE, "history.json", "summary.csv"]
    )  # no temporary files left behind
    last = odeify.load(tmp_path / LAST_FILE)
    assert history[-1].val_accuracy == pytest.approx(accuracy(last, digits.val))
    x = digits.val.tensors[0][:8]
    with torch.no_grad():
        assert torch.equal(last(x), result.model.eval()(x))
    best = max(history, key=lambda r: r.val_accuracy)
    assert accuracy(odeify.load(tmp_path / BEST_FILE), digits.val) == pytest.approx(best.val_accuracy)
    changed = [
        n for n, p in result.model.named_parameters() if ".knots." in n and not torch.equal(p, before[n])
    ]
    assert changed, "no knot tensor was trained"


@pytest.mark.parametrize(
    ("ema_decay", "refine_at", "crash_in"),
    [
        (None, [], 1.5),
        (0.9, [2], 2.5),
    ],  # with a weight average: crash after a refinement, which resume replays
    ids=["plain", "ema-refined"],
)
def test_resume_after_a_crash_mid_epoch_matches_an_uninterrupted_run(
    native: torch.nn.Module,
    digits: LabelledData,
    tmp_path: Path,
    ema_decay: float | None,
    refine_at: list[int],
    crash_in: float,
) -> None:
    recipe = replace(QUICK, epochs=3, ema_decay=ema_decay)
    common = {"refine_at": refine_at, "max_batches": BATCHES, "progress": False, "calibrate_first": False}
    whole = finetune(coarse(native), digits, recipe, out=tmp_path / "a", **common)
    limit = int(crash_in * (BATCHES + 1) * recipe.batch_size)  # an epoch reads the batch it stops at
    crashing = replace(digits, train=CrashAfter(digits.train, limit=limit))
    with pytest.raises(RuntimeError, match="simulated crash"):
        finetune(coarse(native), crashing, recipe, out=tmp_path / "b", **common)
    assert odeify.load(tmp_path / "b" / LAST_FILE) is not None  # the last epoch's files survived the crash
    assert _completed_epoch(tmp_path / "b") == int(crash_in)
    resumed = finetune(coarse(native), digits, recipe, out=tmp_path / "b", resume=True, **common)
    assert [r.epoch for r in resumed.history] == [0, 1, 2, 3]
    untimed = [{**asdict(r), "seconds": None, "peak_memory_mib": None} for r in resumed.history]
    assert untimed == [{**asdict(r), "seconds": None, "peak_memory_mib": None} for r in whole.history]
    assert (resumed.history[-1].val_accuracy_raw is None) == (ema_decay is None)
    assert_same_tensors(tensors(tmp_path / "a" / LAST_FILE), tensors(tmp_path / "b" / LAST_FILE))
    # the training state too: raw weights, weight average (``ema.*``) and optimizer moments
    assert_same_tensors(tensors(tmp_path / "a" / STATE_FILE), tensors(tmp_path / "b" / STATE_FILE))


def test_resume_refuses_other_settings(native: torch.nn.Module, digits: LabelledData, tmp_path: Path) -> None:
    finetune(
        coarse(native),
        digits,
        replace(QUICK, epochs=1),
        out=tmp_path,
        max_batches=1,
        progress=False,
    )
    with pytest.raises(odeify.ConfigError, match="lr"):
        other = replace(QUICK, epochs=1, lr=0.5)
        finetune(coarse(native), digits, other, out=tmp_path, resume=True, max_batches=1, progress=False)
    with pytest.raises(odeify.ConfigError, match="does not exist"):
        finetune(coarse(native), digits, QUICK, out=tmp_path / "none", resume=True, progress=False)


def test_a_state_recorded_before_a_recipe_field_existed_resumes(
    native: torch.nn.Module, digits: LabelledData, tmp_path: Path
) -> None:
    """A run saved by an odeify without ``ema_decay`` ran without an average: it resumes, as the same run."""
    recipe = replace(QUICK, epochs=2)
    common = {"max_batches": BATCHES, "progress": False, "calibrate_first": False}
    finetune(coarse(native), digits, recipe, out=tmp_path / "a", **common)
    limit = int(1.5 * (BATCHES + 1) * recipe.batch_size)  # a crash in epoch 2
    crashing = replace(digits, train=CrashAfter(digits.train, limit=limit))
    with pytest.raises(RuntimeError, match="simulated crash"):
        finetune(coarse(native), crashing, recipe, out=tmp_path / "b", **common)
    path = tmp_path / "b" / STATE_FILE
    with safe_open(str(path), framework="pt") as handle:
        record = json.loads(handle.metadata()[STATE_KEY])
    del record["run"]["recipe"]["ema_decay"]  # as the older version wrote it
    path.write_bytes(safetensors.torch.save(tensors(path), metadata={STATE_KEY: json.dumps(record)}))
    resumed = finetune(coarse(native), digits, recipe, out=tmp_path / "b", resume=True, **common)
    assert [r.epoch for r in resumed.history] == [0, 1, 2]
    assert_same_tensors(tensors(tmp_path / "a" / LAST_FILE), tensors(tmp_path / "b" / LAST_FILE))


# -- weight average (EMA) --------------------------------------------------------------------------
def test_weight_average_follows_timms_warmed_up_ema_of_the_raw_weights(
    native: torch.nn.Module, digits: LabelledData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The returned and saved model is the EMA of the weights after each optimizer step, computed by hand.

    The optimizer steps the source tensors; the model's weights follow when they are pushed back.
    """
    model = coarse(native)
    trajectory: list[dict[str, torch.Tensor]] = []
    push = SourceCoordinates.push

    def snapshot(sources: SourceCoordinates) -> None:
        push(sources)
        trajectory.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    recipe = replace(QUICK, ema_decay=0.5)  # the warm-up's decay exceeds 0.5 from step 3: both regimes
    monkeypatch.setattr(SourceCoordinates, "push", snapshot)
    result = finetune(
        model, digits, recipe, out=tmp_path, max_batches=BATCHES, progress=False, calibrate_first=False
    )
    monkeypatch.undo()
    assert len(trajectory) == recipe.epochs * BATCHES
    expected = {k: v.double() for k, v in trajectory[0].items()}  # step 1: the average is the weights
    for step, weights in enumerate(trajectory[1:], start=2):
        decay = min(recipe.ema_decay, 1 - step**-EMA_WARMUP_POWER)
        for k, v in weights.items():
            expected[k] = decay * expected[k] + (1 - decay) * v.double() if v.is_floating_point() else v
    average = result.model.state_dict()
    assert average.keys() == expected.keys()
    steps, eps = len(trajectory), torch.finfo(torch.float32).eps
    for name, value in average.items():
        if not value.is_floating_point():
            assert torch.equal(value, trajectory[-1][name]), name
            continue
        # timm averages in float32: each update rounds once or twice, at most 2 ulps of the largest value
        scale = max(float(w[name].abs().max()) for w in trajectory)
        torch.testing.assert_close(
            value.double(), expected[name], rtol=0, atol=2 * steps * eps * scale, msg=name
        )
    assert not torch.equal(average["fc.weight"], model.state_dict()["fc.weight"])  # not the raw weights
    assert_same_tensors(tensors(tmp_path / LAST_FILE), {k: v.contiguous() for k, v in average.items()})
    last = result.history[-1]
    assert last.val_accuracy == pytest.approx(accuracy(odeify.load(tmp_path / LAST_FILE), digits.val))
    assert last.val_accuracy_raw == pytest.approx(accuracy(model, digits.val))


def test_refine_at_refines_the_weight_average_too(
    native: torch.nn.Module, digits: LabelledData, tmp_path: Path
) -> None:
    model = coarse(native)
    recipe = replace(QUICK, ema_decay=0.9)
    result = finetune(model, digits, recipe, out=tmp_path, refine_at=[2], max_batches=BATCHES, progress=False)
    shapes = {k: v.shape for k, v in result.model.state_dict().items()}
    assert result.history[-1].knots == {"layer1": 8, "layer2": 6}
    state = tensors(tmp_path / STATE_FILE)
    raw = {k[len("model.") :]: v.shape for k, v in state.items() if k.startswith("model.")}
    assert {k[len("ema.") :]: v.shape for k, v in state.items() if k.startswith("ema.")} == raw == shapes
    assert [s.num_knots for s in odeify.converted_stages(result.model)] == [8, 6]
    last = odeify.load(tmp_path / LAST_FILE)
    assert result.history[-1].val_accuracy == pytest.approx(accuracy(last, digits.val))
    assert result.history[-1].val_accuracy_raw is not None


# -- divergence ------------------------------------------------------------------------------------
def test_nonfinite_loss_stops_before_saving(
    native: torch.nn.Module, digits: LabelledData, tmp_path: Path
) -> None:
    model = coarse(native)
    saved: dict[str, bytes] = {}

    def poison_after_epoch_1(line: str) -> None:
        if line.startswith("epoch 1/"):  # the run's files, not the lock it holds while it runs
            saved.update({p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != LOCK_FILE})
            with torch.no_grad():
                model.fc.weight.fill_(math.nan)

    with (
        on_log(poison_after_epoch_1),
        pytest.raises(TrainingDiverged, match=r"epoch 2, batch 1/3 \(optimizer step 4\): the loss is nan"),
    ):
        finetune(model, digits, QUICK, out=tmp_path, max_batches=BATCHES, progress=False)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == saved  # nothing overwritten
    assert all(torch.isfinite(t).all() for t in tensors(tmp_path / LAST_FILE).values())


def test_nonfinite_gradient_names_the_parameter_and_stage(
    native: torch.nn.Module, digits: LabelledData, tmp_path: Path
) -> None:
    model = coarse(native)
    knot = model.get_parameter(
        next(n for n, _ in model.named_parameters() if "layer2" in n and ".knots." in n)
    )
    name = next(n for n, p in model.named_parameters() if p is knot)
    knot.register_hook(lambda grad: torch.full_like(grad, math.inf))
    with pytest.raises(
        TrainingDiverged, match=rf"the gradient of {re.escape(name)} \(stage 'layer2'\) is inf"
    ):
        finetune(model, digits, QUICK, out=tmp_path, max_batches=BATCHES, progress=False)
    assert not (tmp_path / LAST_FILE).exists()  # epoch 1 never completed; only the start's best file
    assert torch.isfinite(tensors(tmp_path / BEST_FILE)[name]).all()


# -- refinement ------------------------------------------------------------------------------------
def test_refine_doubles_knots_and_steps_resampling_the_weight_path(native: torch.nn.Module) -> None:
    model = coarse(native)
    refined = refine(model)
    for old, new in zip(odeify.converted_stages(model), odeify.converted_stages(refined), strict=True):
        assert (new.num_knots, new.steps) == (2 * old.num_knots, 2 * old.steps)
        for name, stack in old.knots.items():  # a constant basis: each knot's cell splits in two
            assert torch.equal(new.knots[name], stack.repeat_interleave(2, dim=0)), name


def test_refine_at_keeps_optimizer_state_outside_the_knots(
    native: torch.nn.Module, digits: LabelledData
) -> None:
    lines: list[str] = []
    model = coarse(native)
    with on_log(lines.append):
        result = finetune(model, digits, QUICK, refine_at=[2], max_batches=BATCHES, progress=False)
    assert [r.knots for r in result.history] == [{"layer1": 4, "layer2": 3}] * 2 + [
        {"layer1": 8, "layer2": 6}
    ]
    assert [r.steps["layer1"] for r in result.history] == [1, 1, 2]
    # what the optimizer trains outside the stages: the source tensors of folded layers, the rest
    _, trained = param_groups(model, SourceCoordinates(model), 0.0)
    outside = sum(not any(s in name for s in ("layer1_ode", "layer2_ode")) for name in trained)
    refined = next(line for line in lines if "refined" in line)
    assert f"the {outside} parameters outside the knot stacks keep their optimizer state" in refined


# -- processes: SIGKILL and torchrun ---------------------------------------------------------------
def _finetune_command(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "odeify", "finetune", "--data", "digits", "--steps", "1", "--epochs", "3",
        "--max-batches", "8", "--batch-size", "32", "--deterministic", "--out", str(out), *extra,
    ]  # fmt: skip


def test_sigkill_mid_epoch_then_resume_reaches_the_same_knots(tmp_path: Path) -> None:
    whole = subprocess.run(
        _finetune_command(tmp_path / "a"), env=ENV, capture_output=True, text=True, timeout=600
    )
    assert whole.returncode == 0, whole.stderr[-3000:]

    killed = subprocess.Popen(  # not a terminal: a progress line per batch on stdout
        _finetune_command(tmp_path / "b", "--log-interval", "1"), env=ENV, stdout=subprocess.PIPE
    )
    seen = b""
    os.set_blocking(killed.stdout.fileno(), False)
    deadline = time.monotonic() + 300
    while not re.search(rb"epoch 2/3 \[[1-6]/8\]", seen) and time.monotonic() < deadline:
        seen += killed.stdout.read() or b""
        assert killed.poll() is None, seen.decode()[-3000:]
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    assert _completed_epoch(tmp_path / "b") == 1  # killed during epoch 2: epoch 1's state is the last

    resumed = subprocess.run(
        [sys.executable, "-m", "odeify", "finetune", "--resume", "--out", str(tmp_path / "b")],
        env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stdout and "after epoch 1" in resumed.stdout
    assert_same_tensors(tensors(tmp_path / "a" / LAST_FILE), tensors(tmp_path / "b" / LAST_FILE))


def test_torchrun_two_processes_train_like_one_on_the_combined_batch(tmp_path: Path) -> None:
    """In float64, so that the two runs can be held to round-off (float32 would compare two reduction
    orders, whose gap depends on the CPU's kernels)."""
    model = tmp_path / "digits64.safetensors"
    odeify.save(odeify.convert(odeify.load_model(DEFAULT_MODEL_PATH).double()), model)
    common = [str(model), "--data", "digits", "--steps", "1", "--epochs", "1", "--max-batches", "3"]
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "odeify", "finetune", *common, "--batch-size", "16", "--out", str(tmp_path / "ddp"),
    ]  # fmt: skip
    done = subprocess.run(torchrun, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes on cpu" in done.stdout and "epoch 1/1" in done.stdout
    single = [
        sys.executable,
        "-m",
        "odeify",
        "finetune",
        *common,
        "--batch-size",
        "32",
        "--out",
        str(tmp_path / "one"),
    ]
    done = subprocess.run(single, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    ddp, one = tensors(tmp_path / "ddp" / LAST_FILE), tensors(tmp_path / "one" / LAST_FILE)
    start = odeify.load(model).state_dict()
    assert ddp.keys() == one.keys()
    assert next(iter(one.values())).dtype == torch.float64
    assert [n for n in one if "knots" in n and not torch.equal(one[n], start[n])], "the knots did not train"
    for name in one:
        # measured on AMD EPYC: at most 1.9e-16 of each tensor's largest entry apart (gloo's reduction
        # order); a wrong shard or average is far off
        torch.testing.assert_close(ddp[name], one[name], rtol=1e-10, atol=1e-12, msg=name)
    assert odeify.load(tmp_path / "ddp" / LAST_FILE) is not None


def _completed_epoch(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / STATE_FILE), framework="pt") as handle:
        return json.loads(handle.metadata()["odeify_train_state"])["epoch"]


def test_training_defaults_to_a_memory_free_mode_per_integrator(native: torch.nn.Module) -> None:
    """Reversible integrators train reversible (exact, flat memory), any other integrator checkpoint;
    a stage that already has a memory-free mode keeps it unless the integrator changes."""
    from odeify.train.manifestations import memory_free_backward

    assert memory_free_backward(native, "alf") == "reversible"
    assert memory_free_backward(native, "reversible_heun") == "reversible"
    assert memory_free_backward(native, "rk4") == "checkpoint"
    assert memory_free_backward(native) == "checkpoint"  # Euler, as converted
    reverse = odeify.set_backward(native, {"layer1": "reverse"})
    assert memory_free_backward(reverse) == {"layer1": "reverse", "layer2": "checkpoint"}


def test_a_model_as_converted_trains_alf_reversible_unless_asked() -> None:
    """Nothing asked for, the source's manifestation trains memory-free and exact (ALF, reversible);
    any manifestation setting or backward mode given, or a run that cannot rebuild exactly (autocast),
    keeps the old rule (Euler trains checkpoint)."""
    from odeify.compiler.conversion import converted_stages
    from odeify.train.manifestations import at_source_manifestation, for_training

    def shape(model: torch.nn.Module) -> list[tuple[str, str, int]]:
        return [(s.integrator.name, s.backward, s.steps) for s in converted_stages(model)]

    native = odeify.convert(str(DEFAULT_MODEL_PATH))  # its own: set_backward changes a model in place
    assert at_source_manifestation(native)
    assert shape(for_training(native)) == [("alf", "reversible", 4), ("alf", "reversible", 3)]
    assert shape(for_training(native, steps=1)) == [("euler", "checkpoint", 1)] * 2
    euler = [("euler", "checkpoint", 4), ("euler", "checkpoint", 3)]
    assert shape(for_training(native, "checkpoint")) == euler
    assert shape(for_training(native, rebuilds_exactly=False)) == euler  # e.g. autocast
    coarse = odeify.retarget(native, steps=1)
    assert not at_source_manifestation(coarse)
    assert shape(for_training(coarse)) == [("euler", "checkpoint", 1)] * 2


@pytest.mark.parametrize(("settings", "peak"), [({"integrator": "alf"}, ALF_LR), ({"steps": 1}, DEFAULT_LR)])
def test_a_recipe_without_lr_trains_at_its_integrators_peak(digits, settings, peak) -> None:
    """The default recipe's lr is None: one step (the whole schedule: the peak) runs at ALF's peak
    where a stage integrates with ALF, else at the default one; a recipe's own lr is kept."""
    model = odeify.retarget(odeify.convert(str(DEFAULT_MODEL_PATH)), **settings)  # not the shared native
    one_step = replace(DEFAULT_RECIPE, epochs=1, batch_size=16)
    assert one_step.lr is None
    history = finetune(model, digits, one_step, max_batches=1, progress=False).history
    assert history[1].lr == pytest.approx(peak)
    own = finetune(model, digits, replace(one_step, lr=1e-3), max_batches=1, progress=False).history
    assert own[1].lr == pytest.approx(1e-3)
