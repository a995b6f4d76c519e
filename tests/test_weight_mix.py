"""The dense weight-mix path against an oracle that shares none of its code.

Rows of the weight path with more than ``DENSE_MIX_ABOVE`` nonzero coefficients (a cubic spline
off the knots) are mixed in the emitted graph by one ``tensordot`` over the knot stack. The
oracle rebuilds theta(t) without odeify: torch's own ``fuse_conv_bn_eval`` folds each original
timm block, scipy's natural ``CubicSpline`` interpolates the folded weights through the knots
k/L, and the eager timm block with those weights gives F(t, x) = L * (block(x) - x).
"""

from __future__ import annotations

import copy
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy.interpolate import CubicSpline
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

import odeify
from odeify.codegen.emit import DENSE_MIX_ABOVE
from odeify.models._testing import make_test_model

pytestmark = pytest.mark.usefixtures("one_thread")

CONVS = (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3"))


def folded(block: nn.Module) -> nn.Module:
    """A copy of a timm Bottleneck with each BatchNorm folded into its conv by torch."""
    block = copy.deepcopy(block).eval()
    for conv, norm in CONVS:
        setattr(block, conv, fuse_conv_bn_eval(getattr(block, conv), getattr(block, norm)))
        setattr(block, norm, nn.Identity())
    return block


@pytest.mark.parametrize("t", [Fraction(3, 10), Fraction(7, 11)])
def test_cubic_field_matches_eager_block_with_scipy_spline_weights(t: Fraction) -> None:
    model = make_test_model("resnet50", dtype=torch.float64)
    converted = odeify.convert(model, input_size=(1, 3, 64, 64), basis="cubic")
    stage = next(s for s in odeify.converted_stages(converted) if s.stage_name == "layer3").standalone()
    blocks = [folded(b) for b in model.layer3[1:]]  # block 0 changes the shape: not in the run
    depth = len(blocks)
    assert stage.depth == depth == 5
    assert sum(1 for c in stage.row(t, False) if c != 0) > DENSE_MIX_ABOVE  # the dense path runs

    oracle = copy.deepcopy(blocks[0])
    knots_t = np.arange(depth) / depth
    with torch.no_grad():
        for conv, _ in CONVS:
            for name in ("weight", "bias"):
                values = np.stack([getattr(getattr(b, conv), name).numpy() for b in blocks])
                spline = CubicSpline(knots_t, values, axis=0, bc_type="natural")
                getattr(getattr(oracle, conv), name).copy_(torch.from_numpy(spline(float(t))))
    x = torch.randn(2, 1024, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).relu()
    with torch.no_grad():
        expected = depth * (oracle(x) - x)
        got = stage.field(t, x)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    assert error <= 1e-14, error  # measured 1.4e-15
