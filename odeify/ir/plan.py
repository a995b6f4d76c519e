"""Frozen results of the residual-block analysis: Block, Run and the Plan for a whole model.

They name fx nodes by ``node.name`` so they stay valid across ``copy.deepcopy`` of the graph
module, and they serialise to JSON for scripts (``odeify inspect --json``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

BlockKind = Literal["identity", "scaled", "projection"]
BlockForm = Literal["post", "pre"]


@dataclass(frozen=True)
class Block:
    """One residual block found in the graph: ``output = close(join(fork, branch(fork)))``.

    ``kind`` is ``identity`` when the shortcut is the fork itself, ``scaled`` when it is the fork
    times a learned per-channel scale (PoolFormerV2's ``res_scale``: ``x * s + f(x)``), else
    ``projection``. ``form`` is ``post`` when the block's output is not ``x + f(x)``: an activation
    follows the join (v1 ResNets: the activation closes the block) or the shortcut is scaled; the
    ODE field is then ``block(x) - x``. It is ``pre`` when the join ``x + f(x)`` is the block output
    (pre-activation ResNetV2, NF-ResNet, transformer halves) and the field is ``f(x)``.
    ``nodes`` are the branch nodes between fork and join, in graph order (for a scaled block, the
    shortcut's scaling too).
    """

    index: int
    fork: str
    join: str
    output: str
    kind: BlockKind
    form: BlockForm
    activation: str | None
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    nodes: tuple[str, ...]
    parameters: int
    scope: str


@dataclass(frozen=True)
class Run:
    """A maximal chain of identity blocks, each fed by the previous one's output, that repeat.

    With ``period`` 1 the blocks are isomorphic (a ResNet stage): the run becomes one ODE stage of
    ``length`` blocks. With ``period`` p > 1 the run is ``length`` repetitions of p consecutive
    sub-blocks whose signatures repeat (a transformer's attention and MLP halves: p = 2; Swin's
    unshifted and shifted attention with their MLPs: p = 4), the form of a splitting scheme
    dx/dt = F_1 + ... + F_p: ``convert`` lifts it to one split stage unless it has glue. ``glue``
    names the parameter-free layout nodes (reshapes) between consecutive sub-blocks, and after the
    last one when a period ends in glue, in graph order: they belong to the period (Swin).
    """

    name: str
    blocks: tuple[Block, ...]
    period: int = 1
    glue: tuple[str, ...] = ()

    @property
    def length(self) -> int:
        """The run's depth: blocks for period 1, repetitions of the period otherwise."""
        return len(self.blocks) // self.period

    @property
    def shape(self) -> tuple[int, ...]:
        return self.blocks[0].in_shape

    @property
    def form(self) -> BlockForm:
        return self.blocks[0].form

    @property
    def activation(self) -> str | None:
        return self.blocks[0].activation

    @property
    def parameters_per_block(self) -> int:
        """Parameters of one block (of one period, for period > 1): what one knot holds."""
        return sum(block.parameters for block in self.blocks[: self.period])


@dataclass(frozen=True)
class Discrete:
    """A block that stays a discrete layer, and why."""

    block: Block
    reason: str


@dataclass(frozen=True)
class Plan:
    """Everything the analysis found in one model."""

    model: str
    input_shape: tuple[int, ...]
    blocks: tuple[Block, ...]
    runs: tuple[Run, ...]
    discrete: tuple[Discrete, ...] = field(default=())

    @property
    def run_lengths(self) -> list[int]:
        return [run.length for run in self.runs]

    @property
    def run_periods(self) -> list[int]:
        return [run.period for run in self.runs]

    def run(self, name: str) -> Run:
        for run in self.runs:
            if run.name == name:
                return run
        raise KeyError(name)

    def to_dict(self) -> dict:
        """A JSON-ready dict (tuples become lists)."""
        return {
            "model": self.model,
            "input_shape": list(self.input_shape),
            "runs": [
                {
                    "name": run.name,
                    "length": run.length,
                    "period": run.period,
                    "form": run.form,
                    "activation": run.activation,
                    "shape": list(run.shape),
                    "parameters_per_block": run.parameters_per_block,
                    "blocks": [_block_dict(b) for b in run.blocks],
                    "glue": list(run.glue),
                }
                for run in self.runs
            ],
            "discrete": [{"block": _block_dict(d.block), "reason": d.reason} for d in self.discrete],
        }


def _block_dict(block: Block) -> dict:
    out = asdict(block)
    out["in_shape"] = list(block.in_shape)
    out["out_shape"] = list(block.out_shape)
    out["nodes"] = list(block.nodes)
    return out
