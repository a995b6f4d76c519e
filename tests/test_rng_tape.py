"""The RNG tape (odeify.runtime.rng_tape): a recorded run's draws replay exactly, in the graph that
drew them or another naming its nodes alike, also when which nodes draw changes between runs.

The oracle is the graph itself run from the same RNG state: a replay must give its output bit for
bit, and recording must leave the RNG stream where a plain run leaves it."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from odeify.runtime.rng_tape import Generators, record, replay

CPU = Generators(torch.device("cpu"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.middle = nn.Dropout(0.0)  # these two draw nothing until their p is raised
        self.drop2 = nn.Dropout(0.25)
        self.last = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.middle(self.drop(x.sin()) * 2)
        return self.last(self.drop2(y + 1).cos())


def _graph() -> fx.GraphModule:
    return fx.symbolic_trace(Net().train())


def _plain(graph: fx.GraphModule, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    out = graph(x)
    return out, torch.get_rng_state()


def _recorded(graph: fx.GraphModule, x: torch.Tensor, seed: int):
    torch.manual_seed(seed)
    out, tape = record(graph, (x,), CPU)
    return out, tape, torch.get_rng_state()


def test_record_matches_a_plain_run_and_replays_it_exactly() -> None:
    graph, x = _graph(), torch.randn(64, 32)
    for seed in range(3):  # the first run finds the drawing nodes, the later ones run the noting copy
        want, stream = _plain(graph, x, seed)
        got, tape, after = _recorded(graph, x, seed)
        assert torch.equal(got, want) and torch.equal(after, stream)
        assert set(tape) == {"drop", "drop2"}
        torch.manual_seed(1000 + seed)  # the stream has moved on when backward replays
        assert torch.equal(replay(graph, (x,), tape, CPU), want)


@pytest.mark.parametrize("starts", ["middle", "last"])  # between two drawing nodes, or after them
def test_a_node_that_starts_drawing_is_found(starts: str) -> None:
    graph, x = _graph(), torch.randn(64, 32)
    _recorded(graph, x, 0)  # only `drop` and `drop2` draw
    _recorded(graph, x, 1)  # ... and the noting copy runs
    getattr(graph, starts).p = 0.5
    want, stream = _plain(graph, x, 2)
    got, tape, after = _recorded(graph, x, 2)
    assert torch.equal(got, want) and torch.equal(after, stream)
    assert set(tape) == {"drop", "drop2", starts}
    torch.manual_seed(7)
    assert torch.equal(replay(graph, (x,), tape, CPU), want)
    graph.drop2.p = 0.0  # a known drawing node that no longer draws leaves no entry
    want, _ = _plain(graph, x, 3)
    got, tape, _ = _recorded(graph, x, 3)
    assert torch.equal(got, want) and set(tape) == {"drop", starts}


def test_replay_in_another_graph_naming_its_nodes_alike() -> None:
    graph, x = _graph(), torch.randn(64, 32)
    other = _graph()  # another module, the same node names
    for seed in range(2):
        want, _ = _plain(graph, x, seed)
        _, tape, _ = _recorded(graph, x, seed)
        torch.manual_seed(99)
        assert torch.equal(replay(other, (x,), tape, CPU), want)


def test_a_graph_that_never_draws_leaves_no_tape() -> None:
    graph, x = _graph(), torch.randn(8, 4)
    graph.eval()
    graph.drop.eval()
    want, stream = _plain(graph, x, 0)
    got, tape, after = _recorded(graph, x, 0)
    assert tape == {} and torch.equal(got, want) and torch.equal(after, stream)
