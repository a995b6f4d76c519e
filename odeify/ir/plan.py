"""Frozen results of the residual-block analysis: Block, Run and the Plan for a whole model.

They name fx nodes by ``node.name`` so they stay valid across ``copy.deepcopy`` of the graph
module, and they serialise to JSON for scripts (``odeify inspect --json``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

BlockKind = Literal["identity", "projection"]
BlockForm = Literal["post", "pre"]


@dataclass(frozen=True)
class Block:
    """One residual block found in the graph: ``output = close(join(fork, branch(fork)))``.

    ``form`` is ``post`` when an activation follows the join (v1 ResNets: the activation closes
    the block) and ``pre`` when the join is the block output (pre-activation ResNetV2, NF-ResNet).
    ``nodes`` are the branch nodes between fork and join, in graph order.
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
    """A maximal chain of same-shape identity blocks, each fed by the previous block's output."""

    name: str
    blocks: tuple[Block, ...]

    @property
    def length(self) -> int:
        return len(self.blocks)

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
        return self.blocks[0].parameters


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
                    "form": run.form,
                    "activation": run.activation,
                    "shape": list(run.shape),
                    "parameters_per_block": run.parameters_per_block,
                    "blocks": [_block_dict(b) for b in run.blocks],
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
