"""The pipelines (odeify.compiler.pipelines): each order is consistent, and the runner names the pass.

Each public call runs one pipeline, and each pipeline's order is checked statically: a step whose
requirements no earlier step (or the input graph) ensures is refused before anything runs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import odeify
from odeify.compiler.pipeline import Job, Pipeline, PipelineError, Step
from odeify.compiler.pipelines import CONVERT, PIPELINES
from odeify.passes.contract import PassResult, analysis, graph_pass
from odeify.passes.lift import lift_runs
from odeify.passes.tracing import trace


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.name)
def test_every_pipeline_is_in_order(pipeline: Pipeline) -> None:
    pipeline.check()


def test_a_pipeline_out_of_order_is_refused_before_it_runs() -> None:
    ran = []
    bad = Pipeline("bad", (Step(trace, ran.append), Step(lift_runs, ran.append)))
    with pytest.raises(PipelineError, match="pipeline 'bad', step 2: pass 'lift_runs' requires runs"):
        bad.check()
    assert not ran


def test_a_step_runs_the_pass_whose_declaration_it_checks() -> None:
    """A step takes the declared pass function itself: the spec the pipeline checks is the one the
    function runs under, and a function without a declaration is refused."""
    for pipeline in PIPELINES:
        for step in pipeline.steps:
            assert step.spec is step.graph_pass.pass_spec
    with pytest.raises(TypeError, match="'<lambda>' is not a declared pass"):
        Step(lambda gm: PassResult(gm, modified=False))


def test_convert_runs_its_passes_in_the_declared_order() -> None:
    names = [step.name for step in CONVERT.steps]
    assert names[:7] == [
        "trace",
        "annotate_shapes",
        "whole_residuals",
        "fold_batchnorm",
        "find_blocks",
        "group_runs",
        "lift_runs",
    ]
    assert names.index("set_manifestation") < names.index("lower_stages") < names.index("checkpoint_segments")


@graph_pass(analysis("broken"))
def _broken(gm) -> PassResult:
    raise RuntimeError("a bug in a pass")


def test_an_unexpected_error_names_the_pipeline_the_pass_and_the_passes_before() -> None:
    pipeline = Pipeline("demo", (Step(trace, lambda job: (job.source,)), Step(_broken)))
    with pytest.raises(RuntimeError, match="a bug in a pass") as info:
        pipeline.run(Job(source=nn.Identity()))
    assert "odeify: in pipeline 'demo', pass 'broken' (after trace)" in info.value.__notes__


def test_a_user_error_passes_through_unchanged() -> None:
    """An OdeifyError already names the problem and the fix: no note added."""
    with pytest.raises(odeify.NoResidualBlocksError) as info:
        odeify.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), input_size=(1, 3, 8, 8))
    assert not getattr(info.value, "__notes__", None)


def test_retarget_and_set_backward_keep_the_input_dtype_guard(test_model, tmp_path) -> None:
    """A float64 input to a float32 model is one clear error after every pipeline (it was lost after
    retarget): convert, retarget, set_backward, load."""
    gm = odeify.convert(test_model("resnet18"), input_size=(1, 3, 32, 32))
    x = torch.zeros(1, 3, 32, 32, dtype=torch.float64)
    odeify.save(gm, tmp_path / "m.safetensors")
    loaded = odeify.load(tmp_path / "m.safetensors")
    for model in (gm, odeify.retarget(gm, steps=2), odeify.set_backward(gm, "checkpoint"), loaded):
        with pytest.raises(odeify.ConfigError, match="the input is torch.float64"):
            model(x)
