"""One file, every depth: the depth switched in place, the fitted depths a file keeps, and fine-tuning
for several depths at once (issue 48).

Oracles: ``odeify.retarget`` (a copy re-emitted for the depth) against the in-place switch, bit for
bit; the source network rebuilt by conversion against ``odeify.source_network``; an independent
argmax loop against the accuracies a multi-depth run records at each depth; a second run with the
same seed, and a crash then resume, against an uninterrupted run.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from crash_after import CrashAfter
from safetensors import safe_open

import odeify
from odeify.serialization.io import RECIPE_KEY
from odeify.train.datasets import LabelledData
from odeify.train.finetune import DEFAULT_RECIPE, LAST_FILE, finetune
from odeify.train.state import SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = replace(DEFAULT_RECIPE, epochs=2, batch_size=16, depths="native,x0.5")
COMMON = {"max_batches": 3, "progress": False, "calibrate_first": False}


def euler(native: torch.nn.Module) -> torch.nn.Module:
    """The digits model with a backward that runs at any depth (ALF needs a multiple of its knots)."""
    return odeify.retarget(native, backward="checkpoint")


def steps_of(model: torch.nn.Module) -> dict[str, int]:
    return {s.stage_name: s.steps for s in odeify.converted_stages(model)}


def accuracy(model: torch.nn.Module, data: LabelledData) -> float:
    loader = torch.utils.data.DataLoader(data.val, batch_size=128)
    with torch.no_grad():
        right = sum(int((model(x).argmax(1) == y).sum()) for x, y in loader)
    return right / len(data.val)


# -- the switch ------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", ["x0.5", 1, {"layer1": 2}, "x2"])
def test_set_steps_switches_in_place_and_computes_what_retarget_does(native, image, steps) -> None:
    model = euler(native).eval()
    before = {name: p for name, p in model.named_parameters()}
    pointers = {name: p.data_ptr() for name, p in before.items()}
    x = image((2, 1, 32, 32))
    wanted = odeify.retarget(model, steps=steps)(x)
    switched = odeify.set_steps(model, steps)
    assert switched is model
    assert all(p is before[name] and p.data_ptr() == pointers[name] for name, p in model.named_parameters())
    assert torch.equal(model(x), wanted)
    assert steps_of(model) == steps_of(odeify.retarget(euler(native), steps=steps))
    assert f"steps={steps_of(model)['layer1']}" in repr(odeify.converted_stages(model)[0])


def test_set_steps_refuses_a_bad_depth_and_changes_nothing(native) -> None:
    model = euler(native)
    code = odeify.model_code(model)
    for bad in ("x0", 2.0, {"layer9": 1}):
        with pytest.raises(odeify.ConfigError):
            odeify.set_steps(model, bad)
    assert odeify.model_code(model) == code


def test_model_code_shows_the_chosen_depth(native) -> None:
    model = euler(native)
    native_code = odeify.model_code(model)
    odeify.set_steps(model, 1)
    assert odeify.model_code(model) != native_code
    odeify.set_steps(model, "native")
    assert odeify.model_code(model) == native_code


# -- the fitted depths a file keeps ----------------------------------------------------------------
def _fitted_at_half(native: torch.nn.Module, digits: LabelledData) -> torch.nn.Module:
    """The digits model calibrated at half the steps alone: its knots moved away from the blocks'."""
    half = odeify.retarget(euler(native), steps="x0.5")
    return odeify.calibrate(half, digits, images=32, iterations=3, progress=False)[0]


def test_fitted_steps_are_saved_and_loaded(native, digits, tmp_path: Path) -> None:
    model = _fitted_at_half(native, digits)
    odeify.save(model, tmp_path / "half.safetensors")
    loaded = odeify.load(tmp_path / "half.safetensors")
    assert [s.fitted_steps for s in odeify.converted_stages(loaded)] == [(2,), (2,)]
    odeify.save(euler(native), tmp_path / "plain.safetensors")  # never fitted: the key is not written
    with safe_open(str(tmp_path / "plain.safetensors"), framework="pt") as handle:
        assert "fitted_steps" not in handle.metadata()[RECIPE_KEY]
    assert [s.fitted_steps for s in odeify.converted_stages(odeify.load(tmp_path / "plain.safetensors"))] == [
        None,
        None,
    ]


def test_reading_a_file_at_a_depth_it_was_not_fitted_for_says_so(
    native, digits, image, tmp_path: Path
) -> None:
    odeify.save(_fitted_at_half(native, digits), tmp_path / "half.safetensors")
    model = odeify.load(tmp_path / "half.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        odeify.set_steps(model, "x0.5")  # fitted there: silent
    with pytest.warns(odeify.UnfittedDepthWarning, match=r"native depth.*odeify\.source_network"):
        odeify.set_steps(model, "native")
    with pytest.warns(odeify.UnfittedDepthWarning, match="'layer1' runs 4 steps, fitted for 2 steps"):
        odeify.retarget(model, steps="native")
    x = image((2, 1, 32, 32))
    source = odeify.source_network(model)
    assert torch.equal(source(x), native.eval()(x))  # the network it was converted from, given back
    assert torch.dist(model(x), native(x)) > 0  # the file at native depth is not it


def test_refitted_knots_forget_what_they_were_fitted_for(native, digits) -> None:
    model = _fitted_at_half(native, digits)
    assert [s.fitted_steps for s in odeify.converted_stages(odeify.retarget(model, knots=2))] == [None, None]
    with pytest.warns(odeify.UnfittedDepthWarning, match="'layer1' runs 1 step, fitted for 2 steps"):
        one_step = odeify.retarget(model, steps=1)
    assert [s.fitted_steps for s in odeify.converted_stages(one_step)] == [(2,), (2,)]


def test_a_hostile_fitted_steps_entry_is_refused(native, digits, tmp_path: Path) -> None:
    import json

    import safetensors.torch

    path = tmp_path / "half.safetensors"
    odeify.save(_fitted_at_half(native, digits), path)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    for bad in ([2, 1], [0], ["2"], [2, 2], list(range(1, 40))):
        recipe = json.loads(metadata[RECIPE_KEY])
        recipe["stages"][0]["fitted_steps"] = bad
        written = {**metadata, RECIPE_KEY: json.dumps(recipe)}
        path.write_bytes(safetensors.torch.save(tensors, metadata=written))
        with pytest.raises(odeify.ModelLoadError, match="fitted_steps"):
            odeify.load(path)


# -- fine-tuning for several depths ----------------------------------------------------------------
def test_depths_are_checked_where_the_recipe_is_made() -> None:
    assert replace(DEFAULT_RECIPE, depths=["native", "x0.5", 2]).depths == "native,x0.5,2"
    assert replace(DEFAULT_RECIPE, depths=" native , x0.25").depths == "native,x0.25"
    for bad in ("native", "native,x0", "native,2.5", ""):
        with pytest.raises(odeify.ConfigError, match="depth|steps"):
            replace(DEFAULT_RECIPE, depths=bad)


def test_two_depths_that_are_the_same_steps_are_merged(native, digits: LabelledData, caplog) -> None:
    """Issue 57: x0.25 and x0.2 give stages of 4 and 3 blocks one step each: the run is the one without
    x0.2 (the oracle: that run, bit for bit), and the log says so once."""
    one = replace(QUICK, epochs=1)
    with caplog.at_level("INFO", logger="odeify"):
        merged = finetune(euler(native), digits, replace(one, depths="native,x0.25,x0.2"), **COMMON)
    alone = finetune(euler(native), digits, replace(one, depths="native,x0.25"), **COMMON)
    assert list(merged.history[-1].depth_accuracy) == list(alone.history[-1].depth_accuracy)
    a, b = merged.model.state_dict(), alone.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    said = [r.getMessage() for r in caplog.records if "merged" in r.getMessage()]
    assert len(said) == 1 and "x0.25 and x0.2" in said[0], said


def test_refinement_and_depths_are_refused_together(native, digits: LabelledData) -> None:
    with pytest.raises(odeify.ConfigError, match="refine_at"):
        finetune(euler(native), digits, QUICK, refine_at=[2], **COMMON)


def test_a_run_for_several_depths_scores_each_and_keeps_the_worst(
    native, digits: LabelledData, tmp_path: Path
) -> None:
    result = finetune(euler(native), digits, QUICK, out=tmp_path, **COMMON)
    model = odeify.load(tmp_path / LAST_FILE)
    assert [s.fitted_steps for s in odeify.converted_stages(model)] == [(2, 4), (2, 3)]
    assert steps_of(model) == {"layer1": 4, "layer2": 3}  # saved at the first depth listed
    last = result.history[-1]
    assert list(last.depth_accuracy) == ["native", "x0.5"]
    assert last.val_accuracy == min(last.depth_accuracy.values())
    for depth, recorded in last.depth_accuracy.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every listed depth is one the file was fitted for
            odeify.set_steps(model, depth)
        assert accuracy(model, digits) == pytest.approx(recorded, abs=1e-12)
    header, *rows = (tmp_path / SUMMARY_FILE).read_text().splitlines()
    assert header.endswith("eval_top1_native,eval_top1_x0.5") and len(rows) == 3


def test_a_run_for_several_depths_is_deterministic_for_a_seed_and_resumes_exactly(
    native, digits: LabelledData, tmp_path: Path
) -> None:
    one = finetune(euler(native), digits, QUICK, out=tmp_path / "a", seed=3, **COMMON)
    crashing = replace(digits, train=CrashAfter(digits.train, limit=int(1.5 * 4 * QUICK.batch_size)))
    with pytest.raises(RuntimeError, match="simulated crash"):  # in epoch 2, at a drawn depth
        finetune(euler(native), crashing, QUICK, out=tmp_path / "b", seed=3, **COMMON)
    two = finetune(euler(native), digits, QUICK, out=tmp_path / "b", seed=3, resume=True, **COMMON)

    def untimed(history):
        return [{**asdict(r), "seconds": None, "peak_memory_mib": None} for r in history]

    assert untimed(one.history) == untimed(two.history)
    a, b = one.model.state_dict(), two.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = finetune(euler(native), digits, QUICK, seed=4, **COMMON)
    c = other.model.state_dict()
    assert not all(torch.equal(a[k], c[k]) for k in a)  # another seed draws other depths and batches


def test_one_depth_trains_as_before(native, digits: LabelledData) -> None:
    """Without depths a run is today's; its file records the one depth it was trained at."""
    model = odeify.retarget(euler(native), steps=1)
    result = finetune(model, digits, replace(QUICK, depths=None, epochs=1), **COMMON)
    assert result.history[-1].depth_accuracy == {}
    assert [s.fitted_steps for s in odeify.converted_stages(result.model)] == [(1,), (1,)]


def test_torch_export_records_the_depth_switched_to(native, digits, image, tmp_path: Path) -> None:
    """One file, exported at two depths without re-conversion: each export computes its depth."""
    odeify.save(odeify.calibrate(euler(native), digits, steps=["native", "x0.5"], images=32, iterations=3,
                                 progress=False)[0], tmp_path / "any.safetensors")  # fmt: skip
    model, x = odeify.load(tmp_path / "any.safetensors"), image((2, 1, 32, 32))
    for depth in ("x0.5", "native"):
        odeify.set_steps(model, depth)
        exported = torch.export.export(model, (x,))
        torch.testing.assert_close(exported.module()(x), model(x), rtol=0, atol=0)
    assert not torch.equal(odeify.set_steps(model, "x0.5")(x), odeify.set_steps(model, "native")(x))


def test_a_switch_keeps_every_module_in_the_models_mode(native) -> None:
    """Re-emitted segments were built in training mode under an eval model (torch.export then refused)."""
    model = euler(native).eval()
    for change in (
        lambda m: odeify.set_steps(m, "x0.5"),
        lambda m: odeify.set_backward(m, "checkpoint"),
        lambda m: odeify.retarget(m, steps=1),
    ):
        assert not [name for name, module in change(model).named_modules() if module.training]
    assert all(module.training for module in odeify.set_steps(model.train(), 1).modules())


def test_an_integrator_that_cannot_run_at_a_listed_depth_is_refused_naming_it(native, digits) -> None:
    alf = odeify.retarget(native, integrator="alf", backward="reversible")  # needs a multiple of its knots
    with pytest.raises(odeify.ConfigError, match=r"cannot run at depth x0\.5.*--integrator"):
        finetune(alf, digits, QUICK, **COMMON)


def test_a_file_fitted_for_several_depths_saves_loads_and_probes_at_each(
    native, digits, image, tmp_path
) -> None:
    model = odeify.calibrate(euler(native), digits, steps=["native", "x0.5", "x0.25"], images=32,
                             iterations=3, progress=False)[0]  # fmt: skip
    x = image((2, 1, 32, 32))
    for depth in ("native", "x0.5", "x0.25"):
        odeify.set_steps(model, depth)
        odeify.save(model, tmp_path / f"{depth}.safetensors")
        loaded = odeify.load(tmp_path / f"{depth}.safetensors")  # its probe runs at that depth
        assert steps_of(loaded) == steps_of(model)
        assert [s.fitted_steps for s in odeify.converted_stages(loaded)] == [(1, 2, 4), (1, 2, 3)]
        torch.testing.assert_close(loaded.eval()(x), model.eval()(x), rtol=0, atol=0)


def test_calibrating_a_fitted_file_for_other_depths_says_nothing_of_fitted_depths(native, digits) -> None:
    half = _fitted_at_half(native, digits)  # fitted for 2 steps per stage
    with warnings.catch_warnings():
        warnings.simplefilter("error", odeify.UnfittedDepthWarning)
        calibrated = odeify.calibrate(half, digits, steps=["native", "x0.5"], images=32, iterations=2,
                                      progress=False)[0]  # fmt: skip
    assert [s.fitted_steps for s in odeify.converted_stages(calibrated)] == [(2, 4), (2, 3)]


def test_a_run_for_several_depths_keeps_an_integrator_that_runs_at_each(native) -> None:
    """Given nothing else, a model as converted trains as ALF, which runs only at multiples of its knots;
    with depths listed it keeps Euler (with the memory-saving backward of its integrator)."""
    from odeify.train.manifestations import for_training

    assert {s.integrator.name for s in odeify.converted_stages(for_training(native))} == {"alf"}
    both = for_training(native, depths="native,x0.5")
    assert {(s.integrator.name, s.backward) for s in odeify.converted_stages(both)} == {
        ("euler", "checkpoint")
    }
    odeify.set_steps(both, "x0.5")  # runs there


def test_a_multi_depth_run_without_lr_peaks_at_most_at_the_depths_peak() -> None:
    """``lr=None`` resolves per model: a run for several depths takes the lower of its integrators'
    peak and DEPTHS_LR (measured in benchmarks/results/any_depth.md); a run for one depth, or a
    recipe's own lr, is unchanged."""
    from odeify.numerics.tableaus import resolve_integrator
    from odeify.train.recipe import ALF_LR, DEFAULT_LR, DEPTHS_LR, Recipe, with_lr

    euler, alf = resolve_integrator("euler"), resolve_integrator("alf")
    assert ALF_LR < DEPTHS_LR < DEFAULT_LR  # else the min below would not be tested both ways
    several = Recipe(depths="native,x0.5")
    assert with_lr(several, [euler]).lr == DEPTHS_LR
    assert with_lr(several, [alf]).lr == ALF_LR
    assert with_lr(Recipe(), [euler]).lr == DEFAULT_LR
    assert with_lr(replace(several, lr=1e-3), [euler]).lr == 1e-3
