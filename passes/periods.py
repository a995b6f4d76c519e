"""Find runs of period p: p consecutive residual sub-blocks that repeat with isomorphic signatures.

A transformer block is two residual blocks, ``x + attn(norm1(x))`` and ``x + mlp(norm2(x))``,
so its blocks alternate and no two neighbours are isomorphic: a run of period 1 has one block.
Read with period 2 (ViT, DeiT, EVA, CaiT, ResMLP, MLP-Mixer, PoolFormer, EfficientFormer) or 4
(Swin: unshifted attention, MLP, shifted attention, MLP), the blocks repeat. Sub-blocks of a
period may be separated by *glue*: parameter-free layout nodes (Swin reshapes its tokens from
``(B, H, W, C)`` to ``(B, H*W, C)`` between the halves), which belong to the period.

The search works on the period-1 chains that :func:`odeify.passes.runs.group_runs` built: a stretch
of single-block chains, linked output to input through glue only, is cut into the fewest runs,
each either one block or at least two repetitions of a period (ties: the smaller periods). Chains
of more than one block (a ResNet stage) are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from odeify.ir.plan import Block
from odeify.passes.graph_utils import data_nodes, describe_arg, describe_target, is_metadata_query, live_nodes

MAX_PERIOD = 8
"""Longest period searched (Swin needs 4)."""
MAX_GLUE = 8
"""Longest chain of glue nodes between two sub-blocks."""

LAYOUT_OPS = frozenset(
    {"reshape", "view", "permute", "transpose", "flatten", "unflatten", "contiguous", "squeeze", "unsqueeze"}
)
"""Methods (and torch functions of the same name) that only rearrange a tensor: what glue may do."""


@dataclass(frozen=True)
class Group:
    """Consecutive blocks that become one run: ``period`` sub-blocks repeated, with the glue between."""

    blocks: tuple[Block, ...]
    period: int = 1
    glue: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Graph:
    """What the search reads of the graph, computed once."""

    gm: fx.GraphModule
    nodes: dict[str, fx.Node]
    modules: dict[str, nn.Module]
    data: set[str]
    live: set[str]


def find_periods(
    gm: fx.GraphModule, chains: Sequence[Sequence[Block]], signature: Callable[[Block], tuple]
) -> list[Group]:
    """The runs of ``chains`` (period-1 chains in graph order), linked single blocks grouped by period."""
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    g = _Graph(gm, nodes, dict(gm.named_modules()), data_nodes(graph), live_nodes(graph))
    groups: list[Group] = []
    i = 0
    while i < len(chains):
        if len(chains[i]) > 1:
            groups.append(Group(tuple(chains[i])))
            i += 1
            continue
        stretch, links = [chains[i][0]], []
        i += 1
        while i < len(chains) and len(chains[i]) == 1:
            glue = _link(stretch[-1], chains[i][0], g)
            if glue is None:
                break
            stretch.append(chains[i][0])
            links.append(glue)
            i += 1
        groups.extend(_split(stretch, links, signature, g))
    return groups


def _link(previous: Block, block: Block, g: _Graph) -> tuple[fx.Node, ...] | None:
    """The glue from ``previous``'s output to ``block``'s fork, or None when they are not linked.

    Linked: the fork is reached from the output through layout nodes only, and each value on the way
    feeds (among live data nodes) only the next one: the intermediate state is not used elsewhere.
    Shape reads (``x.shape``) may use it; :func:`_contained` checks where they go.
    """
    glue: list[fx.Node] = []
    node = g.nodes[block.fork]
    while node.name != previous.output:
        source = layout_source(node, g.data)
        if source is None or len(glue) == MAX_GLUE:
            return None
        glue.insert(0, node)
        node = source
    states = [g.nodes[previous.output], *glue]
    inside = set(block.nodes) | {block.join}
    for k, state in enumerate(states):
        allowed = {glue[k].name} if k < len(glue) else inside
        for user in state.users:
            if user.name in g.live and user.name in g.data and user.name not in allowed:
                return None
    return tuple(glue)


def layout_source(node: fx.Node, data: set[str]) -> fx.Node | None:
    """The one data input of ``node`` if it only rearranges it (a :data:`LAYOUT_OPS` node reading no
    parameter and no metadata), else None."""
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
    else:
        return None
    if name not in LAYOUT_OPS or is_metadata_query(node):
        return None
    inputs = node.all_input_nodes
    sources = [inp for inp in inputs if inp.name in data]
    if len(sources) != 1 or any(inp.op == "get_attr" for inp in inputs):
        return None
    return sources[0]


def _split(
    stretch: list[Block], links: list[tuple[fx.Node, ...]], signature: Callable[[Block], tuple], g: _Graph
) -> list[Group]:
    """Cut a stretch of linked blocks into the fewest runs, back to front.

    Ties go to smaller periods, then to periods that start where a module starts (LeViT's stage
    opens with a lone MLP half: its period is attention + MLP, not MLP + attention), then to the
    longer first run. A run whose values leak out (:func:`_contained`) is no option. A period that
    ends in glue (Swin reshapes back after its last MLP) takes the glue after its last block.
    """
    links = [*links, _trailing_glue(stretch[-1], g)]
    blocks = [signature(block) for block in stretch]
    glues = [_glue_signature(stretch, links, j, g) for j in range(len(links))]

    def group(start: int, period: int, reps: int) -> Group | None:
        """The run of ``reps`` periods from ``start``, or None if it is not self-contained."""
        end = start + period * reps
        if reps == 1:
            return Group((stretch[start],))
        trailing = _period_glue(links[end - 1], glues[end - 1], glues[start + period - 1], end == n)
        glue = tuple(node.name for link in (*links[start : end - 1], trailing) for node in link)
        found = Group(tuple(stretch[start:end]), period, glue)
        last = trailing[-1].name if trailing else stretch[end - 1].output
        return found if _contained(found, last, g) else None

    def splits_a_module(start: int, period: int, reps: int) -> int:
        """How many of the run's periods start inside a module (LeViT: an MLP half, then attention)."""
        starts = range(start, start + period * reps, period)
        modules = [_indexed_module(block.scope) for block in stretch]
        return sum(k > 0 and modules[k] != "" and modules[k] == modules[k - 1] for k in starts)

    n = len(stretch)
    # best[i]: (runs, sum of periods, periods split inside a module, first run) for blocks i..n-1
    best: list[tuple[int, int, int, Group | None]] = [(0, 0, 0, None)] * (n + 1)
    for start in range(n - 1, -1, -1):
        runs, periods, split = best[start + 1][:3]
        options = [(runs + 1, periods + 1, split, -1, 1, 1)]
        for period in range(1, min(MAX_PERIOD, (n - start) // 2) + 1):
            for reps in range(2, _repetitions(blocks, glues, start, period) + 1):
                runs, periods, split = best[start + reps * period][:3]
                split += splits_a_module(start, period, reps)
                options.append((runs + 1, periods + period, split, -period * reps, period, reps))
        for runs, periods, split, _, period, reps in sorted(options):
            first = group(start, period, reps)
            if first is not None:
                best[start] = (runs, periods, split, first)
                break
    groups, start = [], 0
    while start < n:
        first = best[start][3]
        groups.append(first)
        start += len(first.blocks)
    return groups


def _indexed_module(scope: str) -> str:
    """The innermost module of a list a block lives in: ``stages.0.blocks.1.attn`` -> ``stages.0.blocks.1``
    (timm's ViT, LeViT and Swin blocks are items of an ``nn.ModuleList`` or ``nn.Sequential``)."""
    parts = scope.split(".")
    while parts and not parts[-1].isdigit():
        parts.pop()
    return ".".join(parts)


def _period_glue(link: tuple[fx.Node, ...], found: tuple, period: tuple, last: bool) -> tuple[fx.Node, ...]:
    """The glue a run ending at ``link`` takes: the link when it is the glue between its periods
    (``found == period``, signatures); after the stretch's last block, also the link's first nodes
    when they are that glue (SAM reshapes its tokens back, then its neck permutes them)."""
    if found == period:
        return link
    if last and period and found[: len(period)] == period:
        return link[: len(period)]
    return ()


def _trailing_glue(block: Block, g: _Graph) -> tuple[fx.Node, ...]:
    """The layout nodes that follow ``block``'s output one after another, each the only live data user."""
    glue: list[fx.Node] = []
    node = g.nodes[block.output]
    while len(glue) < MAX_GLUE:
        users = [u for u in node.users if u.name in g.live and u.name in g.data]
        if len(users) != 1 or layout_source(users[0], g.data) is not node:
            break
        node = users[0]
        glue.append(node)
    return tuple(glue)


def _repetitions(blocks: list[tuple], glues: list[tuple], start: int, period: int) -> int:
    """How many times the ``period`` blocks from ``start`` (and the glue between them) repeat.

    ``glues[i]`` links block i to block i + 1; inside a period it must repeat position for position,
    and so must the glue from one period to the next (first seen at ``start + period - 1``).
    """
    reps = 1
    while start + (reps + 1) * period <= len(blocks):
        base = start + reps * period
        if any(blocks[base + t] != blocks[start + t] for t in range(period)):
            break
        if reps > 1 and glues[base - 1] != glues[start + period - 1]:
            break
        if any(glues[base + t] != glues[start + t] for t in range(period - 1)):
            break
        reps += 1
    return reps


def _glue_signature(stretch: list[Block], links: list[tuple[fx.Node, ...]], j: int, g: _Graph) -> tuple:
    """The glue after block ``j`` described without node names: what repeats from period to period.

    Values are named by where they come from: an earlier node of this glue (``g``, its index), the
    output or fork of the block ``m`` places back (``("output", 0)`` is block ``j``'s output; Swin
    reshapes back to the shape of the block pair's input, ``("fork", 1)``), or a shape read on one
    of those, described by its calls.
    """
    glue = links[j]
    index = {node.name: k for k, node in enumerate(glue)}
    places = {}
    for m in range(min(j, MAX_PERIOD) + 1):
        back = stretch[j - m]
        places.setdefault(back.output, ("output", m))
        places.setdefault(back.fork, ("fork", m))

    def refer(node: fx.Node, depth: int = 0) -> tuple:
        if node.name in index:
            return ("g", index[node.name])
        if node.name in places:
            return places[node.name]
        if node.name not in g.data and node.op != "get_attr" and depth < MAX_GLUE:
            args = describe_arg(node.args, lambda a: refer(a, depth + 1))
            return ("shape", describe_target(node, g.modules), args)
        return ("outside", node.name)

    return tuple((describe_target(node, g.modules), describe_arg(node.args, refer)) for node in glue)


def _contained(group: Group, last: str, g: _Graph) -> bool:
    """Nothing inside the run (blocks, glue, shape reads on them) is used outside it but ``last``.

    Shape reads of the run's input and inner values (Swin's ``B, H, W, C = x.shape``, read again by
    the glue that reshapes back) belong to the run; those of ``last`` belong to whatever follows.
    """
    first = group.blocks[0].fork
    members = {n for block in group.blocks for n in (*block.nodes, block.join, block.output, block.fork)}
    members = (members | set(group.glue)) - {first}
    frontier = (members | {first}) - {last}
    while frontier:
        reads = {
            user.name
            for name in frontier
            for user in g.nodes[name].users
            if user.name not in g.data and user.name not in members and user.op != "output"
        }
        members |= reads
        frontier = reads
    for name in members - {last}:
        if any(user.name not in members and user.name in g.live for user in g.nodes[name].users):
            return False
    return True
