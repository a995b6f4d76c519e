"""What a fine-tuning run says: one line per event, through ``logging.getLogger("odeify")``.

As timm does, the library logs and the application decides where it goes: the command line sends
the ``odeify`` logger's INFO lines to its output (``odeify.cli.console.print_log_lines``), a
Python user configures ``logging`` as for any library (``logging.basicConfig(level=logging.INFO)``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from torch import nn

from odeify.compiler.conversion import converted_stages
from odeify.core.words import plural
from odeify.train.distributed import Processes
from odeify.train.recipe import Recipe
from odeify.train.state import BEST_FILE, HISTORY_FILE, LAST_FILE, STATE_FILE, SUMMARY_FILE, EpochRecord

__all__ = [
    "DEFAULT_LOG_INTERVAL",
    "LOGGER",
    "BatchProgress",
    "bar_wanted",
    "compile_line",
    "epoch_line",
    "extension_note",
    "finished_note",
    "header",
    "loss_name",
    "plural",
    "refine_message",
    "run_summary",
    "teacher_line",
]

LOGGER = logging.getLogger("odeify")
DEFAULT_LOG_INTERVAL = 50  # timm train.py's --log-interval default: a progress line every 50 batches


def header(model: nn.Module, procs: Processes) -> str:
    stages = "; ".join(
        f"{s.stage_name}: {s.integrator.name}, {plural(s.steps, 'step')}, "
        f"{plural(s.num_knots, s.basis + ' knot')}, backward {s.backward}"
        for s in converted_stages(model)
    )
    return f"fine-tuning on {plural(procs.world_size, 'process')} on {procs.device.type}: {stages}"


class BatchProgress:
    """An epoch's progress: tqdm's bar on a terminal; else (a log file, a pipe) or with TQDM_DISABLE
    set, one log line every ``interval`` batches and at the last (timm's --log-interval)."""

    def __init__(
        self, total: int, epoch: int, epochs: int, *, show: bool, interval: int, loss: str = "loss"
    ) -> None:
        self.total, self.epoch, self.epochs, self.interval, self.loss = total, epoch, epochs, interval, loss
        self.done, self.started, self.bar, self.lines = 0, time.perf_counter(), None, False
        if not show:
            return
        if not bar_wanted():
            self.lines = True
            return
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=f"epoch {epoch}/{epochs}", leave=False)

    def update(self, loss: float, accuracy: float, lr: float) -> None:
        """One batch done; ``loss`` and ``accuracy`` are the epoch's running means."""
        self.done += 1
        if self.bar is not None:
            self.bar.update()
            self.bar.set_postfix(loss=f"{loss:.3f}", acc=f"{accuracy:.1%}", lr=f"{lr:.2g}")
        elif self.lines and (self.done % self.interval == 0 or self.done == self.total):
            seconds = time.perf_counter() - self.started
            LOGGER.info(
                f"epoch {self.epoch}/{self.epochs} [{self.done}/{self.total}]: {self.loss} {loss:.4f}, "
                f"accuracy {accuracy:.2%}, lr {lr:.3g}, {seconds / self.done:.3f} s per batch"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def bar_wanted() -> bool:
    """Whether progress is a tqdm bar: only on a terminal (a bar's redraws garble a log file or a
    pipe, where progress is log lines instead) and not with TQDM_DISABLE set true, as tqdm reads it."""
    disabled = os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no", "off")
    return sys.stderr.isatty() and not disabled


def loss_name(recipe: Recipe, distilling: bool) -> str:
    """What the training loss shown is: cross-entropy, the distillation term, or their mix."""
    if not distilling or recipe.distill == 0:
        return "loss"
    if recipe.distill == 1:
        return "loss (distillation)"
    return f"loss ({1 - recipe.distill:g} cross-entropy + {recipe.distill:g} distillation)"


def compile_line(compiled, trainer) -> str:
    """The line of a compiled run (``compiled``: its :class:`~odeify.train.torch_compile.TorchCompile`):
    what is compiled, with which backend, and what stays eager."""
    parts = ["the model (training and validation)"]
    parts += ["its weight average"] if trainer.ema is not None else []
    parts += ["the teacher"] if trainer.teacher is not None else []
    eager = [s.stage_name for s in converted_stages(trainer.model) if s.backward in ("reverse", "reversible")]
    mode = compiled.mode or "default"
    line = f"torch.compile with backend {compiled.backend}, mode {mode}: {', '.join(parts)}"
    if eager:
        line += f"; the memory-free stages ({', '.join(eager)}) run their own passes eagerly"
    return line


def option(python: str, flag: str, cli: bool) -> str:
    """An option as the caller spells it: the command line's ``flag``, or the ``python`` argument."""
    return flag if cli else python


def teacher_line(teacher_accuracy: float, start: float, recipe: Recipe, cli: bool = False) -> str:
    line = (
        f"distilling (weight {recipe.distill:g}, temperature {recipe.temperature:g}) from the teacher; "
        f"the teacher's own val accuracy {teacher_accuracy:.2%}"
    )
    if teacher_accuracy < start:
        line += (
            " -- below the model's own; fine-tune without distillation "
            f"({option('distill=0', '--distill 0', cli)}) instead"
        )
    if recipe.distill == 1:
        line += (
            "; the loss shown is the distillation term alone, 0 where the model computes its teacher's "
            "function, whatever the accuracy"
        )
        if recipe.label_smoothing:
            line += (
                f"; --smoothing {recipe.label_smoothing:g} smooths the cross-entropy term, which has weight "
                "0 here: it has no effect unless --distill is below 1"
            )
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


def run_summary(history: list[EpochRecord], folder: Path | None) -> str:
    """The end of a run: the best epoch and its accuracy, what best holds, where the files are."""
    best = max(history, key=lambda r: (r.val_accuracy, -r.epoch))
    last = history[-1]
    trained = f"{plural(last.epoch, 'epoch')} trained" if last.epoch else "no epoch trained"
    start = history[0].val_accuracy
    if best.epoch == 0:
        verdict = (
            f"no epoch improved on the model before fine-tuning ({start:.2%}), so {BEST_FILE} holds "
            "that model, unchanged"
        )
    else:
        verdict = f"best: epoch {best.epoch}, val accuracy {best.val_accuracy:.2%} (from {start:.2%})"
        verdict += f", in {BEST_FILE}" if folder is not None else ""
    lines = [f"done: {trained}; {verdict}; last: epoch {last.epoch}, val accuracy {last.val_accuracy:.2%}."]
    if folder is not None:
        lines.append(
            f"files in {folder}: {BEST_FILE}, {LAST_FILE} (models: odeify eval, odeify.load), {SUMMARY_FILE} "
            f"and {HISTORY_FILE} (per epoch), {STATE_FILE} (for --resume)"
        )
    return "\n".join(lines)


def finished_note(folder: Path, epochs: int) -> str:
    return (
        f"the run in {folder} has finished its {plural(epochs, 'epoch')}: nothing to train. To train it "
        f"further, resume with a larger --epochs (e.g. --epochs {epochs + 1})."
    )


def extension_note(recorded: int, epochs: int, step: int, total: int) -> str:
    return (
        f"extending the run from {recorded} to {epochs} epochs: the learning-rate schedule (warm-up, "
        f"cosine) is recomputed over {total} steps and continues at step {step}, so the epochs added are "
        f"not those a {epochs}-epoch run would have trained"
    )


def epoch_line(
    record: EpochRecord, epochs: int, best_before: float, folder: Path | None, loss: str = "loss"
) -> str:
    mark = " (best)" if record.val_accuracy > best_before else ""
    saved = f"; saved {folder / LAST_FILE}" if folder is not None else ""
    raw = (
        ""
        if record.val_accuracy_raw is None
        else f" (weight average; last step {record.val_accuracy_raw:.2%})"
    )
    return (
        f"epoch {record.epoch}/{epochs}: train {loss} {record.train_loss:.4f}, train accuracy "
        f"{record.train_accuracy:.2%}, val accuracy {record.val_accuracy:.2%}{raw}{mark}, "
        f"{record.seconds:.1f} s{_peak(record)}{saved}"
    )


def _peak(record: EpochRecord) -> str:
    return "" if record.peak_memory_mib is None else f", peak memory {record.peak_memory_mib:.0f} MiB"
