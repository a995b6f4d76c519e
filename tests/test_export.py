"""Models that export (issue 21, s5): what a fine-tuning run saves with a memory-saving backward,
loaded as ``odeify.load`` gives it (eval mode), goes through ``torch.save``/``torch.load``,
``torch.jit.trace``, ``torch.export`` and ``torch.onnx.export`` as it is; in training mode, and for
``torch.jit.script`` and timm's ``set_grad_checkpointing``, the error names the fix.

Oracle: the loaded model run eagerly (no gradients) on the same input; ONNX is run by onnx's own
reference evaluator (numpy), not by torch.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest
import torch
from precision import as_float64, assert_as_accurate_as

import odeify
from odeify.cli.parser import main
from odeify.compiler.conversion import converted_stages
from odeify.core.errors import ConfigError
from odeify.models.timm_interface import ConvertedModel

pytestmark = pytest.mark.usefixtures("one_thread")

RUNS = {  # the manifestation a run trains: one with whole-model checkpointing, one memory-free
    "checkpoint": ["--steps", "1", "--backward", "checkpoint"],
    "reversible": ["--integrator", "reversible_heun", "--steps", "2", "--backward", "reversible"],
}
ONNX_FACTOR = 4.0
"""The ONNX reference evaluator's float32 output may be this many times as far from the model's
float64 output as torch's float32 output is (8-ulp floor): numpy's convolutions sum in another order
than torch's. Measured on the digits model: ONNX 1.5e-7 from float64, torch float32 1.1e-7, both
under the 8-ulp floor 9.5e-7 (ratio 0.16; AMD EPYC, 1 thread)."""


@pytest.fixture(scope="module", params=list(RUNS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The model a one-step fine-tuning run saved (``last.safetensors``), per backward mode."""
    folder = tmp_path_factory.mktemp(request.param)
    converted = folder / "digits_ode.safetensors"
    assert main(["convert", "-o", str(converted)]) == 0
    argv = ["finetune", str(converted), "--data", "digits", "--epochs", "1", "--max-batches", "1",
            "-b", "16", "--out", str(folder / "run"), *RUNS[request.param]]  # fmt: skip
    assert main(argv) == 0
    return request.param, folder / "run" / "last.safetensors"


def _loaded(path: Path) -> torch.nn.Module:
    model = odeify.load(path)
    assert not model.training  # as loaded: eval mode
    return model


def _example() -> torch.Tensor:
    return torch.randn(3, 1, 32, 32, generator=torch.Generator().manual_seed(0))


def _expected(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_torch_save_round_trips_the_model_as_loaded(saved: tuple[str, Path]) -> None:
    backward, path = saved
    model, x = _loaded(path), _example()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    assert isinstance(again, ConvertedModel) and again.pretrained_cfg == model.pretrained_cfg
    assert {s.backward for s in converted_stages(again)} == {backward}
    assert torch.equal(_expected(again, x), _expected(model, x))
    again.train()  # it still trains in its backward mode
    again(x).logsumexp(1).sum().backward()
    assert all(p.grad is not None for p in again.parameters() if p.requires_grad)


def test_jit_trace_and_torch_export_record_the_model_as_loaded(saved: tuple[str, Path]) -> None:
    model, x = _loaded(saved[1]), _example()
    expected = _expected(model, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, x)
    ours = [f"{w.filename}:{w.lineno}" for w in caught if "odeify" in Path(w.filename).parts]
    assert not ours, f"TracerWarnings from odeify's own code, whose trace is right: {ours}"
    assert torch.equal(traced(x), expected)
    exported = torch.export.export(model, (x,))
    torch.testing.assert_close(exported.module()(x), expected, rtol=0, atol=0)


def test_onnx_export_computes_the_same(saved: tuple[str, Path], tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx", reason="the ONNX exporter needs the onnx package (a test extra)")
    pytest.importorskip("onnxscript", reason="torch.onnx.export needs onnxscript (a test extra)")
    from onnx.reference import ReferenceEvaluator

    model, x = _loaded(saved[1]), _example()
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), dynamo=True)
    graph = onnx.load(str(path))
    (got,) = ReferenceEvaluator(graph).run(None, {graph.graph.input[0].name: x.numpy()})
    exact = _expected(as_float64(model), x.double())
    assert_as_accurate_as(
        {"logits": torch.from_numpy(got)}, {"logits": _expected(model, x)}, {"logits": exact}, ONNX_FACTOR
    )


def test_training_mode_and_script_refuse_naming_the_fix(saved: tuple[str, Path]) -> None:
    model, x = _loaded(saved[1]), _example()
    model.train()
    with pytest.raises(ConfigError, match=r"model\.eval\(\)"):
        torch.jit.trace(model, x)
    with pytest.raises(ConfigError, match=r"model\.eval\(\)"):
        torch.export.export(model, (x,))
    with pytest.raises(ConfigError, match=r"torch\.jit\.trace\(model\.eval\(\), example\)"):
        torch.jit.script(model)


def test_set_grad_checkpointing_is_the_backward_mode(saved: tuple[str, Path]) -> None:
    backward, path = saved
    model = _loaded(path)
    if backward == "checkpoint":  # already what timm's switch asks for: accepted as it is
        model.set_grad_checkpointing(True)
    else:
        with pytest.raises(ConfigError, match=r"odeify\.set_backward\(model, 'checkpoint'\)"):
            model.set_grad_checkpointing(True)
    with pytest.raises(ConfigError, match=r"odeify\.set_backward\(model, 'backprop'\)"):
        model.set_grad_checkpointing(False)
    odeify.set_backward(model, "backprop")
    model.set_grad_checkpointing(False)  # now true of the model: accepted
