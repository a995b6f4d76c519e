"""The conversion record: what ``convert`` leaves on a model so it can be saved, retargeted and read.

``gm.meta[META]`` holds the source architecture (a timm or odeify name and build kwargs, or why
none is known), dtype, display name, input shape, original parameter count and the runs not lifted
and why; ``odeify.convert`` adds its check of the native conversion (``verification``, or None and
``verification_skipped_because``). ``odeify.serialization.file_recipe`` writes a saved file's recipe from it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.fx as fx
from torch import nn

from odeify.core.dtypes import model_dtype
from odeify.core.errors import ModelLoadError
from odeify.ir.plan import Plan
from odeify.models.archs import arch_spec
from odeify.models.timm_interface import adopt
from odeify.passes.contract import PassResult, graph_pass, module_record
from odeify.passes.properties import STAGE_CALLS
from odeify.runtime.stage import ODEStage

__all__ = ["META", "RECORD_CONVERSION", "record_conversion"]

META = "odeify"  # GraphModule.meta key of the conversion record

RECORD_CONVERSION = module_record(  # writes gm.meta and makes gm a ConvertedModel; the graph stays as it is
    "record_conversion", requires={STAGE_CALLS}
)


@graph_pass(RECORD_CONVERSION)
def record_conversion(
    gm: fx.GraphModule, source: nn.Module, plan: Plan, skipped: Mapping[str, str]
) -> PassResult:
    """Record on ``gm`` what rebuilds it and the source's timm interface, and make it a ConvertedModel.

    In place: the result's graph module is ``gm``, its class now derived from ConvertedModel.

    Called by ``convert`` once the runs are lifted (before lowering): ``plan``'s block names let the
    optimizer grouping read each knot stack like the blocks it came from.
    """
    dtype = model_dtype(source)
    try:
        name, kwargs = arch_spec(source)
        arch, why_not = {"name": name, "kwargs": kwargs}, None
    except ModelLoadError as exc:
        arch, why_not = None, str(exc)
    gm.meta[META] = {
        "arch": arch,
        "arch_unknown_because": why_not,
        "dtype": str(dtype).removeprefix("torch."),
        "name": plan.model,
        "input_shape": list(plan.input_shape),
        "original_parameters": sum(p.numel() for p in source.parameters()),
        "not_lifted": dict(skipped),
    }
    attrs = {m.stage_name: attr for attr, m in gm.named_children() if isinstance(m, ODEStage)}
    blocks = {
        attrs[run.name]: [block.scope for block in run.blocks] for run in plan.runs if run.name in attrs
    }
    return PassResult(adopt(gm, source, blocks), modified=True)
