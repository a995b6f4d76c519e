"""The one runner of odeify's pipelines: an ordered list of declared passes over one compilation job.

In the spirit of torch.fx's ``PassManager``: a :class:`Pipeline` is a name and a tuple of
:class:`Step`s. Each step is one pass function, declared with
:func:`~odeify.passes.contract.graph_pass` (the step reads the function's own
:class:`~odeify.passes.contract.PassSpec`), what it is called with from the :class:`Job`, and what
the job keeps of its :class:`~odeify.passes.contract.PassResult`. :meth:`Pipeline.check` verifies,
without running anything, that every step's requirements are ensured by the steps before it (or by
the graph it starts from); :meth:`Pipeline.run` runs the steps in order. Each pass still checks its
own contract when it runs; what the runner adds is the order, written once, and errors that name
the pipeline, the pass and the passes before it. The pipelines themselves are in
:mod:`odeify.compiler.pipelines`.
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
from odeify.passes.contract import GraphPass, PassContractError, PassResult, PassSpec
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


def _graph_module_of(job: Job) -> tuple[Any, ...]:
    """A step's arguments when its pass needs the job's graph module alone."""
    return (job.gm,)


def _keep_graph_module(job: Job, result: PassResult) -> None:
    """What a job keeps of most passes' results: the graph module they leave."""
    job.gm = result.graph_module


def _always(job: Job) -> bool:
    """A step that runs on every job."""
    return True


@dataclass(frozen=True)
class Step:
    """One pass of a pipeline: the pass function itself, and how it runs on a job.

    ``graph_pass`` is called with ``arguments(job)`` (by default the job's graph module), and
    ``keep(job, result)`` stores what the job needs of its result (by default the graph module); the
    step runs only ``when`` it applies. Its declaration is the function's own ``pass_spec``, so the
    pipeline checks the contract of the very function it runs.
    """

    graph_pass: GraphPass
    arguments: Callable[[Job], tuple[Any, ...]] = _graph_module_of
    keep: Callable[[Job, PassResult], None] = _keep_graph_module
    when: Callable[[Job], bool] = _always

    def __post_init__(self) -> None:
        if not isinstance(getattr(self.graph_pass, "pass_spec", None), PassSpec):
            raise TypeError(
                f"{getattr(self.graph_pass, '__name__', self.graph_pass)!r} is not a declared pass: a "
                "pipeline step takes a function decorated with odeify.passes.contract.graph_pass"
            )

    @property
    def spec(self) -> PassSpec:
        """The declaration of the pass this step runs."""
        return self.graph_pass.pass_spec  # type: ignore[attr-defined]

    @property
    def name(self) -> str:
        return self.spec.name

    def run(self, job: Job) -> None:
        """Run the pass on ``job`` and keep what the job needs of its result."""
        self.keep(job, self.graph_pass(*self.arguments(job)))


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
