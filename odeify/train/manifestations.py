"""The manifestations a fine-tuning run moves between: the one it trains, its refinements, its teacher.

:func:`for_training` is the one policy for which backward mode a run trains with, for Python and
command-line users alike: a memory-free mode per stage unless one is asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.fx as fx

from odeify.compiler.conversion import converted_stages, retarget
from odeify.numerics.tableaus import REVERSIBLE_SCHEMES

__all__ = ["for_training", "memory_free_backward", "native_depth", "refine"]


def for_training(model: fx.GraphModule, backward: str | Mapping[str, str] | None = None, **settings: Any):
    """``model`` retargeted by ``settings`` (integrator, steps, knots, basis) to train with ``backward``.

    Without ``backward`` every stage gets a memory-free mode (:func:`memory_free_backward`).
    """
    integrator = settings.get("integrator")
    mode = backward if backward is not None else memory_free_backward(model, integrator)
    return retarget(model, backward=mode, **settings)


def memory_free_backward(model: fx.GraphModule, integrator: str | None = None) -> str | dict[str, str]:
    """A memory-free backward mode per stage: the one a stage has (unless ``integrator`` changes it),
    else reversible for a reversible integrator (ALF, reversible Heun) and checkpoint for any other.

    One mode for every stage comes back as a string: odeify's whole-model plan, which also
    recomputes the parts between the stages in backward.
    """
    modes = {}
    for stage in converted_stages(model):
        name = integrator or stage.integrator.name
        if stage.backward != "backprop" and integrator is None:
            modes[stage.stage_name] = stage.backward
        else:
            modes[stage.stage_name] = "reversible" if name in REVERSIBLE_SCHEMES else "checkpoint"
    return modes.popitem()[1] if len(set(modes.values())) == 1 else modes


def refine(model: fx.GraphModule) -> fx.GraphModule:
    """A new model with every stage's knots and steps doubled (the current weight path, resampled)."""
    stages = converted_stages(model)
    return retarget(
        model,
        knots={s.stage_name: 2 * s.num_knots for s in stages},
        steps={s.stage_name: 2 * s.steps for s in stages},
    )


def native_depth(model: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``model`` run as Euler at native depth (one step per block): the distillation teacher.

    With one knot per block, as converted, this is the source network itself.
    """
    return retarget(model, integrator="euler", steps="native", backward="backprop").eval()
