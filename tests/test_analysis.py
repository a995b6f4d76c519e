"""Tests for the residual analysis (find_blocks, group_runs, odeify.analyze): hand-written modules
for each rule, bad input, and a sweep over timm's ResNet family.

Every run the analysis reports is checked by extracting it from the traced graph as its own module
(the run's first fork becomes the placeholder) and running it on the value captured at that fork:
it must reproduce the value captured at the run's last output bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from timm.layers import DropPath
from torch import nn

import odeify
from odeify.compiler.analysis import analyze_graph, trace_and_annotate
from odeify.core.errors import ModelLoadError, NoResidualBlocksError, TraceError
from odeify.ir.meta import NodeTag, node_tag
from odeify.ir.plan import Plan, Run
from odeify.passes.graph_utils import ADD_TARGETS, data_nodes, live_nodes
from odeify.passes.residual_blocks import find_blocks
from odeify.passes.runs import block_node_list

# --- helpers ---------------------------------------------------------------------------------------


class _Recorder(fx.Interpreter):
    """Runs a graph module and keeps a copy of the named nodes' values as they are produced."""

    def __init__(self, gm: fx.GraphModule, keep: set[str]) -> None:
        super().__init__(gm)
        self.keep = keep
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.name in self.keep:
            self.values[n.name] = out.detach().clone()  # before any later in-place op touches it
        return out


def run_module(gm: fx.GraphModule, run: Run) -> fx.GraphModule:
    """The run as its own module: the first fork becomes the placeholder, the last output the result.

    The run's nodes are its blocks' and its glue (the layout nodes between the sub-blocks of a
    period, and after the last one when a period ends in glue); the shape reads they use are copied
    along. Fails if a node of the run reads a value computed outside the run (other than parameters
    and shape reads), or if a value computed inside the run is used outside it (but the last).
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    members = {m.name for b in run.blocks for m in block_node_list(b, nodes)} | set(run.glue)
    members = sorted(members, key=order.__getitem__)
    last = members[-1]
    live = live_nodes(gm.graph)
    data = data_nodes(gm.graph)
    for name in members:
        if name != last:
            leaks = [u.name for u in nodes[name].users if u.name not in members and u.name in live]
            leaks = [u for u in leaks if u in data]  # a shape read of an inner value may go anywhere
            assert not leaks, f"run {run.name}: {name} is also used by {leaks} outside the run"

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {nodes[run.blocks[0].fork]: graph.placeholder("x")}

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env:
            if arg.op == "get_attr":
                env[arg] = graph.get_attr(arg.target)
            else:  # a shape read (x.shape[0]) of a value the run has
                assert arg.name not in data, f"run {run.name} reads {arg.name}, computed outside the run"
                env[arg] = graph.node_copy(arg, lookup)
        return env[arg]

    for name in members:
        env[nodes[name]] = graph.node_copy(nodes[name], lookup)
    graph.output(env[nodes[last]])
    return fx.GraphModule(gm, graph, f"run_{run.name}")


def check_runs_extract_exactly(model: nn.Module, shape: tuple[int, ...], seed: int = 0) -> Plan:
    """Analyze ``model`` on a real input of ``shape``; each run, extracted, reproduces its part exactly."""
    model = model.eval()
    with torch.no_grad():
        gm = trace_and_annotate(model, shape)
        plan = analyze_graph(gm, type(model).__name__, shape)
        ends = {name for run in plan.runs for name in (run.blocks[0].fork, _last(gm, run))}
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=_dtype(model))
        recorder = _Recorder(gm, ends)
        out = recorder.run(x)
        eager = model(x)
        for got, want in zip(_flat(out), _flat(eager), strict=True):  # analysis left the graph exact
            assert (got - want).abs().max().item() == 0.0
        for run in plan.runs:
            fork = recorder.values[run.blocks[0].fork]
            result = run_module(gm, run)(fork.clone())
            expected = recorder.values[_last(gm, run)]
            assert result.shape == expected.shape == fork.shape
            assert (result - expected).abs().max().item() == 0.0, run.name
            assert not torch.equal(result, fork), run.name  # the run does something
    return plan


def _last(gm: fx.GraphModule, run: Run) -> str:
    """The node a run's value leaves by: its last block's output, or the glue after it."""
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    return max([run.blocks[-1].output, *run.glue], key=order.__getitem__)


def _flat(out: torch.Tensor | tuple) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def analyzed(model: nn.Module, shape: tuple[int, ...] = (1, 3, 8, 8)) -> tuple[fx.GraphModule, Plan]:
    """The annotated graph module and the Plan of a (small) module."""
    with torch.no_grad():
        gm = trace_and_annotate(model.eval(), shape)
        return gm, analyze_graph(gm, type(model).__name__, shape)


def meta(gm: fx.GraphModule, name: str) -> dict:
    """The set fields of a node's tag."""
    node_meta = node_tag(next(n for n in gm.graph.nodes if n.name == name))
    return {key: value for key, value in dataclasses.asdict(node_meta).items() if value is not None}


# --- hand-written modules, one per rule ---------------------------------------------------------------


def conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout))


class PostBlock(nn.Module):
    """v1 basic block: relu(shortcut(x) + bn(conv(relu(bn(conv(x))))))."""

    def __init__(self, cin: int, cout: int | None = None, stride: int = 1, identity_module: bool = False):
        super().__init__()
        cout = cout or cin
        self.body = nn.Sequential(conv_bn(cin, cout, stride=stride), nn.ReLU(), conv_bn(cout, cout))
        if cin != cout or stride != 1:
            self.shortcut: nn.Module | None = conv_bn(cin, cout, k=1, stride=stride)
        else:
            self.shortcut = nn.Identity() if identity_module else None
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.shortcut is None else self.shortcut(x)
        return self.act(shortcut + self.body(x))


class PreBlock(nn.Module):
    """Pre-activation block: x + conv(relu(bn(conv(relu(bn(x))))))."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.bn2(self.conv1(F.relu(self.bn1(x))))))


class Res2Block(nn.Module):
    """Res2Net-style: split, an inner add of two pieces, concat, then the outer residual add."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv_a, self.conv_b = conv_bn(c // 2, c // 2), conv_bn(c // 2, c // 2)
        self.conv_out = conv_bn(c, c, k=1)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(x, x.shape[1] // 2, dim=1)
        a = self.act(self.conv_a(pieces[0]))
        b = self.act(self.conv_b(a + pieces[1]))  # inner add: not a residual block
        return self.act(x + self.conv_out(torch.cat([a, b], dim=1)))


class AssertBlock(PostBlock):
    """A post-activation block with a dead ``torch._assert`` side chain on an intermediate tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body[0](x)
        torch._assert(h.shape[1] == 8, "expected 8 channels")
        return self.act(x + self.body[2](self.body[1](h)))


class AlphaBlock(PostBlock):
    """``torch.add(x, f(x), alpha=alpha)``: a residual block only for alpha == 1."""

    def __init__(self, c: int, alpha: float) -> None:
        super().__init__(c)
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(torch.add(x, self.body(x), alpha=self.alpha))


class InnerTapBlock(PostBlock):
    """Returns its branch's intermediate tensor too: the branch is no longer single-exit."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body[1](self.body[0](x))
        return self.act(x + self.body[2](h)), h


class DropPathBlock(PostBlock):
    """timm's patterns: where the block's drop rate is 0, no DropPath module at all (ResNet) or an
    ``nn.Identity`` in its place (ConvNeXt, ByobNet)."""

    def __init__(self, c: int, rate: float, act: type[nn.Module] = nn.ReLU, zero: str = "none") -> None:
        super().__init__(c)
        self.drop_path = DropPath(rate) if rate > 0 else (nn.Identity() if zero == "identity" else None)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.body(x)
        if self.drop_path is not None:
            branch = self.drop_path(branch)
        return self.act(x + branch)


class Net(nn.Module):
    """A stem (conv-bn-relu to 8 channels) followed by ``blocks``; returns a pooled feature vector."""

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 8), nn.ReLU())
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x)).mean((2, 3))


class TapNet(Net):
    """Also returns the output of its first block (a feature tap, as detection backbones do)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.stem(x)
        tap = self.blocks[0](x)
        out = tap
        for block in self.blocks[1:]:
            out = block(out)
        return out.mean((2, 3)), tap.mean((2, 3))


class InnerTapNet(Net):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.stem(x)
        x = self.blocks[0](x)
        x, h = self.blocks[1](x)
        return self.blocks[2](x).mean((2, 3)), h.mean((2, 3))


class Broadcast(nn.Module):
    """Adds of a per-channel bias and of a pooled tensor: broadcasts, not residual joins."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bias = nn.Parameter(torch.randn(8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x)) + self.bias
        return x + x.mean((2, 3), keepdim=True)


def _seeded(module: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights and BN statistics, so exactness checks are not trivially met."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
    return module.eval()


def _block_params(block: nn.Module) -> int:
    return sum(p.numel() for name, p in block.named_parameters() if not name.startswith("shortcut"))


# --- the rules ------------------------------------------------------------------------------------------


def test_identity_block_post_activation() -> None:
    model = _seeded(Net(PostBlock(8), PostBlock(8)))
    gm, plan = analyzed(model)
    assert len(plan.blocks) == 2 and plan.run_lengths == [2]
    for i, block in enumerate(plan.blocks):
        assert (block.kind, block.form, block.activation) == ("identity", "post", "ReLU")
        assert block.in_shape == block.out_shape == (1, 8, 8, 8)
        assert block.output != block.join
        assert block.parameters == _block_params(model.blocks[i]) == 2 * (8 * 8 * 9 + 16)
        assert block.scope.startswith(f"blocks.{i}")  # the path shared by its parameters
    run = plan.runs[0]
    assert (run.name, run.form, run.activation, run.shape) == ("blocks", "post", "ReLU", (1, 8, 8, 8))
    assert plan.blocks[1].fork == plan.blocks[0].output
    for block in plan.blocks:
        for name in block.nodes:
            assert meta(gm, name) == {"block": block.index, "role": "branch", "run": "blocks"}
        assert meta(gm, block.join) == {"block": block.index, "role": "join", "run": "blocks"}
        assert meta(gm, block.output) == {"block": block.index, "role": "output", "run": "blocks"}
    annotated = {n.name for n in gm.graph.nodes if node_tag(n) != NodeTag()}
    assert plan.blocks[0].fork not in annotated and "x" not in annotated  # the stem is no block
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_projection_block() -> None:
    model = _seeded(Net(PostBlock(8, 16, stride=2)))
    gm = trace_and_annotate(model, (1, 3, 8, 8))
    (block,) = find_blocks(gm).value
    assert (block.kind, block.form, block.activation) == ("projection", "post", "ReLU")
    assert (block.in_shape, block.out_shape) == ((1, 8, 8, 8), (1, 16, 4, 4))
    # Both paths from fork to join are the block, so the shortcut's conv counts too.
    assert block.parameters == sum(p.numel() for p in model.blocks[0].parameters()) == 3680
    with pytest.raises(NoResidualBlocksError, match="projection"):
        odeify.analyze(model, (1, 3, 8, 8))


def test_pre_activation_blocks() -> None:
    model = _seeded(Net(PreBlock(8), PreBlock(8), PreBlock(8)))
    gm, plan = analyzed(model)
    assert plan.run_lengths == [3]
    for block in plan.blocks:
        assert (block.kind, block.form, block.activation) == ("identity", "pre", None)
        assert block.output == block.join
        assert block.in_shape == block.out_shape == (1, 8, 8, 8)
        assert meta(gm, block.join) == {"block": block.index, "role": "output", "run": "blocks"}
    assert plan.runs[0].form == "pre"
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_identity_module_shortcut_counts_as_identity() -> None:
    model = _seeded(Net(PostBlock(8, identity_module=True), PostBlock(8, identity_module=True)))
    _, plan = analyzed(model)
    assert [b.kind for b in plan.blocks] == ["identity", "identity"]
    assert plan.run_lengths == [2]
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_broadcast_add_is_not_a_block() -> None:
    model = _seeded(Broadcast())
    gm = trace_and_annotate(model, (1, 3, 8, 8))
    assert sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in ADD_TARGETS) == 2
    assert find_blocks(gm).value == []
    with pytest.raises(NoResidualBlocksError):
        odeify.analyze(model, (1, 3, 8, 8))


def test_res2net_inner_add_is_not_a_block() -> None:
    model = _seeded(Net(Res2Block(8), Res2Block(8)))
    gm, plan = analyzed(model)
    adds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ADD_TARGETS]
    assert len(adds) == 4
    assert [b.join for b in plan.blocks] == [adds[1].name, adds[3].name]  # the outer adds only
    assert adds[0].name in plan.blocks[0].nodes  # the inner add is part of the branch
    assert meta(gm, adds[0].name)["role"] == "branch"
    assert plan.run_lengths == [2]
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_dead_assert_side_chain_stays_a_block() -> None:
    model = _seeded(Net(AssertBlock(8), AssertBlock(8)))
    gm, plan = analyzed(model)
    asserts = [n for n in gm.graph.nodes if n.target is torch._assert]
    assert len(asserts) == 2
    assert plan.run_lengths == [2]
    assert all(a.name not in block.nodes for a in asserts for block in plan.blocks)
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_projection_separates_two_runs() -> None:
    model = _seeded(Net(PostBlock(8), PostBlock(8), PostBlock(8, 16, stride=2), PostBlock(16), PostBlock(16)))
    gm, plan = analyzed(model)
    assert [b.kind for b in plan.blocks] == ["identity", "identity", "projection", "identity", "identity"]
    assert plan.run_lengths == [2, 2]
    assert [r.shape for r in plan.runs] == [(1, 8, 8, 8), (1, 16, 4, 4)]
    assert [r.name for r in plan.runs] == ["blocks", "blocks.run2"]  # unique names
    assert [d.block.index for d in plan.discrete] == [2]
    assert "run" not in meta(gm, plan.blocks[2].join)  # the projection block is in no run
    assert meta(gm, plan.blocks[2].join)["block"] == 2
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def _drop_paths(gm: fx.GraphModule) -> list[DropPath]:
    modules = [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    return [m for m in modules if isinstance(m, DropPath)]


@pytest.mark.parametrize("zero", ["none", "identity"])
def test_rate_zero_block_joins_its_neighbours(zero: str) -> None:
    """A rate-0 block without DropPath (or with nn.Identity) is in the run; the graph is not touched."""
    model = _seeded(Net(*(DropPathBlock(8, rate, zero=zero) for rate in (0.0, 0.1, 0.2))))
    with torch.no_grad():
        gm = trace_and_annotate(model, (1, 3, 8, 8))
        code, modules = gm.code, [name for name, _ in gm.named_modules()]
        plan = analyze_graph(gm, "Net", (1, 3, 8, 8))
    assert plan.run_lengths == [3]
    assert (gm.code, [name for name, _ in gm.named_modules()]) == (code, modules)  # analysis is read-only
    assert [m.drop_prob for m in _drop_paths(gm)] == [0.1, 0.2]
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_blocks_that_differ_beyond_drop_path_stay_apart() -> None:
    model = _seeded(Net(DropPathBlock(8, 0.0), DropPathBlock(8, 0.1, act=nn.SiLU)))
    gm, plan = analyzed(model)
    assert plan.run_lengths == [1, 1]
    assert [m.drop_prob for m in _drop_paths(gm)] == [0.1]
    assert plan.runs[0].blocks[0] == plan.blocks[0]
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_feature_tap_breaks_the_run() -> None:
    model = _seeded(TapNet(PostBlock(8), PostBlock(8), PostBlock(8)))
    _, plan = analyzed(model)
    assert len(plan.blocks) == 3
    assert plan.run_lengths == [1, 2]  # block 0's output is also returned: it cannot be integrated away
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_tap_inside_a_branch_is_not_a_block() -> None:
    model = _seeded(InnerTapNet(PostBlock(8), InnerTapBlock(8), PostBlock(8)))
    _, plan = analyzed(model)
    assert [b.scope.split(".")[:2] for b in plan.blocks] == [["blocks", "0"], ["blocks", "2"]]
    assert plan.run_lengths == [1, 1]


@pytest.mark.parametrize(("alpha", "blocks"), [(0.5, 0), (2, 0), (1, 2)])
def test_add_with_alpha(alpha: float, blocks: int) -> None:
    model = _seeded(Net(AlphaBlock(8, alpha), AlphaBlock(8, alpha)))
    gm = trace_and_annotate(model, (1, 3, 8, 8))
    assert len(find_blocks(gm).value) == blocks


# --- scaled shortcuts, dead reads at block boundaries, slices ---------------------------------------------


class ScaledBlock(PreBlock):
    """PoolFormerV2's ``res_scale``: ``x * s + f(x)`` with a learned per-channel scale ``s``."""

    def __init__(self, c: int) -> None:
        super().__init__(c)
        self.scale = nn.Parameter(torch.ones(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.view(1, -1, 1, 1) + self.conv2(
            F.relu(self.bn2(self.conv1(F.relu(self.bn1(x)))))
        )


class DeviceReadBlock(PreBlock):
    """LeViT's attention reads ``x.device`` (to key a cache) and the trace never uses the read."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.key = str(x.device)
        return super().forward(x)


class CropBlock(PreBlock):
    """Pads its branch and crops it back with the input's size: ``h[:, :, :H, :W]``, H and W nodes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(self.conv1(F.relu(self.bn1(x))), (0, 1, 0, 1))
        return x + h[:, :, : x.shape[2], : x.shape[3]]


def test_scaled_shortcut_is_not_a_projection() -> None:
    model = _seeded(Net(ScaledBlock(8), ScaledBlock(8)))
    gm, plan = analyzed(model)
    assert [(b.kind, b.form, b.activation) for b in plan.blocks] == [("scaled", "post", None)] * 2
    scale_reads = [n.name for n in gm.graph.nodes if n.op == "call_method" and n.target == "view"]
    assert all(read in block.nodes for read, block in zip(scale_reads, plan.blocks, strict=True))
    assert plan.run_lengths == [2] and not plan.discrete
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_dead_read_at_a_block_boundary_keeps_the_run() -> None:
    """The unused ``x.device`` node is a user of each block's input: it must not break the run."""
    model = _seeded(Net(*(DeviceReadBlock(8) for _ in range(3))))
    gm, plan = analyzed(model)
    reads = [n for n in gm.graph.nodes if n.target is getattr and n.args[1] == "device"]
    assert len(reads) == 3 and not any(n.users for n in reads)
    assert plan.run_lengths == [3]
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_slices_holding_nodes_compare_by_structure() -> None:
    """``h[:, :, :H]`` with H = x.shape[2]: the slice's repr names nodes, which differ per block."""
    model = _seeded(Net(CropBlock(8), CropBlock(8)))
    gm, plan = analyzed(model)
    assert plan.run_lengths == [2]
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_position_embedding_add_is_not_a_block_at_batch_1() -> None:
    """``x + pos_embed`` has two operands of one shape at batch 1, but pos_embed is no batch value."""

    class Embedded(Net):
        def __init__(self) -> None:
            super().__init__(PreBlock(8), PreBlock(8))
            self.pos_embed = nn.Parameter(torch.randn(1, 8, 8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(self.stem(x) + self.pos_embed).mean((2, 3))

    model = _seeded(Embedded())
    for batch in (1, 2):
        _, plan = analyzed(model, (batch, 3, 8, 8))
        assert plan.run_lengths == [2]  # the two PreBlocks, not the embedding
    check_runs_extract_exactly(model, (1, 3, 8, 8))


# --- periods: alternating sub-blocks, glue between them -----------------------------------------------


class ChannelBlock(nn.Module):
    """``x + conv1x1(relu(x))``: a second kind of block to alternate with PreBlock (attention / MLP)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(F.relu(x))


def alternating(pairs: int, extra: tuple[nn.Module, ...] = ()) -> nn.Module:
    blocks = [b for _ in range(pairs) for b in (PreBlock(8), ChannelBlock(8))]
    return _seeded(Net(*blocks, *extra))


@pytest.mark.parametrize(
    ("pairs", "extra", "lengths", "periods"),
    [
        (3, (), [3], [2]),
        (1, (), [1, 1], [1, 1]),  # one period is no run: nothing repeats
        (2, ("pre",), [2, 1], [2, 1]),  # A M A M A: two periods from the start, then the last half
        (2, ("pre", "pre"), [2, 2], [2, 1]),  # A M A M A A: then a period-1 run of two
    ],
)
def test_alternating_blocks_group_by_period(pairs: int, extra: tuple, lengths: list, periods: list) -> None:
    model = alternating(pairs, tuple(PreBlock(8) for _ in extra))
    gm, plan = analyzed(model)
    assert (plan.run_lengths, plan.run_periods) == (lengths, periods)
    for run in plan.runs:
        assert len(run.blocks) == run.length * run.period
        for previous, block in zip(run.blocks, run.blocks[1:], strict=False):
            assert block.fork == previous.output  # no glue between these
        for block in run.blocks:
            assert all(meta(gm, name)["run"] == run.name for name in (*block.nodes, block.join))
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_a_period_does_not_join_a_run_of_one_block_kind() -> None:
    """A ResNet stage is one period-1 run, even when an even number of blocks could be read as period 2."""
    _, plan = analyzed(_seeded(Net(*(PreBlock(8) for _ in range(4)))))
    assert (plan.run_lengths, plan.run_periods) == ([4], [1])


class TokenPair(nn.Module):
    """Swin's pattern: ``x + f(x)`` on (B, H, W, C), reshaped to tokens (B, H*W, C) for ``x + g(x)``,
    then reshaped back with the shape read at the pair's input."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.f, self.g = nn.Linear(c, c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        x = x + F.relu(self.f(x))
        x = x.reshape(B, -1, C)
        x = x + torch.tanh(self.g(x))
        return x.reshape(B, H, W, C)


class TokenNet(nn.Module):
    def __init__(self, pairs: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(*(TokenPair(8) for _ in range(pairs)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x).permute(0, 2, 3, 1)).mean((1, 2))


def test_glue_between_sub_blocks_belongs_to_the_period() -> None:
    model = _seeded(TokenNet(3))
    gm, plan = analyzed(model)
    assert (plan.run_lengths, plan.run_periods) == ([3], [2])
    (run,) = plan.runs
    reshapes = [n.name for n in gm.graph.nodes if n.op == "call_method" and n.target == "reshape"]
    assert run.glue == tuple(reshapes)  # both reshapes of every pair, the last one's trailing one too
    assert [b.in_shape for b in run.blocks[:2]] == [(1, 8, 8, 8), (1, 64, 8)]
    check_runs_extract_exactly(model, (2, 3, 8, 8))


def test_a_tap_between_sub_blocks_breaks_the_period() -> None:
    """The token state after a pair's first half is returned too: that period cannot be integrated."""

    class Tapped(TokenNet):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = self.stem(x).permute(0, 2, 3, 1)
            tap = x + F.relu(self.blocks[0].f(x))
            B, H, W, C = x.shape
            x = tap.reshape(B, -1, C)
            x = (x + torch.tanh(self.blocks[0].g(x))).reshape(B, H, W, C)
            for pair in self.blocks[1:]:
                x = pair(x)
            return x.mean((1, 2)), tap.mean((1, 2))

    _, plan = analyzed(_seeded(Tapped(3)))
    assert (plan.run_lengths, plan.run_periods) == ([1, 1, 2], [1, 1, 2])


def test_a_shape_read_leaving_the_period_breaks_it() -> None:
    """The head reads the token count of the first pair's inner state: that period cannot be integrated."""

    class ShapeTapped(TokenNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x).permute(0, 2, 3, 1)
            B, H, W, C = x.shape
            tokens = (x + F.relu(self.blocks[0].f(x))).reshape(B, -1, C)
            count = tokens.shape[1]  # read inside the period, used by the head
            x = (tokens + torch.tanh(self.blocks[0].g(tokens))).reshape(B, H, W, C)
            for pair in self.blocks[1:]:
                x = pair(x)
            return x.mean((1, 2)) * count

    _, plan = analyzed(_seeded(ShapeTapped(3)))
    assert (plan.run_lengths, plan.run_periods) == ([1, 1, 2], [1, 1, 2])


class GluedBlock(PreBlock):
    """``(x + f(x)).contiguous()``: identical blocks with a layout node between each two."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).contiguous()


def test_identical_blocks_with_glue_are_one_run_of_period_1() -> None:
    """Four blocks could be read as two periods of two; the smaller period wins the tie."""
    _, plan = analyzed(_seeded(Net(*(GluedBlock(8) for _ in range(4)))))
    assert (plan.run_lengths, plan.run_periods) == ([4], [1])
    assert len(plan.runs[0].glue) == 4  # after each block, the last one's trailing one too


def test_a_run_of_period_1_with_glue_lifts_to_one_stage() -> None:
    """The glue keeps the state's layout, so each block sees the state as it is: no glue in the stage."""
    model = _seeded(Net(*(GluedBlock(8) for _ in range(4)))).double()
    converted = odeify.convert(model, input_size=(2, 3, 8, 8))
    (stage,) = odeify.converted_stages(converted)
    assert stage.depth == 4
    assert not any(node.name.startswith("glue_") for node in stage.template.graph.nodes)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        assert (converted(x) - model(x)).abs().max() <= 1e-12 * model(x).abs().max()  # measured: 1.7e-16


# --- the analysis never changes the caller's model -----------------------------------------------------


class CachingBlock(PreBlock):
    """Caches a tensor per device, as LeViT's attention caches its biases: traced, it would cache a Proxy."""

    def __init__(self, c: int) -> None:
        super().__init__(c)
        self.gain = nn.Parameter(torch.ones(c, 1, 1))
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = str(x.device)
        if key not in self.cache:
            self.cache[key] = self.gain * 2
        return x + self.conv2(F.relu(self.bn2(self.conv1(F.relu(self.bn1(x)))))) * self.cache[key]


def test_analyze_leaves_the_callers_model_alone(tmp_path) -> None:
    model = _seeded(Net(CachingBlock(8), CachingBlock(8))).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = odeify.analyze(model, (1, 3, 8, 8))
    assert plan.run_lengths == [2]
    assert [block.cache for block in model.blocks] == [{}, {}]  # no Proxy left behind
    assert model.training  # analysed in eval mode, but as a copy
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    other = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    torch.save(other, tmp_path / "w.pth")
    odeify.analyze(model, (1, 3, 8, 8), checkpoint=tmp_path / "w.pth")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # loaded into a copy


# --- bad input --------------------------------------------------------------------------------------------


class DataDependent(nn.Module):
    """Python control flow on tensor values: FX cannot trace through it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return F.relu(x)
        return x


class UntraceableNet(Net):
    def __init__(self) -> None:
        blocks = [PostBlock(8), PostBlock(8)]
        for block in blocks:
            block.body[1] = DataDependent()
        super().__init__(*blocks)


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: odeify.load_model("vgg11"), id="vgg11"),
        pytest.param(
            lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)), id="sequential"
        ),
    ],
)
def test_no_residual_blocks(model) -> None:
    module = model()
    with pytest.raises(NoResidualBlocksError) as info:
        odeify.analyze(module, (1, 3, 32, 32))
    message = str(info.value)
    assert type(module).__name__ in message
    assert "no residual" in message and "identity block" in message


def test_untraceable_module_names_it_and_suggests_a_leaf() -> None:
    model = _seeded(UntraceableNet())
    with pytest.raises(TraceError) as info:
        odeify.analyze(model, (1, 3, 8, 8))
    message = str(info.value)
    assert "blocks.0.body.1" in message and "DataDependent" in message
    assert "leaf_modules=[" in message
    plan = odeify.analyze(model, (1, 3, 8, 8), leaf_modules=[DataDependent])
    assert plan.run_lengths == [2]
    assert "blocks_0_body_1" in plan.blocks[0].nodes  # the leaf is a node of the block's branch


def test_unknown_timm_name_suggests_close_names() -> None:
    with pytest.raises(ModelLoadError) as info:
        odeify.analyze("resnet5O")
    message = str(info.value)
    assert "resnet5O" in message and "resnet50" in message


def test_rejected_input_shape_names_the_node() -> None:
    with pytest.raises(TraceError) as info:
        odeify.analyze("resnet18", (1, 1, 64, 64))
    message = str(info.value)
    assert "(1, 1, 64, 64)" in message and "conv2d" in message  # the shape and the node that failed
    assert "3 channels" in message  # torch's own reason
    assert "input_size" in message  # what to do


@pytest.mark.parametrize("size", [(0, 3, 64, 64), (3, 64), (1, 3, 64.0, 64)])
def test_malformed_input_size(size: tuple) -> None:
    with pytest.raises(odeify.OdeifyError, match="input_size"):
        odeify.analyze(_seeded(Net(PostBlock(8))), size)


# --- the timm ResNet family ------------------------------------------------------------------------------


class ZooCase(NamedTuple):
    name: str
    kwargs: dict
    runs: list[int]
    form: str
    activation: str | None


V1 = [2, 3, 5, 2]
ZOO: dict[str, ZooCase] = {
    "resnet18": ZooCase("resnet18", {}, [2, 1, 1, 1], "post", "ReLU"),
    "resnet34": ZooCase("resnet34", {}, [3, 3, 5, 2], "post", "ReLU"),
    "resnet50": ZooCase("resnet50", {}, V1, "post", "ReLU"),
    "resnet50d": ZooCase("resnet50d", {}, V1, "post", "ReLU"),
    "seresnet50": ZooCase("seresnet50", {}, V1, "post", "ReLU"),
    "resnext50_32x4d": ZooCase("resnext50_32x4d", {}, V1, "post", "ReLU"),
    "wide_resnet50_2": ZooCase("wide_resnet50_2", {}, V1, "post", "ReLU"),
    "resnetrs50": ZooCase("resnetrs50", {}, V1, "post", "ReLU"),
    "resnetblur50": ZooCase("resnetblur50", {}, V1, "post", "ReLU"),
    "res2net50_26w_4s": ZooCase("res2net50_26w_4s", {}, V1, "post", "ReLU"),
    "resnetv2_50": ZooCase("resnetv2_50", {}, V1, "pre", None),
    "nf_resnet50": ZooCase("nf_resnet50", {}, V1, "pre", None),
    "resnet101": ZooCase("resnet101", {}, [2, 3, 22, 2], "post", "ReLU"),
    "resnet152": ZooCase("resnet152", {}, [2, 7, 35, 2], "post", "ReLU"),
    "resnet26t": ZooCase("resnet26t", {}, [1, 1, 1, 1], "post", "ReLU"),
    "skresnet18": ZooCase("skresnet18", {}, [2, 1, 1, 1], "post", "ReLU"),
    "resnet33ts": ZooCase("resnet33ts", {}, [1, 2, 2, 1], "post", "SiLU"),
    "resnet18+drop_path": ZooCase("resnet18", {"drop_path_rate": 0.1}, [2, 1, 1, 1], "post", "ReLU"),
    # stages.0 has an identity downsample before its first block: that block is a run member too
    "convnext_tiny": ZooCase("convnext_tiny", {}, [3, 3, 9, 3], "pre", None),
}
ZOO_CI = (
    "resnet18",
    "resnet50",
    "resnetv2_50",
    "nf_resnet50",
    "res2net50_26w_4s",
    "resnet33ts",
    "skresnet18",
    "resnet18+drop_path",
    "resnet152",
    "convnext_tiny",
)
"""The representative subset that always runs; ODEIFY_ZOO=all runs the whole sweep."""
ANALYSIS_ONLY = ("resnet152",)
"""In CI these get the run-lengths check only (their exact extraction runs with ODEIFY_ZOO=all)."""
EXTRACT_SIZE = (2, 3, 64, 64)


def zoo_params(ci: tuple[str, ...]) -> list:
    """Every zoo case, marked ``zoo``; those outside ``ci`` skip unless ODEIFY_ZOO=all."""
    full = os.environ.get("ODEIFY_ZOO", "").lower() == "all"
    params = []
    for key in ZOO:
        marks = [pytest.mark.zoo]
        if key not in ci and not full:
            marks.append(
                pytest.mark.skip(reason=f"{key} is outside ZOO_CI; set ODEIFY_ZOO=all for the sweep")
            )
        params.append(pytest.param(key, marks=marks, id=key))
    return params


def test_zoo_ci_is_a_subset() -> None:
    assert set(ZOO_CI) <= set(ZOO) and set(ANALYSIS_ONLY) <= set(ZOO_CI)


@pytest.mark.parametrize("key", zoo_params(ZOO_CI))
def test_zoo_run_lengths(key: str) -> None:
    case = ZOO[key]
    plan = odeify.analyze(case.name, (1, 3, 224, 224), **case.kwargs)
    assert plan.run_lengths == case.runs
    assert len({r.name for r in plan.runs}) == len(plan.runs)
    for run in plan.runs:
        assert (run.form, run.activation) == (case.form, case.activation), run.name
        for block in run.blocks:
            assert block.kind == "identity"
            assert block.in_shape == block.out_shape == run.shape
            assert block.parameters == run.parameters_per_block
        for previous, block in zip(run.blocks, run.blocks[1:], strict=False):
            assert block.fork == previous.output


@pytest.mark.parametrize("key", zoo_params(tuple(k for k in ZOO_CI if k not in ANALYSIS_ONLY)))
def test_zoo_runs_extract_exactly(key: str, test_model) -> None:
    case = ZOO[key]
    plan = check_runs_extract_exactly(test_model(case.name, **case.kwargs), EXTRACT_SIZE)
    assert plan.run_lengths == case.runs
