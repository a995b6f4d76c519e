"""Calls of ``nn.Identity`` between blocks: timm's switched-off layers no longer split a run.

Swin-V2-CR ends most blocks with ``norm3 = nn.Identity()`` and Next-ViT's blocks open with an
identity patch embedding; such a call between two blocks is no layout glue, so before, no two blocks
chained and every block was a stage of its own. ``trace`` now erases the calls (their users read
their input). Oracle: the eager model in float64, exact at native depth.
"""

from __future__ import annotations

import pytest
import torch
from precision import rel
from torch import nn

import odeify
from odeify.compiler.conversion import converted_stages
from odeify.models._testing import make_test_model
from odeify.passes.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")

NATIVE_TOLERANCE = 1e-13  # float64 against the eager model; measured 0
SWIN_V2_CR = {
    "img_size": 64,
    "window_size": 4,
    "depths": (1, 1, 4, 1),
    "embed_dim": 32,
    "num_heads": (1, 2, 4, 8),
}


class _Separated(nn.Module):
    """Residual blocks, each followed by an optional layer that is switched off (``nn.Identity``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.after = nn.ModuleList(nn.Identity() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, after in zip(self.blocks, self.after, strict=True):
            x = after(x + torch.tanh(block(x)))
        return x


def test_identity_calls_are_erased_and_the_blocks_chain() -> None:
    model = _Separated().double().eval()
    graph = trace(model).graph_module.graph
    assert not [n for n in graph.nodes if n.op == "call_module" and n.target.startswith("after")]
    converted = odeify.convert(model, input_size=(2, 8))
    assert [stage.depth for stage in converted_stages(converted)] == [3]
    x = torch.randn(2, 8, dtype=torch.float64)
    with torch.no_grad():
        assert rel(converted(x), model(x)) <= NATIVE_TOLERANCE


def test_swin_v2_cr_stage_is_deep() -> None:
    model = make_test_model("swinv2_cr_tiny_224", dtype=torch.float64, **SWIN_V2_CR)
    converted = odeify.convert(model, input_size=(1, 3, 64, 64))
    assert max(stage.depth for stage in converted_stages(converted)) == 4
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        assert rel(converted(x), model(x)) <= NATIVE_TOLERANCE
