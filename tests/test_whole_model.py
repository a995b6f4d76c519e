"""Whole-model memory plan: the parts between stages are recomputed, the stages use their mode.

Every backward mode, on a whole converted timm ResNet (random non-zero branches, randomised BN
statistics) with its segments checkpointed (``odeify.passes.segments``), gives the gradients of
every parameter that backprop through the same manifestation gives: to round-off in fp64, with
DropPath drawing in train mode (the recomputed segments and the re-run stages replay the
forward's masks), and to bf16 accuracy under autocast. And what a reversible model keeps for
backward does not grow with the number of steps.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.fx as fx
from precision import assert_as_accurate_as
from timm.layers import DropPath
from torch import nn

import odeify
from odeify.core.errors import ConfigError
from odeify.passes.segments import Segment, checkpoint_segments, has_segments, inline_segments

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = (2, 3, 32, 32)
CASES = {  # case: (backward mode, integrator)
    "checkpoint": ("checkpoint", "euler"),
    "reverse": ("reverse", "euler"),
    "reversible": ("reversible", "reversible_heun"),
    "reversible-alf": ("reversible", "alf"),
}
MEMORY_FREE = list(CASES)
FP64_TOL = {"checkpoint": 1e-13, "reverse": 1e-13, "reversible": 1e-12, "reversible-alf": 1e-12}
"""Measured: checkpoint and reverse (which falls back to checkpointing at native Euler steps, where a
ReLU network cannot be stepped backward) 0.0; reversible Heun 3.4e-13, ALF 4.6e-13 (the lattice is
2^-44 coarse in fp64)."""
BF16_FACTOR = {"checkpoint": 1.5, "reverse": 1.5, "reversible": 3.0, "reversible-alf": 3.0}
"""Under bf16 autocast every parameter's gradient is judged by its distance from float64 backprop,
which may be this multiple of bf16 backprop's own. Checkpoint and reverse recompute the same bf16
operations (measured on AMD EPYC: 1.00x); the reversible schemes' states are the lattice's, not the
unrolled graph's, so bf16 roundings of the fields' inputs differ (measured: reversible Heun at most
1.79x, on layer4's conv2 knots, ALF 1.69x; bf16 backprop is 4e-2..2e-1 from float64 on this
random-weight model)."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def converted(test_model) -> dict[str, fx.GraphModule]:
    """resnet18 with stochastic depth, converted once per integrator (Euler, reversible Heun).

    Every nonzero drop rate is raised to 0.5 so that two seeds draw different masks; the first block
    of layers 2-4 (a segment) and the stages' blocks all have one.
    """
    model = test_model("resnet18", dtype=torch.float64, drop_path_rate=0.2)
    for module in model.modules():
        if isinstance(module, DropPath) and module.drop_prob > 0:
            module.drop_prob = 0.5
    return {
        integrator: odeify.convert(model, integrator=integrator, input_size=(1, *SHAPE[1:]))
        for integrator in {integrator for _, integrator in CASES.values()}
    }


def manifest(
    converted: dict, case: str, dtype: torch.dtype = torch.float64, backprop: bool = False
) -> fx.GraphModule:
    """A copy of the converted model for ``case``'s integrator, trained with its mode or ``backprop``.

    Memory-free modes get checkpointed segments too.
    """
    mode, integrator = CASES[case]
    gm = copy.deepcopy(converted[integrator]).to(dtype)
    if not backprop:
        odeify.set_backward(gm, mode)
        checkpoint_segments(gm)
        assert has_segments(gm)
    return gm


def grads_of(model: nn.Module, x: torch.Tensor, cotangent: torch.Tensor, seed: int = 0) -> dict:
    """d<model(x), cotangent>/d(x, every parameter), after seeding the global RNG."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    (model(x) * cotangent).sum().backward()
    return {"x": x.grad, **{name: p.grad for name, p in model.named_parameters()}}


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=g, dtype=dtype), torch.randn(SHAPE[0], 1000, generator=g, dtype=dtype)


def assert_grads_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()  # the same parameter names: segments own no parameters
    assert all(g is not None for g in got.values())
    errors = {name: rel(got[name], want[name]) for name in want}
    assert max(errors.values()) <= tol, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("mode", MEMORY_FREE)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-droppath"])
def test_whole_model_gradients_match_backprop(converted, mode: str, train: bool) -> None:
    """fp64: every parameter's gradient; in train mode DropPath draws, and recompute replays it."""
    x, cot = inputs(torch.float64)
    backprop = manifest(converted, mode, backprop=True).train(train)
    memory_free = manifest(converted, mode).train(train)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "odeify: stage", RuntimeWarning)  # reverse falls back here
        want = grads_of(backprop, x, cot)
        after_want = torch.rand(3)
        got = grads_of(memory_free, x, cot)
        after_got = torch.rand(3)
        other = grads_of(memory_free, x, cot, seed=7)
    assert_grads_close(got, want, FP64_TOL[mode])
    assert torch.equal(after_got, after_want)  # the global RNG stream continues as after backprop
    if train:
        assert rel(other["x"], want["x"]) > 1e-3  # other masks, other gradients: the test can fail
    if mode == "reverse":
        assert all(s.adjoint_stats.fallbacks for s in odeify.converted_stages(memory_free) if s.steps > 1)


@pytest.mark.parametrize("mode", MEMORY_FREE)
def test_whole_model_gradients_under_bf16_autocast(converted, mode: str) -> None:
    """Re-runs and recomputes see the forward's autocast: gradients to bf16 accuracy."""
    x, cot = inputs(torch.float32)

    def grads(model: nn.Module) -> dict:
        with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
            warnings.filterwarnings("ignore", "odeify: stage", RuntimeWarning)
            return grads_of(model, x, cot)

    backprop = manifest(converted, mode, torch.float32, backprop=True)
    want = grads(backprop)
    exact = grads_of(manifest(converted, mode, backprop=True), x.double(), cot.double())
    assert max(rel(want[name], exact[name]) for name in exact) > 1e-3  # bf16 does differ
    got = grads(manifest(converted, mode, torch.float32))
    assert_as_accurate_as(got, want, exact, BF16_FACTOR[mode])


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes saved for backward by one training step: once per storage, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x.requires_grad_(False))
    y.sum().backward()
    return sum(seen.values())


def test_reversible_whole_model_memory_is_flat_in_steps(converted) -> None:
    """What a reversible model keeps does not grow with its steps (2x to 8x), and is a fraction of
    backprop's.

    Kept: the input, every segment's input (the stage outputs), each stage's 1.25 extra states: for
    ALF (its output's int8 residual and p = h/2 v as int32 counts) no more than for reversible Heun.
    A stage of one block keeps its input instead, which costs less (this model's layer2 to layer4:
    155,664 bytes at native, 2x and 8x; 162,880 at 2x and 8x when they kept packed registers).
    (ALF's backprop keeps half of reversible Heun's, one evaluation per step: hence its larger ratio.)
    """
    x, _ = inputs(torch.float32)
    sizes = {}
    for case in ("reversible", "reversible-alf"):
        native = manifest(converted, case, torch.float32)
        double, deep = (odeify.retarget(native, steps=f"x{k}") for k in (2, 8))  # the whole-model plan kept
        assert has_segments(deep)
        assert [s.steps for s in odeify.converted_stages(deep)] == [
            8 * s.steps for s in odeify.converted_stages(native)
        ]
        sizes[case] = [saved_bytes(native, x), saved_bytes(double, x), saved_bytes(deep, x)]
        assert sizes[case][2] <= sizes[case][1], sizes
        assert sizes[case][0] <= sizes[case][1], sizes
        backprop = saved_bytes(manifest(converted, case, torch.float32, backprop=True), x)
        limit = {"reversible": 4, "reversible-alf": 3}[case]  # measured: 1 / 5.2 (Heun), 1 / 3.6 (ALF)
        assert sizes[case][0] < backprop / limit, (sizes, backprop)
    assert sizes["reversible-alf"] <= sizes["reversible"], sizes


def test_segments_keep_names_state_dict_and_inline_exactly(converted) -> None:
    gm = inline_segments(odeify.set_backward(copy.deepcopy(converted["euler"]), "checkpoint")).graph_module
    graph, code, keys = str(gm.graph), gm.code, list(gm.state_dict())
    segmented = checkpoint_segments(copy.deepcopy(gm)).graph_module
    segments = [m for m in segmented.modules() if isinstance(m, Segment)]
    assert len(segments) == 5  # stem + layer1.0, layer2.0, layer3.0, layer4.0, head
    assert list(segmented.state_dict()) == keys and not any(list(s.parameters()) for s in segments)
    again = checkpoint_segments(segmented)
    assert again.graph_module is segmented and not again.modified
    assert len(list(segmented.modules())) == len(list(checkpoint_segments(segmented).graph_module.modules()))
    for copied in (copy.deepcopy(segmented), pickle.loads(pickle.dumps(segmented))):
        x, _ = inputs(torch.float64)
        torch.testing.assert_close(copied(x), gm(x), rtol=0, atol=0)
    inline_segments(segmented)
    assert not has_segments(segmented)
    assert (str(segmented.graph), segmented.code, list(segmented.state_dict())) == (graph, code, keys)
    assert [n.meta for n in segmented.graph.nodes] == [n.meta for n in gm.graph.nodes]


def test_retarget_and_set_backward_see_through_segments(converted) -> None:
    """``raise_stages`` inlines segments first, so a segmented model retargets like any other."""
    segmented = manifest(converted, "checkpoint")
    x, _ = inputs(torch.float64)
    retargeted = odeify.retarget(segmented, steps="x2", backward="backprop")
    assert not has_segments(retargeted)
    reference = odeify.retarget(converted["euler"], steps="x2")
    with torch.no_grad():
        torch.testing.assert_close(retargeted(x), reference(x), rtol=1e-12, atol=0)


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x)).relu().mean((2, 3))


def test_train_mode_batchnorm_in_a_segment_is_refused() -> None:
    """Recomputing a train-mode BatchNorm would update its running statistics twice: refuse it."""
    gm = checkpoint_segments(fx.symbolic_trace(_Head())).graph_module
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(ConfigError, match=r"BatchNorm 'norm' is in training mode.*\.eval\(\)"):
        gm(x)
    with torch.no_grad():
        gm(x)  # nothing is recomputed without grad
    gm.eval()
    before = copy.deepcopy(gm.norm.state_dict())
    gm(x).sum().backward()
    assert gm.conv.weight.grad is not None
    assert all(torch.equal(v, before[k]) for k, v in gm.norm.state_dict().items())


def test_a_model_without_stages_is_one_segment_with_eager_gradients() -> None:
    model = _Head().double().eval()
    gm = checkpoint_segments(fx.symbolic_trace(copy.deepcopy(model))).graph_module
    assert sum(isinstance(m, Segment) for m in gm.modules()) == 1
    x, cot = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.ones(2, 4, dtype=torch.float64)
    assert_grads_close(grads_of(gm, x, cot), grads_of(model, x, cot), 1e-13)  # recomputed: measured 0.0
