"""``torch.compile`` of a converted model trains in every backward mode with eager's gradients.

A memory-free stage is a deliberate graph break (its autograd Function runs eagerly); the parts
between stages, checkpointed segments, compile, and their recompute runs compiled in backward.
The default run compiles with ``aot_eager`` (dynamo and AOT autograd, no code generation: seconds);
the ``slow`` ones with inductor, which once failed on the reversible lattice's integer arithmetic
and takes minutes to compile on a small CPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.fx as fx
from precision import assert_as_accurate_as
from torch._dynamo.backends.registry import lookup_backend

import odeify
from odeify.core.dtypes import model_dtype
from odeify.models.digits import DEFAULT_MODEL_PATH
from odeify.models.loading import load_model
from odeify.passes.segments import Segment, checkpoint_segments

pytestmark = pytest.mark.usefixtures("one_thread")

INTEGRATOR = {"backprop": "euler", "checkpoint": "euler", "reverse": "euler", "reversible": "reversible_heun"}
SCHEMES = ["reversible_heun", "alf"]
FACTOR = {"aot_eager": 2.0, "inductor": 4.0}
"""Compiled float32 gradients are judged by their distance from eager float64, which may be this
multiple of eager float32's own (floored at 8 ulps). Measured on AMD EPYC: every gradient within
0.36x of that floor, aot_eager and inductor alike; inductor fuses and reorders float32 arithmetic,
so it gets the wider margin."""


def training_model(mode: str, integrator: str | None = None) -> fx.GraphModule:
    """The digits model (fp32, train mode) in ``mode``, with checkpointed segments when memory-free."""
    gm = odeify.convert(load_model(DEFAULT_MODEL_PATH), integrator=integrator or INTEGRATOR[mode]).train()
    if mode != "backprop":
        checkpoint_segments(odeify.set_backward(gm, mode))
    return gm


def train_step(run, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One forward (``run``: the model or its compiled form) and backward; input and parameter grads."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1, 32, 32, generator=g).to(model_dtype(model)).requires_grad_()
    labels = torch.randint(0, 10, (4,), generator=g)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "odeify: stage", RuntimeWarning)  # reverse falls back here
        torch.nn.functional.cross_entropy(run(x), labels).backward()
    return {"x": x.grad, **{name: p.grad for name, p in model.named_parameters()}}


def compiled_gradients(mode: str, backend, factor: float, integrator: str | None = None) -> fx.GraphModule:
    """Compile the float32 model for ``mode`` with ``backend``: its gradients are eager's, to float32
    accuracy against eager float64. Returns the eager model."""
    eager = training_model(mode, integrator)
    cold = copy.deepcopy(eager)  # no stage graph built yet, as at a user's first step
    exact_model = copy.deepcopy(eager).double()
    want, exact = train_step(eager, eager), train_step(exact_model, exact_model)
    got = train_step(torch.compile(cold, backend=backend), cold)
    assert_as_accurate_as(got, want, exact, factor)
    return eager


def _conv_count(graphs: list[fx.Graph]) -> int:
    return sum(1 for g in graphs for n in g.nodes if n.op == "call_function" and "conv" in str(n.target))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_compiled_reversible_model_trains_like_eager_and_compiles_its_segments(scheme: str) -> None:
    graphs: list[fx.GraphModule] = []

    def counting(gm: fx.GraphModule, example_inputs):
        # a checkpointed region is a subgraph module, called through tag_activation_checkpoint
        graphs.extend(m.graph for m in gm.modules() if isinstance(m, fx.GraphModule))
        return lookup_backend("aot_eager")(gm, example_inputs)

    eager = compiled_gradients("reversible", counting, FACTOR["aot_eager"], scheme)
    # every segment ran compiled, as a checkpointed region: its convs are in compiled graphs
    segments = [m for m in eager.modules() if isinstance(m, Segment)]
    regions = [
        n for g in graphs for n in g.nodes if n.target is torch.ops.higher_order.tag_activation_checkpoint
    ]
    assert len(segments) == 3 and len(regions) == len(segments)
    segment_convs = _conv_count([m.body for m in segments])
    assert segment_convs >= 4 and _conv_count(graphs) == segment_convs


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "integrator"), [*INTEGRATOR.items(), ("reversible", "alf")])
def test_inductor_compiled_model_trains_like_eager(mode: str, integrator: str) -> None:
    compiled_gradients(mode, "inductor", FACTOR["inductor"], integrator)
