"""The one runner of odeify's pipelines: an ordered list of declared passes over one compilation job.

In the spirit of torch.fx's ``PassManager``: a :class:`Pipeline` is a name and a tuple of
:class:`Step`s, each step one declared graph pass (its :class:`~odeify.passes.contract.PassSpec`)
and how to call it on the :class:`Job`. :meth:`Pipeline.check` verifies, without running anything,
that every step's requirements are ensured by the steps before it (or by the graph it starts
from); :meth:`Pipeline.run` runs the steps in order. Each pass still checks its own contract when
it runs; what the runner adds is the order, written once, and errors that name the pipeline, the
pass and the passes before it. The pipelines themselves are in :mod:`odeify.compiler.pipelines`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import nn

from odeify.core.errors import OdeifyError
from odeify.ir.plan import Block, Plan
from odeify.ir.settings import StageRequest
from odeify.passes.contract import PassContractError, PassSpec
from odeify.passes.properties import Property

__all__ = ["Job", "Pipeline", "PipelineError", "Step"]


class PipelineError(PassContractError):
    """A pipeline is declared out of order: a step needs what no step before it ensures."""


@dataclass
class Job:
    """What a pipeline works on and what its steps leave for the steps after them.

    ``source`` is the module being converted (an eval-mode copy: passes never change the caller's),
    ``gm`` the graph module once traced (or the converted model a retarget starts from),
    ``manifestation`` maps stage names to the settings to apply (filled by ``settings_for`` once
    the stage names are known), and ``whole_model`` says whether the parts between the stages are
    checkpointed segments at the end.
    """

    source: nn.Module | None = None
    name: str = ""
    input_shape: tuple[int, ...] = ()
    leaf_modules: Sequence[type[nn.Module]] = ()
    settings_for: Callable[[list[str]], dict[str, StageRequest]] = lambda names: {}
    whole_model: bool = False
    gm: fx.GraphModule | None = None
    blocks: list[Block] = field(default_factory=list)
    plan: Plan | None = None
    not_lifted: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """One pass of a pipeline: its declaration, and how to run it on a job (``when`` it applies)."""

    spec: PassSpec
    run: Callable[[Job], Any]
    when: Callable[[Job], bool] = lambda job: True

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class Pipeline:
    """An ordered list of declared passes; ``given`` are the properties its input graph has."""

    name: str
    steps: tuple[Step, ...]
    given: frozenset[Property] = frozenset()

    def check(self) -> None:
        """Refuse an order in which a step requires what no earlier step (or the input) ensures."""
        have = self.given
        for index, step in enumerate(self.steps):
            refused = step.spec.refusal(have)
            if refused and step.spec.requires - have:
                raise PipelineError(f"pipeline {self.name!r}, step {index + 1}: {refused}")
            have = step.spec.after(have)

    def run(self, job: Job) -> Job:
        """Run every step that applies to ``job``, in order; returns the job."""
        done: list[str] = []
        for step in self.steps:
            if not step.when(job):
                continue
            try:
                step.run(job)
            except OdeifyError:
                raise  # a user-facing error already names the problem and the fix
            except Exception as exc:
                after = f" (after {', '.join(done)})" if done else " (its first pass)"
                _add_note(exc, f"odeify: in pipeline {self.name!r}, pass {step.name!r}{after}")
                raise
            done.append(step.name)
        return job


def _add_note(exc: Exception, note: str) -> None:
    """Attach ``note`` to ``exc``'s traceback text (Python 3.11's add_note; a plain attribute before)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]
