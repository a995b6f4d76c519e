"""``odeify finetune``'s default backward mode follows the measured peak of a training step.

The oracle is an independent measure: a step with cross-entropy on labels, after a warm-up step,
under :class:`TensorPeak` (tests/test_batch_slices.py's ``step_peak``), where the default measures
a mean-square loss on a copy with zeroed gradients. The two models sit on either side of the margin
by far, so the rule is tested, not the margin.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from test_batch_slices import step_peak
from torch import nn

import odeify
from odeify.compiler.conversion import converted_stages
from odeify.train.manifestations import MEMORY_FREE_DEFAULT, PEAK_MARGIN, StepProbe, for_training
from odeify.train.step_peak import training_step_peak

pytestmark = pytest.mark.usefixtures("one_thread")


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.conv1(x)))


class _DeepNarrow(nn.Module):
    """One run of 32 narrow blocks at full resolution: activations outweigh the weights many times."""

    def __init__(self, channels: int = 16, depth: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[_Block(channels) for _ in range(depth)])
        self.head = nn.Linear(channels, 10)
        for block in self.blocks:
            block.conv2.weight.data.mul_(0.3)  # a stable stack, as a trained one is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _modes(model) -> set[tuple[str, str]]:
    return {(s.integrator.name, s.backward) for s in converted_stages(model)}


def _independent_ratio(model, x: torch.Tensor) -> float:
    """ALF reversible's step peak over checkpoint's, by the tests' own measure."""
    alf = odeify.retarget(model, **MEMORY_FREE_DEFAULT).train()
    checkpointed = odeify.retarget(model, backward="checkpoint").train()
    return step_peak(alf, x) / step_peak(checkpointed, x)


@pytest.mark.parametrize(
    ("case", "expected"),
    [("digits, batch 64", ("euler", "checkpoint")), ("32 narrow blocks, batch 16", ("alf", "reversible"))],
)
def test_the_default_is_the_mode_whose_step_peaks_lower(native, image, case, expected, caplog) -> None:
    """The shipped digits model at 32x32 (ALF's float64 registers outweigh what checkpointing
    recomputes of its 3- and 4-block stages: measured 4.8 MiB against 4.0) trains with checkpoint;
    a run of 32 narrow blocks at 32x32, batch 16 (checkpointing's re-run grows with depth, ALF's
    does not: 18.3 MiB against 39.0) with reversible ALF. Each choice agrees with the independent
    measure, and the log gives both peaks."""
    if case.startswith("digits"):
        model, x = native, image((64, 1, 32, 32))
    else:
        model, x = odeify.convert(_DeepNarrow(), input_size=(1, 3, 32, 32)), image((16, 3, 32, 32))
    ratio = _independent_ratio(model, x)
    with caplog.at_level(logging.INFO, logger="odeify"):
        trained = for_training(model, probe=StepProbe(tuple(x.shape), torch.device("cpu")))
    assert _modes(trained) == {expected}
    assert (ratio <= PEAK_MARGIN) == (expected == ("alf", "reversible"))
    assert abs(ratio - PEAK_MARGIN) > 0.1  # far from the margin: the rule decides, not the margin
    assert "reversible ALF peaks at" in caplog.text and "checkpoint at" in caplog.text


def test_the_measure_leaves_the_model_and_the_rngs_as_they_were(native) -> None:
    """The measured step runs on a copy with the RNG forked: the model's weights, buffers and
    gradients, and what torch and Python draw next, are as before."""
    model = odeify.retarget(native, **MEMORY_FREE_DEFAULT).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    random.seed(1)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(1)
    random.seed(1)
    peak = training_step_peak(model, (8, 1, 32, 32), torch.device("cpu"))
    assert peak > 0
    assert (torch.rand(3).tolist(), random.random()) == (expected[0].tolist(), expected[1])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_asked_for_settings_are_not_measured(native, monkeypatch) -> None:
    """A backward mode or manifestation given on the command line is trained as given: no step is
    measured for it."""
    import odeify.train.manifestations as manifestations

    def refuse(*args, **kwargs):
        raise AssertionError("measured a step for settings the user gave")

    monkeypatch.setattr(manifestations, "training_step_peak", refuse)
    probe = StepProbe((8, 1, 32, 32), torch.device("cpu"))
    assert _modes(for_training(native, "checkpoint", probe=probe)) == {("euler", "checkpoint")}
    assert _modes(for_training(native, probe=probe, integrator="alf")) == {("alf", "reversible")}


def test_a_run_records_its_measured_default_and_its_resume_keeps_it(tmp_path, monkeypatch) -> None:
    """``odeify finetune`` given no manifestation flag records the mode it measured as if given (the
    digits model: ``--backward checkpoint``), so ``--resume`` trains the same without measuring again,
    wherever it runs."""
    from odeify.cli.parser import main
    from odeify.models import DEFAULT_MODEL_PATH
    from odeify.train.state import read_run

    out = tmp_path / "run"
    run = ["finetune", str(DEFAULT_MODEL_PATH), "--data", "digits", "--max-batches", "1", "--out", str(out)]
    assert main([*run, "--epochs", "1"]) == 0
    assert {k: read_run(out)["cli"][k] for k in ("integrator", "backward")} == {
        "integrator": None,
        "backward": "checkpoint",
    }

    _refuse_measuring(monkeypatch)
    assert main([*run, "--epochs", "2", "--resume"]) == 0
    assert read_run(out)["cli"]["backward"] == "checkpoint"


def _refuse_measuring(monkeypatch) -> None:
    import odeify.train.manifestations as manifestations

    def refuse(*args, **kwargs):
        raise AssertionError("the default was measured")

    monkeypatch.setattr(manifestations, "training_step_peak", refuse)


def test_a_run_recorded_before_the_measurement_resumes_as_it_trained(tmp_path, monkeypatch, caplog) -> None:
    """A run whose record names no manifestation (written before the default was measured, which
    trained with ALF) resumes with ALF, unmeasured; the model it began with must match (a resume in
    another manifestation is refused by the run's fingerprint)."""
    import json

    import safetensors.torch
    from safetensors import safe_open

    from odeify.cli.parser import main
    from odeify.models import DEFAULT_MODEL_PATH
    from odeify.train.finetune import STATE_FILE, STATE_KEY

    out = tmp_path / "run"
    run = ["finetune", str(DEFAULT_MODEL_PATH), "--data", "digits", "--max-batches", "1", "--out", str(out)]
    assert main([*run, "--epochs", "1", "--integrator", "alf", "--backward", "reversible"]) == 0
    state = out / STATE_FILE
    with safe_open(str(state), framework="pt") as handle:
        record = json.loads(handle.metadata()[STATE_KEY])
    record["run"]["cli"].update(integrator=None, backward=None)  # as the previous version recorded it
    tensors = safetensors.torch.load_file(str(state))
    state.write_bytes(safetensors.torch.save(tensors, metadata={STATE_KEY: json.dumps(record)}))
    _refuse_measuring(monkeypatch)
    with caplog.at_level(logging.INFO, logger="odeify"):
        assert main([*run, "--epochs", "2", "--resume"]) == 0
    assert "layer1: alf" in caplog.text and "backward reversible" in caplog.text


def test_a_split_without_one_full_batch_is_refused_unmeasured(tmp_path, monkeypatch, capsys) -> None:
    """A batch larger than the training split is refused naming --batch-size, before any step is
    measured at it."""
    from odeify.cli.parser import main
    from odeify.models import DEFAULT_MODEL_PATH

    _refuse_measuring(monkeypatch)
    code = main(["finetune", str(DEFAULT_MODEL_PATH), "--data", "digits", "--batch-size", "5000", "--out",
                 str(tmp_path / "run")])  # fmt: skip
    assert code == 2
    assert "Lower --batch-size" in capsys.readouterr().err
