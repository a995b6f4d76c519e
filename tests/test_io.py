"""Saving and loading converted models: exact round trips, atomic writes, clear errors."""

from __future__ import annotations

import pytest
import torch

import odeify
from odeify.checkpoints import save_checkpoint
from odeify.digits import DEFAULT_MODEL_PATH, load_digits
from odeify.errors import ModelLoadError
from odeify.io import load, save


@pytest.fixture(scope="module")
def digits_ode():
    return odeify.convert(str(DEFAULT_MODEL_PATH))


def test_round_trip_keeps_manifestation_and_weights(tmp_path, digits_ode):
    compressed = odeify.retarget(digits_ode, integrator="rk4", knots=2, basis="linear", steps=3)
    with torch.no_grad():  # make the weights differ from anything a rebuild would produce by itself
        for stage in odeify.converted_stages(compressed):
            for knot in stage.knots.values():
                knot.add_(0.01 * torch.randn_like(knot))
    path = tmp_path / "digits_ode.safetensors"
    save(compressed, path)
    loaded = load(path)
    x, _ = load_digits("test")
    assert torch.equal(loaded(x[:16]), compressed(x[:16]))
    settings = [(s.num_knots, s.basis, s.integrator.name, s.steps) for s in odeify.converted_stages(loaded)]
    assert settings == [(2, "linear", "rk4", 3)] * 2


def test_custom_tableau_survives_round_trip(tmp_path, digits_ode):
    third = odeify.Tableau.create("third", [[0, 0], ["2/3", 0]], ["1/4", "3/4"], order=2)
    model = odeify.retarget(digits_ode, integrator=third, steps=2)
    save(model, tmp_path / "m.safetensors")
    loaded = load(tmp_path / "m.safetensors")
    assert all(s.integrator == third for s in odeify.converted_stages(loaded))


def test_failed_save_leaves_previous_file_intact(tmp_path, digits_ode, monkeypatch):
    path = tmp_path / "m.safetensors"
    save(digits_ode, path)
    before = path.read_bytes()

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("odeify.fileio.os.replace", broken)  # fail after the new bytes are written
    with pytest.raises(RuntimeError, match="disk full"):
        save(odeify.retarget(digits_ode, steps=2), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_loading_a_plain_checkpoint_says_to_convert_it(tmp_path):
    model = odeify.load_model(str(DEFAULT_MODEL_PATH))
    path = tmp_path / "plain.safetensors"
    save_checkpoint(model, path, arch="odeify.digits_resnet", arch_kwargs={})
    with pytest.raises(ModelLoadError, match="convert"):
        load(path)


def test_model_converted_from_a_module_needs_the_module_back(tmp_path):
    module = odeify.load_model(str(DEFAULT_MODEL_PATH))
    converted = odeify.convert(module)
    save(converted, tmp_path / "m.safetensors")
    with pytest.raises(ModelLoadError, match="model="):
        load(tmp_path / "m.safetensors")
    loaded = load(tmp_path / "m.safetensors", model=module)
    x, _ = load_digits("test")
    assert torch.equal(loaded(x[:8]), converted(x[:8]))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nope.safetensors")
