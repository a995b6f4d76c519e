"""The generic check for transformation passes: every ``passes/*.py`` module that declares
``PRESERVES_COMPUTATION = True`` must leave the model's output unchanged (fp64, rtol 1e-10).

Each such pass registers here how to apply it to a traced copy of a model; a pass that declares
the flag but is missing from the registry fails ``test_every_declaring_pass_is_registered``.
"""

from __future__ import annotations

import copy
import importlib
import pkgutil
from collections.abc import Callable, Iterator

import odeify.passes as passes
import pytest
import torch
import torch.fx as fx
from odeify.passes.fold_bn import FoldedNorm, fold_batchnorm
from odeify.passes.lower import lower_stages, raise_stages, stage_nodes
from torch import nn

import odeify
from odeify.tracing import annotate_shapes, trace

SHAPE = (2, 3, 48, 48)  # small, yet every stage keeps a spatial extent above 1x1
MODELS: dict[str, tuple[str, dict]] = {
    "resnet18": ("resnet18", {}),
    "resnetv2_50": ("resnetv2_50", {}),
    "nf_resnet50": ("nf_resnet50", {}),
    # the analysis gives layer1.0 a DropPath(0.) so that layer1 is one run of 2 (lift sees variants)
    "resnet18+drop_path": ("resnet18", {"drop_path_rate": 0.1}),
}
RTOL = 1e-10

Applied = Iterator[tuple[str, nn.Module]]
"""What a registered callable yields: (form, transformed module) pairs to compare with eager."""
Apply = Callable[[nn.Module, dict], Applied]
"""A registered callable: (eval-mode fp64 model, per-model cache of shared intermediate results)."""


def _apply_fold_bn(model: nn.Module, cache: dict) -> Applied:
    gm = trace(copy.deepcopy(model))
    annotate_shapes(gm, SHAPE)
    norms = sum(1 for m in gm.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    folded = fold_batchnorm(gm)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in folded.modules())
    assert sum(1 for m in folded.modules() if isinstance(m, FoldedNorm)) == norms  # 0 for NF-ResNet
    yield "folded", folded


def _converted(model: nn.Module, cache: dict) -> fx.GraphModule:
    """``odeify.convert`` with its defaults (Euler, native steps and knots), computed once: do not mutate."""
    if "converted" not in cache:
        cache["converted"] = odeify.convert(model, input_size=SHAPE)  # converts a copy
    return cache["converted"]


def _apply_lift(model: nn.Module, cache: dict) -> Applied:
    converted = _converted(model, cache)
    assert not converted.meta["odeify"]["not_lifted"]
    assert odeify.converted_stages(converted)
    yield "converted", converted


def _apply_lower(model: nn.Module, cache: dict) -> Applied:
    raised = raise_stages(copy.deepcopy(_converted(model, cache)))
    assert stage_nodes(raised)  # one call per stage, run through ODEStage.forward
    yield "raised", raised
    lowered = lower_stages(copy.deepcopy(raised))
    assert not stage_nodes(lowered)  # backprop stages are inlined again
    yield "lowered", lowered


REGISTRY: dict[str, Apply] = {
    "odeify.passes.fold_bn": _apply_fold_bn,
    "odeify.passes.lift": _apply_lift,
    "odeify.passes.lower": _apply_lower,
}
"""Pass module -> how to apply it to a copy of an eval-mode fp64 model."""


@pytest.fixture(scope="module")
def shared() -> dict[str, dict]:
    """Per-model caches: the model, its eager output, and what registered callables share."""
    return {}


def _declaring_modules() -> list[str]:
    """The modules under passes/ that declare ``PRESERVES_COMPUTATION = True``."""
    found = []
    for info in pkgutil.iter_modules(passes.__path__, prefix="odeify.passes."):
        module = importlib.import_module(info.name)
        if getattr(module, "PRESERVES_COMPUTATION", False) is True:
            found.append(info.name)
    return found


def test_every_declaring_pass_is_registered() -> None:
    declaring = set(_declaring_modules())
    assert {"odeify.passes.fold_bn", "odeify.passes.lift", "odeify.passes.lower"} <= declaring
    missing = sorted(declaring - set(REGISTRY))
    assert not missing, f"passes declaring PRESERVES_COMPUTATION with no entry in REGISTRY: {missing}"
    stale = sorted(set(REGISTRY) - declaring)
    assert not stale, f"REGISTRY entries whose module no longer declares PRESERVES_COMPUTATION: {stale}"


@pytest.mark.parametrize("model_key", list(MODELS))
@pytest.mark.parametrize("pass_module", sorted(REGISTRY))
def test_pass_preserves_computation(pass_module: str, model_key: str, test_model, image, shared) -> None:
    x = image(SHAPE, dtype=torch.float64)
    cache = shared.setdefault(model_key, {})
    if "model" not in cache:  # passes work on copies, so one model and one eager output per name
        name, kwargs = MODELS[model_key]
        cache["model"] = test_model(name, dtype=torch.float64, **kwargs)
        with torch.no_grad():
            cache["expected"] = cache["model"](x)
    model, expected = cache["model"], cache["expected"]
    with torch.no_grad():
        atol = RTOL * expected.abs().max().item()
        forms = 0
        for form, transformed in REGISTRY[pass_module](model, cache):
            transformed.eval()
            torch.testing.assert_close(
                transformed(x), expected, rtol=RTOL, atol=atol, msg=lambda m, f=form: f"{f}: {m}"
            )
            forms += 1
    assert forms
