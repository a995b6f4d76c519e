"""Fine-tuning in the source's coordinates, and the source network a converted model keeps.

The oracles: the source network itself (timm, BatchNorm statistics frozen as folding freezes them)
taking the same AdamW step in float64; the source's outputs for the teacher; the files and logits
an odeify from before fold records wrote (tests/data, made at commit 806cf65).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors.torch
import torch
from precision import as_float64, assert_as_accurate_as
from timm.optim import create_optimizer_v2
from torch import nn
from torch.utils.data import TensorDataset

import odeify
from odeify.ir.fold_records import fold_records
from odeify.ir.source_tensors import SOURCE_PREFIX
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models._testing import make_test_model
from odeify.train.datasets import LabelledData, open_data
from odeify.train.finetune import DEFAULT_RECIPE, Recipe, finetune, source_network
from odeify.train.parametrization import SourceCoordinates

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = Path(__file__).parent / "data"
STEP = Recipe(epochs=1, batch_size=8, lr=1e-3, warmup=0.0, distill=0.0)  # one step at lr, clipped at 5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _source(name: str) -> nn.Module:
    """A float64 source whose last BatchNorm of each residual branch has a tiny gamma, as after a
    short run from timm's zero-init (0.006 to 0.04 in the corpus's resnet18): folding scales those
    convs by about 0.01."""
    model = make_test_model(name, num_classes=10, dtype=torch.float64)
    with torch.no_grad():
        for path, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and path.endswith(("bn2", "norm2")):
                module.weight.mul_(0.01)
    return model.eval()


def _one_source_step(source: nn.Module, x: torch.Tensor, y: torch.Tensor, recipe: Recipe) -> nn.Module:
    """The source after one AdamW step (timm's grouping), BatchNorm statistics frozen (eval mode)."""
    model = copy.deepcopy(source).eval()
    optimizer = create_optimizer_v2(model, "adamw", lr=recipe.lr, weight_decay=recipe.weight_decay)
    nn.functional.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
    optimizer.step()
    return model


@pytest.mark.parametrize("name", ["resnet18", "resnetv2_18"])  # BN folded into convs; per-channel affines
def test_one_step_changes_the_converted_model_as_it_changes_the_source(name: str, image) -> None:
    source = _source(name)
    x, probe = image((8, 3, 32, 32), torch.float64), image((4, 3, 32, 32), torch.float64, seed=1)
    y = torch.arange(8) % 10
    data = LabelledData("batch", TensorDataset(x, y), TensorDataset(x, y), 10)
    converted = odeify.retarget(odeify.convert(source, input_size=(3, 32, 32)), backward="checkpoint")
    with torch.no_grad():
        before, folding = source(probe), _rel(converted(probe), source(probe))  # folding's own round-off
    stepped = _one_source_step(source, x, y, STEP)
    result = finetune(converted, data, STEP, progress=False)
    with torch.no_grad():
        after, trained = stepped(probe), result.model(probe)
    # the same step on the folded tensors themselves, as fine-tuning took it before
    folded = odeify.retarget(odeify.convert(source, input_size=(3, 32, 32)), backward="checkpoint")
    optimizer = create_optimizer_v2(folded, "adamw", lr=STEP.lr, weight_decay=STEP.weight_decay)
    nn.functional.cross_entropy(folded(x), y).backward()
    torch.nn.utils.clip_grad_norm_(folded.parameters(), STEP.clip_grad_norm)
    optimizer.step()
    with torch.no_grad():
        naive = folded(probe)
    change, error = _rel(after, before), _rel(trained, after)
    # measured (AMD EPYC, float64): folding 7.7e-16 / 8.4e-16 (resnet18 / resnetv2_18), error 9.7e-16 /
    # 7.2e-16, change 1.1 / 2.5, the folded tensors' own step 2.6 / 1.1 from the source's
    assert change > 0.1  # the step does something
    assert error <= 10 * max(folding, torch.finfo(torch.float64).eps)
    assert _rel(naive, after) > 0.1  # stepping the folded tensors is another step altogether


def test_source_coordinates_are_the_source_tensors(image) -> None:
    """Before any step, the source coordinates of a folded conv are the source's conv weight, gamma
    and beta (to float64 round-off), and pushing them back leaves the folded tensors as they were."""
    source = _source("resnet18")
    converted = odeify.convert(source, input_size=(3, 32, 32))
    sources = dict(SourceCoordinates(converted).named_sources())
    bn = source.layer2[0].bn2
    for part, expected in (
        ("weight", source.layer2[0].conv2.weight),
        ("gamma", bn.weight),
        ("beta", bn.bias),
    ):
        assert _rel(sources[f"source.layer2_0_bn2.{part}"], expected) < 1e-15
    knots = converted.layer1_ode.knots.conv2_weight.detach().clone()
    SourceCoordinates(converted).push()
    assert _rel(converted.layer1_ode.knots.conv2_weight, knots) < 1e-15


# -- the teacher ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits() -> tuple[nn.Module, LabelledData]:
    native = odeify.convert(str(DEFAULT_MODEL_PATH))
    return native, open_data("digits", native)


def test_the_teacher_after_compression_is_the_source(digits, tmp_path: Path) -> None:
    native, data = digits
    source = odeify.load_model(DEFAULT_MODEL_PATH).eval()
    x = data.val.tensors[0][:64]
    small = odeify.retarget(native, knots=2, basis="linear", backward="reverse")
    odeify.save(small, tmp_path / "small.safetensors")
    again = odeify.retarget(odeify.load(tmp_path / "small.safetensors"), knots=1, integrator="rk4", steps=1)
    with torch.no_grad():
        reference, exact = source(x), as_float64(source)(x.double())
        assert _rel(small(x), reference) > 0.1  # the compressed model is another function
        for model in (small, again):
            # the same network in float32, judged by float64: at most 4x the eager float32 error
            got = {"logits": source_network(model)(x)}
            assert_as_accurate_as(got, {"logits": reference}, {"logits": exact}, 4.0)


def test_finetune_distills_from_the_source_after_compression(digits) -> None:
    native, data = digits
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("odeify")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        small = odeify.retarget(native, knots=2, basis="linear", backward="reverse")
        finetune(
            small, data, replace(DEFAULT_RECIPE, epochs=1, batch_size=16), max_batches=1, progress=False,
            calibrate_first=False,  # calibrated, it can score what the source scores: the lines would agree
        )  # fmt: skip
    finally:
        logger.removeHandler(handler)
    source = odeify.load_model(DEFAULT_MODEL_PATH).eval()
    x, y = data.val.tensors
    with torch.no_grad():
        source_accuracy = (source(x).argmax(1) == y).double().mean().item()
    teacher = next(line for line in lines if line.startswith("distilling"))
    assert f"val accuracy {source_accuracy:.2%}" in teacher
    start = next(line for line in lines if line.startswith("epoch 0"))
    assert f"{source_accuracy:.2%}" not in start  # the compressed model scores otherwise


def test_an_unknown_source_is_said_once_and_trains_on_labels(digits, caplog) -> None:
    """A compressed file from before source tensors existed: no teacher, one note, labels only."""
    native, data = digits
    with pytest.warns(UserWarning, match="verify=False"):  # format 1: no probe, loaded as trusted
        old = odeify.load(DATA / "digits_linear2_v0.safetensors", verify=False)
    with caplog.at_level(logging.INFO, logger="odeify"):
        result = finetune(
            old, data, replace(DEFAULT_RECIPE, epochs=1, batch_size=16), max_batches=1, progress=False
        )
    notes = [
        r.getMessage()
        for r in caplog.records
        if "source network of this model is not known" in r.getMessage()
    ]
    assert len(notes) == 1 and "layer1" in notes[0]
    assert not any(r.getMessage().startswith("distilling") for r in caplog.records)
    assert result.history[-1].train_loss is not None


# -- files -----------------------------------------------------------------------------------------
def test_fold_records_and_sources_survive_save_and_load(digits, tmp_path: Path) -> None:
    native, data = digits
    small = odeify.retarget(native, knots=2, basis="linear", backward="reverse")
    with torch.no_grad():  # records as fine-tuning leaves them: not what a rebuild computes
        for record in fold_records(small.layer1_ode).values():
            record.gamma.mul_(1.5)
    odeify.save(small, tmp_path / "m.safetensors")
    loaded = odeify.load(tmp_path / "m.safetensors")
    saved, back = small.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys()
    assert any(".folds." in k for k in saved) and any(SOURCE_PREFIX in k for k in saved)
    for key in saved:
        assert torch.equal(saved[key], back[key]), key


def test_a_file_from_before_fold_records_loads_and_computes_the_same() -> None:
    """The logits stored with the old files were computed in float32 on another machine, whose
    kernels round differently (bit-equality held on earlier machines and failed on an AVX2 one): the
    stored logits are judged, as this run's float32 logits are, by the loaded model in float64."""
    stored = safetensors.torch.load_file(str(DATA / "digits_v0_logits.safetensors"))
    x = stored["input"]
    for name in ("native", "linear2"):
        with pytest.warns(UserWarning, match="verify=False"):  # format 1: no probe, loaded as trusted
            model = odeify.load(DATA / f"digits_{name}_v0.safetensors", verify=False)
        with torch.no_grad():
            here, exact = model(x), as_float64(model)(x.double())
        # measured on an AVX2 machine: the stored logits' relative error is 0.31x / 0.21x this run's
        # (native / linear2; its 8-ulp floor); stored logits off by 1e-4 fail by 70x: loading other
        # weights would be off by far more than rounding
        assert_as_accurate_as({name: stored[name]}, {name: here}, {name: exact}, factor=4)
        assert not SourceCoordinates(model).layers  # no records: its folded tensors train as they are


def test_compression_costs_the_native_knots_in_the_file(digits, tmp_path: Path) -> None:
    """What keeping the source costs: a compressed stage keeps its blocks' knots too."""
    native, _ = digits
    small = odeify.retarget(native, knots=2, basis="linear")
    kept = {k: v for k, v in small.state_dict().items() if SOURCE_PREFIX in k}
    stage = small.layer1_ode
    assert kept["layer1_ode.source_conv1_weight"].shape[0] == stage.depth == 4
    assert torch.equal(kept["layer1_ode.source_conv1_weight"], native.layer1_ode.knots.conv1_weight)
