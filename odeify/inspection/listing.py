"""``odeify.model_code``: the Python a converted model runs, its integrators included, as text.

A ``backprop`` stage is inlined into the model's own graph, so ``model.code`` shows its steps. A
stage with a memory-free backward mode stays one call (``self.layer1_ode(x)``) that runs the same
integrator step by step, under ``no_grad`` in forward and again in backward; its unrolled code is
appended here so that every manifestation can be read, whatever its backward mode. So is the code
of each checkpointed segment (the parts between the stages, in the whole-model memory plan).
"""

from __future__ import annotations

import torch.fx as fx

from odeify.codegen.emit import unrolled_graph
from odeify.compiler.conversion import check_converted, converted_stages
from odeify.core.words import plural
from odeify.passes.segments import Segment

__all__ = ["model_code"]


def model_code(model: fx.GraphModule) -> str:
    """The converted model's Python code, then the integrator code of each stage it calls as a module."""
    check_converted(model, "model_code")
    parts = [f"# {type(model).__name__}: the converted model's forward\n{model.code.strip()}\n"]
    for stage in converted_stages(model):
        if stage.inlined:
            continue  # its steps are in the model's code above
        header = (
            f"# stage {stage.stage_name!r} ({_name(stage.integrator.name)}, {plural(stage.steps, 'step')}, "
            f"{plural(stage.num_knots, 'knot')}, {stage.basis} basis, backward={stage.backward!r}): what "
            f"self.{_name(_attribute(model, stage))}(x) computes. Forward runs these steps without keeping "
            "activations; backward re-runs them (see docs/backward-modes.md)."
        )
        parts.append(f"{header}\n{unrolled_graph(stage).code.strip()}\n")
    for name, module in model.named_children():
        if isinstance(module, Segment):
            header = f"# segment self.{name}: recomputed in backward from its inputs (checkpointing)"
            parts.append(f"{header}\n{module.runnable.code.strip()}\n")
    return "\n\n".join(parts)


def _name(text: str) -> str:
    """A name as it may appear in a ``#`` comment: as is when it is a Python name, else its repr, which
    is one line (a tableau named 'a\\nimport os' would otherwise put a live line into the listing)."""
    return text if text.isidentifier() else repr(text)


def _attribute(model: fx.GraphModule, stage: object) -> str:
    return next(name for name, module in model.named_modules() if module is stage)
