"""What a fine-tuning run says: one line per event, through ``logging.getLogger("odeify")``.

As timm does, the library logs and the application decides where it goes: the command line sends
the ``odeify`` logger's INFO lines to its output (``odeify.cli.console.print_log_lines``), a
Python user configures ``logging`` as for any library (``logging.basicConfig(level=logging.INFO)``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from odeify.compiler.conversion import converted_stages
from odeify.train.distributed import Processes
from odeify.train.recipe import Recipe
from odeify.train.state import LAST_FILE, EpochRecord

__all__ = ["LOGGER", "epoch_line", "header", "refine_message", "teacher_line"]

LOGGER = logging.getLogger("odeify")


def header(model: nn.Module, procs: Processes) -> str:
    stages = "; ".join(
        f"{s.stage_name}: {s.integrator.name}, {s.steps} steps, {s.num_knots} {s.basis} knots, "
        f"backward {s.backward}"
        for s in converted_stages(model)
    )
    return f"fine-tuning on {procs.world_size} process(es) on {procs.device.type}: {stages}"


def teacher_line(teacher_accuracy: float, start: float, recipe: Recipe) -> str:
    line = (
        f"distilling (weight {recipe.distill:g}, temperature {recipe.temperature:g}) from the teacher: "
        f"val accuracy {teacher_accuracy:.2%}"
    )
    if teacher_accuracy < start:
        line += " -- below the model's own; fine-tune without distillation (distill=0, --distill 0) instead"
    return line


def refine_message(epoch: int, before: dict, after: dict, kept: int, optimizer: str) -> str:
    changes = ", ".join(
        f"{name} knots {before['knots'][name]}->{after['knots'][name]}, steps {before['steps'][name]}->"
        f"{after['steps'][name]}"
        for name in after["knots"]
    )
    return (
        f"epoch {epoch}: refined every stage ({changes}). A new {optimizer} takes over: the {kept} "
        "parameters outside the knot stacks keep their optimizer state, the refined knot stacks start "
        "with fresh moments; the learning-rate schedule continues."
    )


def epoch_line(record: EpochRecord, epochs: int, best_before: float, folder: Path | None) -> str:
    mark = " (best)" if record.val_accuracy > best_before else ""
    saved = f"; saved {folder / LAST_FILE}" if folder is not None else ""
    raw = (
        ""
        if record.val_accuracy_raw is None
        else f" (weight average; last step {record.val_accuracy_raw:.2%})"
    )
    return (
        f"epoch {record.epoch}/{epochs}: train loss {record.train_loss:.4f}, train accuracy "
        f"{record.train_accuracy:.2%}, val accuracy {record.val_accuracy:.2%}{raw}{mark}, "
        f"{record.seconds:.1f} s{saved}"
    )
