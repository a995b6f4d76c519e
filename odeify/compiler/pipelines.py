"""odeify's pipelines, each the ordered list of passes it runs, written once.

* :data:`ANALYZE`: trace, shapes, find blocks, group runs (``odeify.analyze``);
* :data:`CONVERT`: trace, shapes, fold BatchNorm, find blocks, group runs, lift the runs into
  native stages, record the conversion, mark timm's head, set the requested manifestation, lower,
  and checkpoint the segments for a whole-model backward (``odeify.convert``, and ``odeify.load``
  with the file's recipe as the manifestation);
* :data:`REMANIFEST`: inline segments, raise the stages, set the manifestation, lower, checkpoint
  segments (``odeify.retarget`` on a copy, ``odeify.set_backward`` in place).

plus :data:`TRACE_SHAPES` and :data:`ANALYZE_GRAPH`, the first two parts of ANALYZE on their own.
``tests/test_pipelines.py`` checks each order with :meth:`Pipeline.check`.
"""

from __future__ import annotations

from odeify.compiler.pipeline import Job, Pipeline, Step
from odeify.compiler.record import RECORD_CONVERSION, record_conversion
from odeify.core.errors import NoResidualBlocksError
from odeify.ir.plan import Plan, Run
from odeify.models.timm_interface import META_TIMM
from odeify.passes.fold_bn import FOLD_BATCHNORM, fold_batchnorm
from odeify.passes.head import MARK_HEAD, mark_head
from odeify.passes.lift import LIFT_RUNS, RunParts, SplitParts, lift_runs
from odeify.passes.lower import LOWER_STAGES, RAISE_STAGES, lower_stages, raise_stages, stage_nodes
from odeify.passes.manifest import SET_MANIFESTATION, set_manifestation
from odeify.passes.properties import LOWERED, SEGMENTS, SHAPES
from odeify.passes.residual_blocks import FIND_BLOCKS, find_blocks
from odeify.passes.runs import GROUP_RUNS, group_runs
from odeify.passes.segments import CHECKPOINT_SEGMENTS, INLINE_SEGMENTS, checkpoint_segments, inline_segments
from odeify.passes.tracing import ANNOTATE_SHAPES, TRACE, annotate_shapes, trace
from odeify.runtime.split_stage import SplitStage
from odeify.runtime.stage import ODEStage

__all__ = ["ANALYZE", "ANALYZE_GRAPH", "CONVERT", "PIPELINES", "REMANIFEST", "TRACE_SHAPES"]


def _trace(job: Job) -> None:
    job.gm = trace(job.source, job.leaf_modules)


def _annotate_shapes(job: Job) -> None:
    annotate_shapes(job.gm, job.input_shape)


def _fold_batchnorm(job: Job) -> None:
    fold_batchnorm(job.gm)


def _find_blocks(job: Job) -> None:
    job.blocks = find_blocks(job.gm)


def _group_runs(job: Job) -> None:
    runs, discrete = group_runs(job.gm, job.blocks)
    if not runs:
        blocks = job.blocks
        found = f"{len(blocks)} projection blocks but no identity block" if blocks else "no residual add"
        raise NoResidualBlocksError(
            f"{job.name} has no residual block odeify can turn into an ODE stage: the graph has {found}. "
            "odeify needs identity blocks of the form x + f(x) (optionally followed by an activation) "
            "with equal input and output shapes, like the blocks of timm's ResNet family. Plain "
            "feed-forward nets (VGG, nn.Sequential stacks) have no such blocks."
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


def _lift_runs(job: Job) -> None:
    job.gm, job.not_lifted = lift_runs(job.gm, job.plan.runs, _native_stage)


def _record_conversion(job: Job) -> None:
    job.gm = record_conversion(job.gm, job.source, job.plan, job.not_lifted)


def _mark_head(job: Job) -> None:
    record = job.gm.meta[META_TIMM]
    if record["classifier"] and hasattr(job.source, "forward_head"):
        record["classifier_is_call"] = mark_head(job.gm, job.source, record["classifier"])


def _set_manifestation(job: Job) -> None:
    names = [stage.stage_name for _, stage in stage_nodes(job.gm)]
    set_manifestation(job.gm, job.settings_for(names))


def _whole_model(job: Job) -> bool:
    return job.whole_model


_TRACE = (Step(TRACE, _trace), Step(ANNOTATE_SHAPES, _annotate_shapes))
_ANALYSIS = (Step(FIND_BLOCKS, _find_blocks), Step(GROUP_RUNS, _group_runs))

TRACE_SHAPES = Pipeline("trace", _TRACE)
ANALYZE_GRAPH = Pipeline("analyze_graph", _ANALYSIS, given=frozenset({SHAPES}))
ANALYZE = Pipeline("analyze", _TRACE + _ANALYSIS)
CONVERT = Pipeline(
    "convert",
    (
        *_TRACE,
        Step(FOLD_BATCHNORM, _fold_batchnorm),
        *_ANALYSIS,
        Step(LIFT_RUNS, _lift_runs),
        Step(RECORD_CONVERSION, _record_conversion),
        Step(MARK_HEAD, _mark_head),
        Step(SET_MANIFESTATION, _set_manifestation),
        Step(LOWER_STAGES, lambda job: lower_stages(job.gm)),
        Step(CHECKPOINT_SEGMENTS, lambda job: checkpoint_segments(job.gm), when=_whole_model),
    ),
)
REMANIFEST = Pipeline(
    "remanifest",
    (
        Step(INLINE_SEGMENTS, lambda job: inline_segments(job.gm)),
        Step(RAISE_STAGES, lambda job: raise_stages(job.gm)),
        Step(SET_MANIFESTATION, _set_manifestation),
        Step(LOWER_STAGES, lambda job: lower_stages(job.gm)),
        Step(CHECKPOINT_SEGMENTS, lambda job: checkpoint_segments(job.gm), when=_whole_model),
    ),
    given=frozenset({LOWERED, SEGMENTS}),
)
PIPELINES = (TRACE_SHAPES, ANALYZE_GRAPH, ANALYZE, CONVERT, REMANIFEST)
"""Every pipeline, for the test that checks their order."""
