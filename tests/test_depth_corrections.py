"""Per-depth knot corrections: what a stage reads at a corrected depth, in every backward mode, what
training there changes, and what save and load keep.

The oracles: a copy of the model whose knots hold the corrected values themselves (the same
additions in the same order, so equal to the bit), and the model before the correction (native
depth must not move).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import odeify
from odeify.core.errors import ConfigError, ModelLoadError
from odeify.models import DEFAULT_MODEL_PATH

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = [
    ("euler", "backprop"),
    ("euler", "checkpoint"),
    ("euler", "reverse"),
    ("reversible_heun", "reversible"),
]


@pytest.fixture(scope="module")
def native() -> nn.Module:
    """The shipped digits ResNet (trained; stages of 4 and 3 blocks), converted."""
    return odeify.convert(odeify.load_model(DEFAULT_MODEL_PATH))


def _with_correction(native: nn.Module, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(the model at half depth holding a random correction there, a copy whose knots hold the
    corrected values instead)."""
    model = copy.deepcopy(native)
    odeify.set_steps(model, "x0.5")
    oracle = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    for stage, twin in zip(odeify.converted_stages(model), odeify.converted_stages(oracle), strict=True):
        delta = {
            name: 0.05 * knots.detach().abs().mean() * torch.randn(knots.shape, generator=generator)
            for name, knots in stage.knots.items()
        }
        stage.set_correction(stage.steps, delta)
        with torch.no_grad():
            for name, knots in twin.knots.items():
                knots.copy_(knots.detach() + delta[name])
    return odeify.compiler.conversion.relower(model), oracle


def _images(n: int = 8) -> torch.Tensor:
    return torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.filterwarnings("ignore::odeify.FallbackWarning")  # reverse redoes its pass exactly
@pytest.mark.parametrize(("integrator", "backward"), MODES)
def test_a_corrected_depth_reads_knots_plus_correction_and_trains_the_correction(
    native: nn.Module, integrator: str, backward: str
) -> None:
    """At the corrected depth the output and the correction's gradient are the oracle's (its knots'
    gradient), to the bit; the knots get no gradient from that depth."""
    model, oracle = _with_correction(native)
    model = odeify.retarget(model, integrator=integrator, backward=backward).train()
    oracle = odeify.retarget(oracle, integrator=integrator, backward=backward).train()
    x = _images()
    out, expected = model(x), oracle(x)
    assert torch.equal(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for stage, twin in zip(odeify.converted_stages(model), odeify.converted_stages(oracle), strict=True):
        correction = stage.correction()
        assert correction is not None
        for name, knots in stage.knots.items():
            assert knots.grad is None
            assert torch.equal(correction[name].grad, twin.knots[name].grad)


def test_native_depth_reads_the_knots_as_they_are(native: nn.Module) -> None:
    """A model holding corrections computes, at native depth, what it computed before them."""
    model, _ = _with_correction(native)
    odeify.set_steps(model, "native")
    x = _images()
    with torch.no_grad():
        assert torch.equal(model.eval()(x), native.eval()(x))
    assert "correction" not in model.code


def _saved(native: nn.Module, folder: Path) -> tuple[nn.Module, nn.Module, Path]:
    """:func:`_with_correction`'s pair, the model recorded as fitted for both depths and saved."""
    model, oracle = _with_correction(native)
    for stage in odeify.converted_stages(model):
        stage.fitted_steps = (stage.steps, stage.depth)
    path = folder / "any.safetensors"
    odeify.save(model.eval(), path)
    return model, oracle, path


def test_save_and_load_keep_the_corrections(native: nn.Module, tmp_path: Path) -> None:
    """save -> load gives the corrections back, read at their depth; the recipe lists them."""
    model, oracle, path = _saved(native, tmp_path)
    back = odeify.load(path)
    x = _images()
    with torch.no_grad():
        assert torch.equal(back(x), oracle.eval()(x))
        odeify.set_steps(back, "native")
        assert torch.equal(back(x), native.eval()(x))
    assert [s.corrected_steps for s in odeify.converted_stages(back)] == [
        (s.steps,) for s in odeify.converted_stages(model)
    ]


def test_a_recipe_naming_a_correction_the_file_lacks_is_refused(native: nn.Module, tmp_path: Path) -> None:
    """A recipe that names a correction the file holds no tensors for is refused, naming them."""
    _, _, path = _saved(native, tmp_path)
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if ".corrections." not in k}
    broken = tmp_path / "broken.safetensors"
    save_file(tensors, str(broken), metadata=meta)
    with pytest.raises(ModelLoadError, match="missing .*corrections"):
        odeify.load(broken)


def test_a_recipe_naming_a_correction_for_an_unfitted_depth_is_refused(
    native: nn.Module, tmp_path: Path
) -> None:
    """corrected_steps must be among the stage's fitted_steps: a correction is fitted for its depth."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from odeify.serialization.io import RECIPE_KEY

    _, _, path = _saved(native, tmp_path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    recipe = json.loads(meta[RECIPE_KEY])
    for stage in recipe["stages"]:
        stage["fitted_steps"] = [stage["knots"]]  # native alone: not the corrected half depth
    altered = tmp_path / "altered.safetensors"
    save_file(tensors, str(altered), metadata={**meta, RECIPE_KEY: json.dumps(recipe)})
    with pytest.raises(ModelLoadError, match="corrected_steps must be among its fitted_steps"):
        odeify.load(altered)


def test_native_depth_takes_no_correction(native: nn.Module) -> None:
    """Native depth reads the knots themselves: a correction there is refused."""
    stage = odeify.converted_stages(copy.deepcopy(native))[0]
    with pytest.raises(ConfigError, match="native depth"):
        stage.set_correction(stage.depth, {n: torch.zeros_like(k) for n, k in stage.knots.items()})


def _knots(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{s.stage_name}.{n}": k.detach().clone()
        for s in odeify.converted_stages(model)
        for n, k in s.knots.items()
    }


def test_fine_tuning_for_coarse_depths_trains_their_corrections_and_leaves_native(native: nn.Module) -> None:
    """Issue 57: a run for x0.5 and x0.25 gives each stage a correction at each of their step counts and
    trains those alone: the knots come back as they were up to the rounding of the fine-tuning's
    source coordinates (each step writes the folded knots from the unfolded weights again: a few
    float32 roundings, 4 eps of each tensor's largest value), where a run that lists native moves
    them far past that."""
    from dataclasses import replace

    from odeify.train.datasets import open_data
    from odeify.train.finetune import DEFAULT_RECIPE, finetune

    data = open_data("digits", native)
    recipe = replace(DEFAULT_RECIPE, epochs=1, batch_size=16)
    eps = torch.finfo(torch.float32).eps
    moved = {}
    for depths in ("x0.5,x0.25", "native,x0.5"):
        model = odeify.retarget(native, backward="checkpoint")
        before = _knots(model)
        trained = finetune(
            model, data, replace(recipe, depths=depths), max_batches=3, progress=False, calibrate_first=False
        ).model
        after = _knots(trained)
        moved[depths] = max(
            float((after[k] - b).abs().max() / (eps * b.abs().max())) for k, b in before.items()
        )
        if depths == "x0.5,x0.25":
            for stage in odeify.converted_stages(trained):
                wanted = {round(stage.depth / 2), max(1, round(stage.depth / 4))}
                assert stage.corrected_steps == tuple(sorted(wanted))
                assert any(
                    bool(p.abs().max() > 0) for c in stage.corrections.values() for p in c.parameters()
                )
    assert moved["x0.5,x0.25"] <= 4.0 < moved["native,x0.5"], moved  # measured: 0.7 eps, and 1e5 eps


def test_inspect_marks_the_corrected_steps(native: nn.Module) -> None:
    """The report's "fitted for steps" column stars the step counts a stage reads a correction at."""
    from odeify.inspection.report import describe, format_report_table

    model, _ = _with_correction(native)
    for stage in odeify.converted_stages(model):
        stage.fitted_steps = (stage.steps, stage.depth)
    table = format_report_table(describe(model))
    column = [str(c) for c in table.columns[-1]._cells]
    assert column == [f"{round(s.depth / 2)}*, {s.depth}" for s in odeify.converted_stages(model)]
    assert "correction of its own" in str(table.caption)


def test_an_any_depth_file_fine_tuned_for_its_depths_saves_and_loads(
    native: nn.Module, tmp_path: Path
) -> None:
    """A calibrated any-depth file, loaded and fine-tuned with --depths, writes files that load (its
    corrections stand for no source tensor: none is recorded for them), corrections and all."""
    from dataclasses import replace

    from odeify.train.calibration import calibrate
    from odeify.train.datasets import open_data
    from odeify.train.finetune import DEFAULT_RECIPE, finetune

    data = open_data("digits", native)
    model = odeify.retarget(native, backward="checkpoint")
    fitted, _ = calibrate(
        model, data.train.tensors[0][:32], steps=["native", "x0.5"], iterations=2, progress=False
    )
    odeify.save(fitted, tmp_path / "any.safetensors")
    recipe = replace(DEFAULT_RECIPE, epochs=1, batch_size=16, depths="native,x0.5")
    loaded = odeify.load(tmp_path / "any.safetensors")
    finetune(loaded, data, recipe, max_batches=2, progress=False, out=tmp_path / "run")
    back = odeify.load(tmp_path / "run" / "best.safetensors")
    assert [s.corrected_steps for s in odeify.converted_stages(back)] == [(2,), (2,)]
