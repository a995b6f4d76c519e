"""channels_last (timm's ``train.py --channels-last``): model and input, in every backward mode.

``model.to(memory_format=torch.channels_last)`` converts 4-D tensors; a stage's conv knots are 5-D
stacks (knot, out, in, kh, kw), converted so that each knot, as the step graphs read it, has a
channels_last conv weight's layout. Gradients equal the contiguous model's to round-off.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.fx as fx

import odeify
from odeify.models.digits import DEFAULT_MODEL_PATH
from odeify.models.loading import load_model
from odeify.passes.segments import checkpoint_segments

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {  # case: (backward mode, integrator)
    "backprop": ("backprop", "euler"),
    "checkpoint": ("checkpoint", "euler"),
    "reverse": ("reverse", "euler"),
    "reversible": ("reversible", "reversible_heun"),
    "reversible-alf": ("reversible", "alf"),
}
TOL = 1e-12
"""fp64; channels_last convs sum in another order: measured 8.5e-16 (Euler), 2.2e-14 (reversible,
whose lattice rounding of the states can round the other way; ALF 2.0e-14)."""


@pytest.fixture(scope="module")
def converted() -> dict[str, fx.GraphModule]:
    model = load_model(DEFAULT_MODEL_PATH).double()
    return {integrator: odeify.convert(model, integrator=integrator) for _, integrator in CASES.values()}


def gradients(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "odeify: stage", RuntimeWarning)  # reverse falls back here
        model(x).pow(2).sum().backward()
    return {"x": x.grad, **{name: p.grad for name, p in model.named_parameters()}}


@pytest.mark.parametrize("case", list(CASES))
def test_channels_last_model_and_input_train_like_contiguous(converted, case: str) -> None:
    mode, integrator = CASES[case]
    gm = copy.deepcopy(converted[integrator])
    if mode != "backprop":
        checkpoint_segments(odeify.set_backward(gm, mode))
    x = torch.randn(3, 1, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = gradients(gm, x)

    gm.to(memory_format=torch.channels_last)
    for stage in odeify.converted_stages(gm):
        for knots in stage.knot_tensors():
            if knots.dim() == 5:
                assert all(k.is_contiguous(memory_format=torch.channels_last) for k in knots)
    got = gradients(gm, x.to(memory_format=torch.channels_last))
    assert got.keys() == want.keys()
    for name in want:
        assert float((got[name] - want[name]).norm() / want[name].norm()) <= TOL, name
