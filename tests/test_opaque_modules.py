"""Runs whose blocks call a module fx keeps whole: ConViT's GPSA, Sequencer's nn.LSTM.

Such a module holds its block's weights, but they are no ``get_attr`` nodes, so before no run of
them became a stage (ConViT: 4 of 24 halves in stages; Sequencer2D and LowFormer: zero stages). The
template now calls one weightless copy through ``functional_call`` with the weights at each stage
time, each tensor a knot stack of the blocks' own. Oracles: the eager timm model in float64 (exact
at native depth), backprop's gradients for checkpoint mode, and the model load rebuilds.
"""

from __future__ import annotations

import pytest
import torch
from precision import rel

import odeify
from odeify.compiler.conversion import converted_stages
from odeify.models._testing import make_test_model

pytestmark = pytest.mark.usefixtures("one_thread")

NATIVE_TOLERANCE = 1e-13  # float64 against eager timm; measured 0
GRADIENT_TOLERANCE = 1e-10  # float64, checkpoint against backprop; measured 0
TWINS = {
    "depths": (1, 1, 6, 1),
    "embed_dims": (16, 32, 64, 128),
    "num_heads": (1, 2, 4, 8),
    "wss": (2, 2, 2, 2),
}
MODELS = {
    "convit": ("convit_tiny", {"img_size": 32, "patch_size": 8, "depth": 4, "embed_dim": 48, "num_heads": 4}),
    "sequencer": ("sequencer2d_s", {"layers": (2, 1, 1, 1), "img_size": 32}),
    "twins": ("twins_svt_small", {"img_size": 64, **TWINS}),  # its attention also takes (H, W): numbers
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request) -> tuple:
    name, kwargs = MODELS[request.param]
    model = make_test_model(name, dtype=torch.float64, **kwargs)
    size = kwargs["img_size"]
    return model, odeify.convert(model, input_size=(2, 3, size, size))


def _image(model: torch.nn.Module) -> torch.Tensor:
    size = model.meta["odeify"]["input_shape"][-1]
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_a_run_of_opaque_modules_is_a_deep_exact_stage(pair) -> None:
    model, converted = pair
    assert max(stage.depth for stage in converted_stages(converted)) >= 2
    assert converted.meta["odeify"]["not_lifted"] == {}
    x = _image(converted)
    with torch.no_grad():
        assert rel(converted(x), model(x)) <= NATIVE_TOLERANCE


def test_the_knots_are_the_only_copy_of_the_weights(pair) -> None:
    """The template's module is a shell: no parameter, nothing in the state dict but the knots."""
    _, converted = pair
    for stage in converted_stages(converted):
        templates = getattr(stage, "field_templates", [stage.template])
        assert all(not any(True for _ in t.parameters()) and not t.state_dict() for t in templates)


def test_checkpoint_gradients_reach_the_knots(pair) -> None:
    _, converted = pair
    grads = []
    for mode in ("checkpoint", "backprop"):
        trained = odeify.retarget(converted, backward=mode)
        x = _image(converted).requires_grad_()
        trained(x).square().sum().backward()
        grads.append([x.grad, *(p.grad for p in trained.parameters() if p.requires_grad)])
    assert all(g is not None for g in grads[0])
    for got, want in zip(*grads, strict=True):
        assert rel(got, want) <= GRADIENT_TOLERANCE


def test_save_and_load_rebuild_the_stage(pair, tmp_path) -> None:
    """Rebuilt by name where the file may name the architecture (the small Twins's window sizes are
    no kwarg a file may carry: it is given the model)."""
    model, converted = pair
    path = tmp_path / "model.safetensors"
    odeify.save(converted, path)
    given = {} if converted.meta["odeify"]["arch"] else {"model": model}
    x = _image(converted)
    with torch.no_grad():
        assert torch.equal(odeify.load(path, **given)(x), converted(x))


class _Cached(torch.nn.Module):
    """EfficientViT's pattern: in eval mode, a value computed from its weights is cached on first use."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "scale" not in self.cache:
            self.cache["scale"] = self.scale.exp()
        return torch.tanh(x * self.cache["scale"])


class _CachedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _Cached()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def test_a_module_with_state_beyond_its_tensors_keeps_its_run_discrete() -> None:
    """One copy given each block's tensors would reuse the first block's cache: checked, refused."""
    model = torch.nn.Sequential(_CachedBlock(), _CachedBlock()).double().eval()
    x = torch.randn(2, 8, dtype=torch.float64)
    with torch.no_grad():
        model(x)  # the source's caches filled, as a model run before conversion has them
    with pytest.warns(odeify.NotLiftedWarning):
        converted = odeify.convert(model, input_size=(2, 8), leaf_modules=[_Cached])
    assert not converted_stages(converted)
    assert "cache" in next(iter(converted.meta["odeify"]["not_lifted"].values()))
    with torch.no_grad():
        assert rel(converted(x), model(x)) <= NATIVE_TOLERANCE
