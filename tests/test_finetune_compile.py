"""``finetune(torchcompile=...)`` / ``odeify finetune --torchcompile`` (timm train.py's flag).

The oracle: the same run eager. ``aot_eager`` (dynamo and AOT autograd, no code generation: seconds)
runs eager's kernels, and this run's eager path is deterministic on the CPU, so the compiled run's
weights, weight average and optimizer state are the eager run's bit for bit (measured: max
difference 0.0 in checkpoint and reversible ALF). A bad setting is refused before any work.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils.data import TensorDataset

import odeify
from odeify.core.errors import ConfigError
from odeify.train.datasets import LabelledData
from odeify.train.distributed import Processes
from odeify.train.finetune import DEFAULT_RECIPE, LAST_FILE, STATE_FILE, FineTuneResult, finetune, refine
from odeify.train.torch_compile import TorchCompile
from odeify.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = replace(DEFAULT_RECIPE, epochs=1, batch_size=16, distill=0.0)
"""One epoch of two batches, without a teacher or a weight average: each compiles a module of its own
(seconds more each), which test_the_average_and_a_refined_model_run_compiled checks without running."""


@pytest.fixture(scope="module")
def small(digits: LabelledData) -> LabelledData:
    """The digits set with a validation split of one batch: one evaluation graph to compile."""
    x, y = digits.val.tensors
    return replace(digits, val=TensorDataset(x[:64], y[:64]))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in safetensors.torch.load_file(str(path)).items() if not k.startswith("@probe/")}


class _Lines(logging.Handler):
    """Keeps every line the ``odeify`` logger emits."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(native, data: LabelledData, out: Path, **kwargs) -> tuple[FineTuneResult, list[str]]:
    """A run of the digits model with a memory-free stage (reversible ALF) into ``out``, and its log."""
    logger, handler = logging.getLogger("odeify"), _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = odeify.retarget(native, integrator="alf", backward="reversible")
        settings = {"recipe": RECIPE, "max_batches": 2, "progress": False, **kwargs}
        return finetune(model, data, out=out, **settings), handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_compiled_run_trains_the_eager_runs_weights_and_says_so(native, small, tmp_path: Path) -> None:
    eager, _ = _run(native, small, tmp_path / "eager")
    compiled, lines = _run(native, small, tmp_path / "compiled", torchcompile="aot_eager")
    for name in (LAST_FILE, STATE_FILE):  # weights, weight average, optimizer moments: bit for bit
        want, got = _tensors(tmp_path / "eager" / name), _tensors(tmp_path / "compiled" / name)
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), name

    def untimed(history):
        return [
            {**asdict(r), "seconds": None, "peak_memory_mib": None, "torchcompile": None} for r in history
        ]

    assert untimed(compiled.history) == untimed(eager.history)
    assert [r.torchcompile for r in compiled.history] == ["aot_eager", "aot_eager"]
    assert [r.torchcompile for r in eager.history] == [None, None]
    said = [line for line in lines if line.startswith("torch.compile")]
    assert said == [
        "torch.compile with backend aot_eager, mode default: the model (training and validation); the "
        "memory-free stages (layer1, layer2) run their own passes eagerly"
    ]
    assert "torchcompile" not in (tmp_path / "eager" / "summary.csv").read_text()
    # compiling does not change the weights: a resume may drop it (or add it); each epoch says how it ran
    _run(native, small, tmp_path / "compiled", recipe=replace(RECIPE, epochs=2), resume=True)
    with open(tmp_path / "compiled" / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["torchcompile"] for row in rows] == ["aot_eager", "aot_eager", ""]


def test_what_cannot_compile_is_refused_before_any_work(
    native, small, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = {
        "nosuch": (dict(torchcompile="nosuch"), r"torch\._dynamo\.list_backends\(\) names .*inductor"),
        "mode alone": (dict(torchcompile_mode="max-autotune"), "pass torchcompile too"),
        "mode of another": (
            dict(torchcompile="aot_eager", torchcompile_mode="max-autotune"),
            "aot_eager ignores",
        ),
        "no such mode": (dict(torchcompile="inductor", torchcompile_mode="fast"), "inductor's are default"),
    }
    for name, (kwargs, message) in refused.items():
        with pytest.raises(ConfigError, match=message):
            _run(native, small, tmp_path / name, **kwargs)
        assert not (tmp_path / name).exists(), name
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", ("/no/such/c++",))  # no C++ compiler for inductor's CPU code
    with pytest.raises(ConfigError, match="found no C\\+\\+ compiler.*apt-get install g\\+\\+.*aot_eager"):
        _run(native, small, tmp_path / "cxx", torchcompile="inductor")
    monkeypatch.undo()


def test_the_average_and_a_refined_model_run_compiled(native) -> None:
    """timm's order: the weight average is made from the module itself, then the model is compiled (and
    would be wrapped by DDP after); the average validates through a compiled copy of its own, and a
    refinement (a new model) is compiled again. Saving and averaging read the modules themselves."""
    recipe = replace(RECIPE, ema_decay=0.9, lr=1e-4)
    trainer = Trainer(
        odeify.retarget(native, steps=1), recipe, Processes(), 1, None, TorchCompile("aot_eager")
    )
    for _ in range(2):
        assert isinstance(trainer.wrapped, OptimizedModule) and trainer.wrapped._orig_mod is trainer.model
        assert trainer.running is trainer.wrapped
        assert isinstance(trainer.validated_output, OptimizedModule)
        assert trainer.validated_output._orig_mod is trainer.ema.module is trainer.output
        assert not any(name.startswith("_orig_mod") for name in trainer.ema.module.state_dict())
        trainer.replace_model(refine(trainer.model))


def test_inductor_compiles_a_recomputing_model_without_layout_copies(
    native, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor's layout_optimization saves channels_last copies for backward, which raised a compiled
    checkpoint step's peak 34.5 -> 63.6 MiB (benchmarks/results/train_step_compiled.md): a model whose
    stages recompute is compiled with it off, in the run's mode's options; a backprop model and a
    teacher that is no converted model keep inductor's defaults."""
    calls: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: calls.append(kwargs) or module)
    compiling = TorchCompile("inductor", "max-autotune")
    compiling(odeify.retarget(native, backward="checkpoint"))
    compiling(odeify.retarget(native, integrator="alf", backward="reversible"))
    compiling(odeify.retarget(native, backward="backprop"))
    compiling(torch.nn.Linear(2, 2))
    keeping = {"max_autotune": True, "layout_optimization": False}
    assert [call.get("options", {}).items() >= keeping.items() for call in calls] == [
        True,
        True,
        False,
        False,
    ]
    assert [call.get("mode") for call in calls] == [None, None, "max-autotune", "max-autotune"]
