"""The API's rules a user relies on, each against what the user would otherwise see.

- ``retarget`` returns a new module; ``set_backward`` changes the model in place, so an optimizer
  built before still trains it; ``ODEStage.configure`` on a stage inlined into a converted model
  refuses (it could not take effect), and ``stage.standalone()`` gives a copy that may be configured;
- ``convert`` never changes the caller's module and keeps its train/eval mode;
- a stage whose template changes after a forward rebuilds its graphs;
- ``odeify.model_code`` shows every stage's integrator, whatever its backward mode;
- requests that would build something enormous fail at once, with the estimate and the limit;
- bad arguments raise an ``OdeifyError`` naming the problem where they enter.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

import odeify
from odeify.core.errors import ConfigError, OdeifyError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models.digits import DIGITS_SIZE
from odeify.models.loading import load_model

SHAPE = (4, 1, DIGITS_SIZE, DIGITS_SIZE)


@pytest.fixture(scope="module")
def source() -> torch.nn.Module:
    return load_model(DEFAULT_MODEL_PATH)


@pytest.fixture
def converted(source) -> torch.fx.GraphModule:
    return odeify.convert(source)


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g), torch.randint(0, 10, (SHAPE[0],), generator=g)


def test_set_backward_keeps_the_parameters_an_optimizer_holds(converted) -> None:
    optimizer = torch.optim.SGD(converted.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in converted.named_parameters()}
    same = odeify.set_backward(converted, "checkpoint")
    assert same is converted and all(s.backward == "checkpoint" for s in odeify.converted_stages(same))
    x, y = batch()
    F.cross_entropy(same(x), y).backward()
    optimizer.step()
    changed = [n for n, p in converted.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)  # every parameter trained, knots included


def test_retarget_returns_a_new_module_and_leaves_the_input(converted) -> None:
    rk4 = odeify.retarget(converted, integrator="rk4")
    assert rk4 is not converted
    assert {s.integrator.name for s in odeify.converted_stages(converted)} == {"euler"}
    assert not any(p is q for p in rk4.parameters() for q in converted.parameters())


def test_configure_on_an_inlined_stage_refuses_and_standalone_works(converted) -> None:
    stage = odeify.converted_stages(converted)[0]
    with pytest.raises(ConfigError, match="odeify.retarget"):
        stage.configure(integrator="rk4")
    alone = stage.standalone()
    alone.configure(integrator="rk4", steps=2)
    x = torch.randn(2, 16, 8, 8).relu()
    with torch.no_grad():
        rk4_stage = odeify.converted_stages(odeify.retarget(converted, integrator="rk4", steps=2))[0]
        torch.testing.assert_close(alone(x), rk4_stage.standalone()(x), rtol=0, atol=0)


def test_convert_leaves_the_callers_module_alone(source) -> None:
    model = copy.deepcopy(source).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    converted = odeify.convert(model)
    assert model.training and converted.training  # the caller's mode, kept and mirrored
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert odeify.convert(model.eval()).training is False


def test_the_converted_model_keeps_no_tensor_of_the_callers(source) -> None:
    """convert traces a copy sharing the caller's tensors (no second copy of the weights); its result
    keeps none of them: every tensor of it moved in place, as training would, leaves the caller's."""
    model = copy.deepcopy(source)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    converted = odeify.convert(model)
    with torch.no_grad():
        for tensor in (*converted.parameters(), *converted.buffers()):
            if tensor.is_floating_point():
                tensor.add_(1.0)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_changed_template_rebuilds_the_stage_graphs(converted) -> None:
    stage = odeify.converted_stages(converted)[0].standalone()
    x = torch.randn(2, 16, 8, 8).relu()
    with torch.no_grad():
        before = stage(x)
        act = next(n for n in stage.template.graph.nodes if n.op == "call_module" and "act2" in n.target)
        act.target = "act1"  # a structural edit of the template (act1 is ReLU too: same values)
        stage.template.add_submodule("act1", torch.nn.Tanh())  # ... now it is not
        stage.template.recompile()
        after = stage(x)
    assert not torch.allclose(before, after)
    fresh = stage.standalone()
    with torch.no_grad():
        torch.testing.assert_close(after, fresh(x), rtol=0, atol=0)


@pytest.mark.parametrize("backward", ["backprop", "checkpoint", "reverse"])
def test_model_code_shows_the_integrator_in_every_backward_mode(converted, backward: str) -> None:
    model = odeify.retarget(converted, integrator="midpoint", steps=2, backward=backward)
    code = odeify.model_code(model)
    for stage in odeify.converted_stages(model):
        assert f"{stage.stage_name}_F_s1_2" in code  # the second field evaluation of step 1
    if backward != "backprop":
        assert "layer1_ode(" in model.code and "layer1_F_s1_2" not in model.code


def test_enormous_requests_fail_at_once_with_the_estimate(converted) -> None:
    for kwargs, needle in [
        ({"steps": 10**7}, "ODEIFY_MAX_GRAPH_NODES"),
        ({"steps": "x1000000"}, "ODEIFY_MAX_GRAPH_NODES"),
    ]:
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=needle):
            odeify.retarget(converted, **kwargs)
        assert time.perf_counter() - start < 10
    fine = odeify.retarget(converted, knots=600, basis="cubic")  # refining: cheap
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="ODEIFY_MAX_FIT_WORK"):  # an exact 600 -> 599 fit: not cheap
        odeify.retarget(fine, knots=599)
    assert time.perf_counter() - start < 10


def test_the_limits_can_be_raised(converted, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="ODEIFY_MAX_GRAPH_NODES"):
        odeify.retarget(converted, steps=100_000)
    monkeypatch.setenv("ODEIFY_MAX_GRAPH_NODES", str(10**7))
    assert odeify.converted_stages(odeify.retarget(converted, steps=200))[0].steps == 200
    monkeypatch.setenv("ODEIFY_MAX_GRAPH_NODES", "lots")
    with pytest.raises(ConfigError, match="positive integer"):
        odeify.retarget(converted, steps=3)


BAD_CALLS = {
    "backward=None": lambda m, src: odeify.convert(src, backward=None),
    "backward unknown": lambda m, src: odeify.set_backward(m, "adjoint"),
    "reversible on euler": lambda m, src: odeify.set_backward(m, "reversible"),
    "retarget a plain module": lambda m, src: odeify.retarget(torch.nn.Linear(2, 2), steps=2),
    "set_backward a string": lambda m, src: odeify.set_backward("model.safetensors", "checkpoint"),
    "convert a converted model": lambda m, src: odeify.convert(m),
    "leaf_modules names": lambda m, src: odeify.convert(src, leaf_modules=["abc"]),
    "fp64 input to fp32 model": lambda m, src: m(torch.randn(SHAPE, dtype=torch.float64)),
    "fp64 input after retarget": lambda m, src: odeify.retarget(m, steps=2)(
        torch.randn(SHAPE, dtype=torch.float64)
    ),
    "fp64 input after load": lambda m, src: _reloaded(m)(torch.randn(SHAPE, dtype=torch.float64)),
    "float steps": lambda m, src: odeify.retarget(m, steps=2.0),
    "unknown stage": lambda m, src: odeify.retarget(m, steps={"layer9": 2}),
    "unknown stage in integrators": lambda m, src: odeify.retarget(m, integrator={"layer9": "rk4"}),
    "unknown integrator of a stage": lambda m, src: odeify.convert(src, integrator={"layer1": "rk5"}),
    "basis per stage": lambda m, src: odeify.retarget(m, basis={"layer1": "linear"}),
    "reversible on a stage's rk4": lambda m, src: odeify.retarget(
        m, integrator={"layer1": "rk4"}, backward={"layer1": "reversible"}
    ),
    "model_code of a plain module": lambda m, src: odeify.model_code(torch.nn.Linear(2, 2)),
}


def _reloaded(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        odeify.save(model, Path(folder) / "m.safetensors")
        return odeify.load(Path(folder) / "m.safetensors")


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_raise_a_clear_error(converted, source, case: str) -> None:
    with pytest.raises(OdeifyError) as caught:
        BAD_CALLS[case](converted, source)
    assert len(str(caught.value)) > 40  # a sentence that names the problem and the fix


def test_one_backward_mode_covers_the_whole_model(source, tmp_path) -> None:
    """backward='checkpoint' checkpoints the parts between the stages too; a dict sets stages only.

    The plan survives retarget, save and load, and the gradients of every parameter equal backprop's.
    """
    from odeify.passes.segments import has_segments

    model = odeify.convert(copy.deepcopy(source).double(), backward="checkpoint")
    assert has_segments(model)
    assert has_segments(odeify.retarget(model, steps="x2"))
    odeify.save(model, tmp_path / "m.safetensors")
    loaded = odeify.load(tmp_path / "m.safetensors")
    assert has_segments(loaded)
    reference = odeify.convert(copy.deepcopy(source).double())
    x, y = batch(1)
    grads = {}
    for label, module in (("whole", loaded), ("backprop", reference)):
        module.zero_grad()
        F.cross_entropy(module(x.double()), y).backward()
        grads[label] = {n: p.grad for n, p in module.named_parameters()}
    assert grads["whole"].keys() == grads["backprop"].keys()
    for name, grad in grads["backprop"].items():
        torch.testing.assert_close(grads["whole"][name], grad, rtol=1e-10, atol=1e-12, msg=name)
    stages_only = odeify.set_backward(loaded, {"layer1": "checkpoint"})
    assert not has_segments(stages_only)


def test_integrators_per_stage(source, tmp_path) -> None:
    """``integrator`` as a {stage: name} dict: each stage runs its own, exactly as the model-wide
    choice runs it; a save keeps them; a reversible stage beside a checkpointed one gives backprop's
    gradients (float64)."""
    from odeify.compiler.conversion import converted_stages

    native = odeify.convert(copy.deepcopy(source).double())
    mixed = odeify.retarget(native, integrator={"layer1": "alf", "layer2": "rk4"})
    assert [s.integrator.name for s in converted_stages(mixed)] == ["alf", "rk4"]
    called = odeify.retarget(mixed, backward={"layer1": "checkpoint", "layer2": "checkpoint"})
    inputs = {}  # each stage's input, from a model whose stages are called (backprop inlines them)
    for stage in converted_stages(called):
        stage.register_forward_pre_hook(lambda m, a: inputs.setdefault(m.stage_name, a[0].detach()))
    x, y = batch(2)
    with torch.no_grad():
        out = mixed(x.double())  # the stages inlined: each stage's steps in the model's own code
        torch.testing.assert_close(called(x.double()), out, rtol=1e-12, atol=0)  # measured: equal
        for stage, whole in zip(converted_stages(mixed), ("alf", "rk4"), strict=True):
            alone = next(s for s in converted_stages(odeify.retarget(native, integrator=whole))
                         if s.stage_name == stage.stage_name)  # fmt: skip
            state = inputs[stage.stage_name]
            assert torch.equal(stage.standalone()(state), alone.standalone()(state))
    odeify.save(mixed, tmp_path / "mixed.safetensors")
    loaded = odeify.load(tmp_path / "mixed.safetensors")
    assert [s.integrator.name for s in converted_stages(loaded)] == ["alf", "rk4"]
    with torch.no_grad():
        assert torch.equal(loaded(x.double()), out)
    grads = {}
    modes = {"memory-free": {"layer1": "reversible", "layer2": "checkpoint"}, "backprop": "backprop"}
    for label, backward in modes.items():
        model = odeify.retarget(mixed, backward=backward)
        F.cross_entropy(model(x.double()), y).backward()
        grads[label] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["backprop"].items():  # measured: 1e-16 relative (the lattice's 2^-44)
        torch.testing.assert_close(grads["memory-free"][name], grad, rtol=1e-10, atol=1e-12, msg=name)
