"""odeify's pipelines, each the ordered list of passes it runs, written once.

Each :class:`~odeify.compiler.pipeline.Step` takes the pass function itself (its declaration comes
with it), the job's parts it is called with, and what the job keeps of its result.

* :data:`ANALYZE`: trace, shapes, residuals on part of a stream made whole, find blocks, group runs
  (``odeify.analyze``);
* :data:`CONVERT`: trace, shapes, whole residuals, fold BatchNorm, find blocks, group runs, lift
  the runs into native stages, record the conversion, mark timm's head, set the requested
  manifestation, lower, and checkpoint the segments for a whole-model backward (``odeify.convert``,
  and ``odeify.load`` with the file's recipe as the manifestation);
* :data:`REMANIFEST`: inline segments, raise the stages, set the manifestation, lower, checkpoint
  segments (``odeify.retarget`` on a copy, ``odeify.set_backward`` in place).

plus :data:`TRACE_SHAPES` (trace, shapes, whole residuals) and :data:`ANALYZE_GRAPH` (the rest),
the two parts of ANALYZE on their own.
``tests/test_pipelines.py`` checks each order with :meth:`Pipeline.check`.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from odeify.compiler.pipeline import Job, Pipeline, Step
from odeify.compiler.record import record_conversion
from odeify.core.errors import NoResidualBlocksError
from odeify.ir.plan import Plan, Run
from odeify.models.timm_interface import META_TIMM
from odeify.passes.add_census import add_census
from odeify.passes.contract import PassResult
from odeify.passes.fold_bn import fold_batchnorm
from odeify.passes.head import mark_head
from odeify.passes.lift import RunParts, SplitParts, lift_runs
from odeify.passes.lower import lower_stages, raise_stages, stage_nodes
from odeify.passes.manifest import set_manifestation
from odeify.passes.partial_residuals import whole_residuals
from odeify.passes.properties import LOWERED, SEGMENTS, SHAPES
from odeify.passes.residual_blocks import find_blocks
from odeify.passes.runs import group_runs
from odeify.passes.segments import checkpoint_segments, inline_segments
from odeify.passes.tracing import annotate_shapes, trace
from odeify.runtime.split_stage import SplitStage
from odeify.runtime.stage import ODEStage

__all__ = [
    "ANALYZE",
    "ANALYZE_GRAPH",
    "CONVERT",
    "PIPELINES",
    "REMANIFEST",
    "TRACE_SHAPES",
    "NotLiftedWarning",
]


def _model_of(job: Job) -> tuple:
    return (job.source, job.leaf_modules)


def _graph_and_shape(job: Job) -> tuple:
    return (job.gm, job.input_shape)


def _keep_blocks(job: Job, result: PassResult) -> None:
    job.blocks = result.value


def _graph_and_blocks(job: Job) -> tuple:
    return (job.gm, job.blocks)


def _keep_plan(job: Job, result: PassResult) -> None:
    runs, discrete = result.value
    if not runs:
        census = add_census(job.gm, job.blocks)
        plain = (
            " Plain feed-forward nets (VGG, nn.Sequential stacks) have no such blocks."
            if census.residual == 0
            else ""
        )
        raise NoResidualBlocksError(
            f"{job.name} has no residual block odeify can turn into an ODE stage: {census.describe()}. "
            "odeify needs identity blocks of the form x + f(x) (optionally followed by an activation) "
            f"with equal input and output shapes, like the blocks of timm's ResNet family.{plain}"
        )
    job.plan = Plan(
        model=job.name,
        input_shape=tuple(job.input_shape),
        blocks=tuple(job.blocks),
        runs=tuple(runs),
        discrete=tuple(discrete),
    )


def _native_stage(run: Run, parts: RunParts | SplitParts) -> ODEStage:
    """A run as a stage at native settings (one knot per block, Euler, one step per block).

    A run of period p becomes a split stage (one sub-field per sub-block, Lie-Trotter splitting).
    """
    if isinstance(parts, SplitParts):
        fields = parts.fields
        return SplitStage(
            run.name,
            [f.template for f in fields],
            [f.slots for f in fields],
            [f.tensors for f in fields],
            [f.variants for f in fields],
            parts.forms,
            run.length,
            integrator="lie_trotter",
        )
    tensors = {slot.name: parts.tensors[slot.name] for slot in parts.slots}
    return ODEStage(run.name, parts.template, parts.slots, tensors, run.form, run.length, parts.variants)


def _runs_to_lift(job: Job) -> tuple:
    return (job.gm, job.plan.runs, _native_stage)


class NotLiftedWarning(UserWarning):
    """A conversion found runs of residual blocks but lifted some, or all, of them into no ODE stage."""


def _keep_lifted(job: Job, result: PassResult) -> None:
    job.gm, job.not_lifted = result.graph_module, result.value
    if job.not_lifted:
        _warn_not_lifted(job.name, len(job.plan.runs), job.not_lifted)


def _warn_not_lifted(name: str, runs: int, not_lifted: dict[str, str]) -> None:
    """Say, at the caller's line, which runs stayed discrete layers and why (and what would help).

    Without it a model whose every run was refused converts to one with zero ODE stages and says
    nothing: the reasons sit only in ``meta["odeify"]["not_lifted"]``.
    """
    lifted = runs - len(not_lifted)
    outcome = (
        f"{name} converted to a model with zero ODE stages: none of its {_runs(runs)} of residual blocks "
        "could be lifted, so the converted model is the source network's layers alone, with nothing "
        "to integrate, retarget or fine-tune as an ODE"
        if lifted == 0
        else f"{name} converted with {lifted} of its {_runs(runs)} as ODE stages; "
        f"{_runs(len(not_lifted))} {'stays' if len(not_lifted) == 1 else 'stay'} discrete layers, computed "
        "as in the source network"
    )
    reasons = " ".join(f"Run '{run}': {why.rstrip('.')}." for run, why in not_lifted.items())
    warnings.warn(
        f"odeify: {outcome}. {reasons} (model.meta['odeify']['not_lifted'] keeps these reasons)",
        NotLiftedWarning,
        stacklevel=_caller_level(),
    )


def _runs(n: int) -> str:
    return f"{n} run{'s' * (n != 1)}"


_ODEIFY = str(Path(__file__).parents[1]) + os.sep


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside odeify: the user's ``convert`` or ``load`` line."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_ODEIFY):
        frame, level = frame.f_back, level + 1
    return level


def _conversion(job: Job) -> tuple:
    return (job.gm, job.source, job.plan, job.not_lifted)


def _has_head(job: Job) -> bool:
    return bool(job.gm.meta[META_TIMM]["classifier"]) and hasattr(job.source, "forward_head")


def _head_of(job: Job) -> tuple:
    return (job.gm, job.source, job.gm.meta[META_TIMM]["classifier"])


def _keep_head(job: Job, result: PassResult) -> None:
    job.gm.meta[META_TIMM]["classifier_is_call"] = result.value


def _requested_settings(job: Job) -> tuple:
    names = [stage.stage_name for _, stage in stage_nodes(job.gm)]
    return (job.gm, job.settings_for(names))


def _whole_model(job: Job) -> bool:
    return job.whole_model


_TRACE = (Step(trace, _model_of), Step(annotate_shapes, _graph_and_shape), Step(whole_residuals))
_ANALYSIS = (Step(find_blocks, keep=_keep_blocks), Step(group_runs, _graph_and_blocks, _keep_plan))

TRACE_SHAPES = Pipeline("trace", _TRACE)
ANALYZE_GRAPH = Pipeline("analyze_graph", _ANALYSIS, given=frozenset({SHAPES}))
ANALYZE = Pipeline("analyze", _TRACE + _ANALYSIS)
CONVERT = Pipeline(
    "convert",
    (
        *_TRACE,
        Step(fold_batchnorm),
        *_ANALYSIS,
        Step(lift_runs, _runs_to_lift, _keep_lifted),
        Step(record_conversion, _conversion),
        Step(mark_head, _head_of, _keep_head, when=_has_head),
        Step(set_manifestation, _requested_settings),
        Step(lower_stages),
        Step(checkpoint_segments, when=_whole_model),
    ),
)
REMANIFEST = Pipeline(
    "remanifest",
    (
        Step(inline_segments),
        Step(raise_stages),
        Step(set_manifestation, _requested_settings),
        Step(lower_stages),
        Step(checkpoint_segments, when=_whole_model),
    ),
    given=frozenset({LOWERED, SEGMENTS}),
)
PIPELINES = (TRACE_SHAPES, ANALYZE_GRAPH, ANALYZE, CONVERT, REMANIFEST)
"""Every pipeline, for the test that checks their order."""
