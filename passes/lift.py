"""Transformation pass: replace each run of L blocks by one ``StageIR`` call.

The stage's template is the first block's computation; its knots are the L blocks' tensors
stacked per template slot, and float literals that differ between blocks (NF-ResNet's ``beta``)
become knots too. Modules that differ only in float settings (growing DropPath rates) are kept
per block, and so are pass-through calls (``DropPath``, dropout, ``nn.Identity``) that only some
blocks make: the template calls a module wherever any block does, and a block without one gets
``nn.Identity`` there. At native depth with Euler the stage reproduces the run exactly, so this
pass preserves computation. A run of period p becomes one template per sub-field; where layout
glue joins its sub-blocks (Swin), each sub-field's template holds the glue that maps the stage
state to its sub-block's input and the update back (:mod:`odeify.passes.glue`).
"""

from __future__ import annotations

import copy
import dataclasses
import keyword
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from odeify.core.dtypes import model_dtype
from odeify.ir.fold_records import FOLDS, FoldRecord, add_fold_record, fold_records, record_key
from odeify.ir.meta import tag
from odeify.ir.plan import Run
from odeify.ir.stage_ir import Slot, StageIR
from odeify.passes.contract import PassResult, graph_pass, transformation
from odeify.passes.glue import FieldGlue, GlueError, Segment, field_glues, run_end, run_members
from odeify.passes.graph_utils import (
    data_nodes,
    fetch_attr,
    identity_sources,
    is_metadata_query,
    live_nodes,
    owner_of,
    shape_nodes,
    unique_name,
)
from odeify.passes.properties import BLOCKS, RUNS, STAGE_CALLS
from odeify.passes.runs import block_node_list, core_nodes, pass_through_source
from odeify.passes.tracing import node_shape, opaque_weights_reason

LIFT_RUNS = transformation(
    "lift_runs",
    requires={RUNS},
    ensures={STAGE_CALLS},
    invalidates={BLOCKS, RUNS},  # the runs' nodes are replaced by stage calls
)


@dataclass(frozen=True)
class RunParts:
    """What lifting extracts from one run, for the caller to build its stage from.

    ``template`` computes one block, ``(x, *slot tensors) -> (branch f(x), block output)``;
    ``tensors[slot.name]`` stacks the blocks' tensors for a slot on a leading axis (one tensor for a
    ``shared`` slot); ``origins[slot.name]`` names each block's attribute behind a tensor slot;
    ``variants[key]`` lists each block's own module where blocks differ in one
    (DropPath rates, a pass-through call a block lacks), keyed by the template module path with
    '.' replaced by '__'.
    """

    template: fx.GraphModule
    slots: list[Slot]
    tensors: dict[str, torch.Tensor]
    variants: dict[str, list[nn.Module]]
    origins: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """For each slot read from the model's attributes: the attribute path it came from, per block."""
    inputs: tuple[str, ...] = ()
    """The stage's constant inputs: nodes outside the run that every block reads alike (a rotary
    ViT's position table), named as the template's placeholders after ``x``, in their order."""


@dataclass(frozen=True)
class SplitParts:
    """What lifting extracts from a run of period p: one :class:`RunParts` per sub-field.

    ``fields[i]`` is the period-1 run of every period's i-th sub-block (a ViT's attention halves,
    then its MLP halves); ``forms[i]`` is that sub-block's form.
    """

    fields: tuple[RunParts, ...]
    forms: tuple[str, ...]

    @property
    def inputs(self) -> tuple[str, ...]:
        """Every field's constant inputs, each once, in the order the fields first read them."""
        return tuple(dict.fromkeys(name for field in self.fields for name in field.inputs))


StageFactory = Callable[[Run, RunParts | SplitParts], StageIR]


class NotLiftable(Exception):
    """A run whose blocks cannot share one template; the run stays discrete with this reason."""


def stage_attribute(run: Run) -> str:
    """The attribute name of a run's stage in the converted model: 'layer3' -> 'layer3_ode'."""
    return run.name.replace(".", "_") + "_ode"


@graph_pass(LIFT_RUNS)
def lift_runs(gm: fx.GraphModule, runs: Sequence[Run], make_stage: StageFactory) -> PassResult:
    """Lift every liftable run of ``gm`` in place; the result's ``value`` is {run: reason} for the rest.

    ``make_stage(run, parts)`` builds the stage from the extracted parts (policy stays with the
    caller: basis, knots, integrator and steps are not this pass's business).
    """
    skipped: dict[str, str] = {}
    renamed: dict[str, str] = {}  # output node of a lifted run -> the stage call that replaced it
    for run in runs:
        run = _follow_renames(run, renamed)
        try:
            parts = extract_run(gm, run) if run.period == 1 else extract_split_run(gm, run)
        except NotLiftable as why:
            skipped[run.name] = str(why)
            continue
        stage = make_stage(run, parts)
        _move_fold_records(gm, stage, parts, run.blocks[0].scope)
        end = run_end(run, {n.name: n for n in gm.graph.nodes}).name
        call = _replace_run(gm, run, stage_attribute(run), stage, parts.inputs)
        renamed[end] = call.name
    folds = gm._modules.pop(FOLDS, None)  # the discrete layers' records: read by training, not the graph
    prune_unused_attributes(gm)
    if folds is not None:
        gm.add_module(FOLDS, folds)
    return PassResult(gm, modified=True, value=skipped)


def _follow_renames(run: Run, renamed: dict[str, str]) -> Run:
    """The run with its first fork renamed when it reads an earlier lifted run's output.

    Adjacent runs (a chain of identity blocks split where the block computation changes, e.g. an
    activation inside the branch in one block and none in the next) chain: the second run's fork
    is the first run's output node, which lifting erased in favour of the stage call.
    """
    first = run.blocks[0]
    if first.fork not in renamed:
        return run
    fork = renamed[first.fork]
    return dataclasses.replace(run, blocks=(dataclasses.replace(first, fork=fork), *run.blocks[1:]))


def extract_split_run(gm: fx.GraphModule, run: Run) -> SplitParts:
    """One template, slots and knot stacks per sub-field of a run of period p (see :class:`SplitParts`).

    Sub-field i is extracted as the period-1 run of blocks i, i + p, i + 2p, ...; their forks read
    the other fields' outputs, so containment is checked for the whole run instead.
    """
    p = run.period
    glues = _field_glues(gm, run)
    subruns = [dataclasses.replace(run, blocks=run.blocks[i::p], period=1, glue=()) for i in range(p)]
    fields = tuple(
        extract_run(gm, sub, contained_in=run, glue=glue) for sub, glue in zip(subruns, glues, strict=True)
    )
    return SplitParts(fields, tuple(sub.form for sub in subruns))


def _field_glues(gm: fx.GraphModule, run: Run) -> list[FieldGlue | None]:
    """Each sub-field's glue (:mod:`odeify.passes.glue`), None for all when the run has none."""
    if not run.glue:
        return [None] * run.period
    try:
        glues = field_glues(gm, run)
    except GlueError as why:
        raise NotLiftable(str(why)) from why
    for glue, block in zip(glues, run.blocks[: run.period], strict=True):
        if not glue.empty and (block.kind, block.form) != ("identity", "pre"):
            raise NotLiftable(
                f"the sub-block ending at '{block.join}' sees the state through layout nodes, which a "
                f"template holds only for an identity block x + f(x), not a {block.kind} {block.form} one"
            )
    return [None if glue.empty else glue for glue in glues]


def extract_run(
    gm: fx.GraphModule, run: Run, *, contained_in: Run | None = None, glue: FieldGlue | None = None
) -> RunParts:
    """Template graph, slots, stacked tensors and per-block module variants of one run.

    The blocks are walked in step over their core nodes (pass-through calls skipped, as the runs
    analysis compares them); each block's pass-through calls are put back on the edge they sit on.
    ``contained_in`` is the run whose nodes must not leak out (default ``run``; a split run's
    sub-field is checked as the whole run). ``glue``: the layout nodes a split run's sub-field
    applies around its sub-block (:mod:`odeify.passes.glue`). A period-1 run's glue between its
    blocks needs none (each block sees the state's layout): it is only checked to be the identity.
    """
    if run.period > 1:
        raise NotLiftable(f"a run of period {run.period} is lifted by extract_split_run, not extract_run")
    if run.glue:
        _field_glues(gm, run)
    nodes = {n.name: n for n in gm.graph.nodes}
    modules = dict(gm.named_modules())
    outer = contained_in or run
    outer_members = {n.name for b in outer.blocks for n in block_node_list(b, nodes)}
    outer_members = run_members(gm, outer, outer_members)
    _check_contained(outer, outer_members, nodes, live_nodes(gm.graph))
    cores = [core_nodes(b, nodes, modules) for b in run.blocks]
    if len({len(core) for core in cores}) != 1:
        raise NotLiftable("the blocks' graphs differ in size; they cannot share one template")
    return _TemplateBuilder(gm, run, nodes, modules, glue).build(cores)


class _TemplateBuilder:
    """Builds one run's block template by walking its blocks in step, lifting what they read.

    What differs between the blocks becomes a slot: a tensor read by ``get_attr`` (stacked per block,
    or one shared value), a float that differs (a buffer); a module call becomes a template module,
    with each block's own module kept as a variant where they differ.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        run: Run,
        nodes: dict[str, fx.Node],
        modules: dict[str, nn.Module],
        glue: FieldGlue | None = None,
    ):
        self.gm, self.run, self.modules, self.glue = gm, run, modules, glue
        self.members = [{n.name for n in block_node_list(b, nodes)} for b in run.blocks]
        self.forks = [nodes[b.fork] for b in run.blocks]
        self.scopes = [b.scope for b in run.blocks]
        self.join = nodes[run.blocks[0].join]
        self.data = data_nodes(gm.graph)
        self.shape_reads = shape_nodes(gm.graph, self.data)
        self.graph = fx.Graph()
        self.x = self.graph.placeholder("x")
        # with glue, x is the state where it has its own layout; glue maps it to the block's input
        starts = glue.states if glue else [(fork,) for fork in self.forks]
        self.env: list[dict[fx.Node | tuple, object]] = [dict.fromkeys(nodes, self.x) for nodes in starts]
        self.slots: list[Slot] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.slot_nodes: dict[str, fx.Node] = {}
        self.template_modules: dict[str, nn.Module] = {}
        self.variants: dict[str, list[nn.Module]] = {}
        self.origins: dict[str, list[str]] = {}
        self.inputs: list[fx.Node] = []  # the template's constant-input placeholders, in order

    def build(self, cores: list[list[fx.Node]]) -> RunParts:
        """The template: each core node of the first block, lifted with its peers in the others."""
        graph, run = self.graph, self.run
        branch_operand = None
        if self.glue:
            self.lift_glue(self.glue.into, self.x)
        for position, node in enumerate(cores[0]):
            peers = [core[position] for core in cores]
            if node is self.join:
                shortcut = _shortcut_position(node, self.forks[0], self.modules)
                branch = 1 - shortcut
                branch_operand = self.lift_arg([p.args[branch] for p in peers], f"{node.name}.{branch}")
                if self.glue:  # the update back in the state's layout (identity blocks only)
                    branch_operand = self.lift_glue(self.glue.back, branch_operand)
                # out of place, even for iadd; a scaled shortcut (x * s) is a node of the block
                base = (
                    self.x
                    if run.blocks[0].kind == "identity"
                    else self.lift_arg([p.args[shortcut] for p in peers], "")
                )
                new = graph.call_function(operator.add, (base, branch_operand))
            else:
                args = self.lift_arg([p.args for p in peers], f"{node.name}")
                kwargs = self.lift_arg([p.kwargs for p in peers], f"{node.name}")
                name = _local_name(node, self.scopes[0])
                if node.op == "call_module" and _holds_tensors(self.modules[node.target]):
                    new = self.opaque_call(peers, args, kwargs, name)
                else:
                    target = self.add_module(peers) if node.op == "call_module" else node.target
                    new = graph.create_node(node.op, target, args, kwargs, name=name)
            for e, p in zip(self.env, peers, strict=True):
                e[p] = new
        graph.output((branch_operand, self.env[0][cores[0][-1]]))
        template = fx.GraphModule(self.template_modules, graph, f"{stage_attribute(run)}_template")
        inputs = tuple(node.name for node in self.inputs)
        return RunParts(template, self.slots, self.tensors, self.variants, self.origins, inputs)

    def new_slot(self, base: str, kind: str, values: list[torch.Tensor]) -> fx.Node:
        name = unique_name(slot_name(base), self.tensors)
        self.slots.append(Slot(name, kind))
        self.tensors[name] = (
            values[0].detach().clone() if kind == "shared" else torch.stack([v.detach() for v in values])
        )
        anchor = (
            self.slot_nodes[self.slots[-2].name] if len(self.slots) > 1 else (self.inputs or [self.x])[-1]
        )
        with self.graph.inserting_after(anchor):
            placeholder = self.graph.placeholder(name)
        self.slot_nodes[name] = placeholder
        return placeholder

    def constant_input(self, node: fx.Node) -> fx.Node:
        """A placeholder for ``node``, read alike by every block from outside the run: a stage input.

        It comes after ``x`` and before the slots, named as ``node`` (the stage call passes ``node``
        there). Only a value that needs no gradient can be one: the memory-saving backward modes
        re-run the stage with it as a constant.
        """
        trainable = [w.target for w in _attributes_read(node) if _is_trainable(fetch_attr(self.gm, w.target))]
        if trainable:
            raise NotLiftable(
                f"every block reads '{node.name}', computed outside the run from the trainable "
                f"{', '.join(trainable)}: a stage takes only constant inputs"
            )
        with self.graph.inserting_after((self.inputs or [self.x])[-1]):
            placeholder = self.graph.placeholder(node.name)
        if placeholder.name != node.name:
            raise NotLiftable(f"the block template already has a node named '{node.name}'")
        self.inputs.append(placeholder)
        for e in self.env:
            e[node] = placeholder
        return placeholder

    def add_module(self, peers: list[fx.Node | None]) -> str:
        """The template path for one module call of every block (None: the block makes no such call)."""
        owner = next(i for i, p in enumerate(peers) if p is not None)
        peer_modules = [self.modules[p.target] if p is not None else nn.Identity() for p in peers]
        if any(True for _ in peer_modules[owner].parameters()):
            raise NotLiftable(opaque_weights_reason(peers[owner].target, peer_modules[owner]))
        target = _relative(peers[owner].target, self.scopes[owner])
        if self.template_modules.get(target, peer_modules[owner]) is not peer_modules[owner]:
            target = unique_name(target, self.template_modules)
        self.template_modules[target] = peer_modules[owner]
        if len({repr(m) for m in peer_modules}) > 1:
            self.variants[target.replace(".", "__")] = peer_modules
        return target

    def opaque_call(self, peers: list[fx.Node], args: tuple, kwargs: dict, name: str) -> fx.Node:
        """A call of a module fx keeps whole (ConViT's GPSA, an ``nn.LSTM``) whose weights differ per block:
        ``functional_call(module, {its tensors at t}, args)``, each tensor a slot of the blocks' own.

        The template holds one copy of the first block's module without its tensors (empty
        non-persistent buffers in their place: the stage's knots are the only copy); the blocks'
        modules must be of one class and configuration, with tensors of one name and shape.
        """
        modules = [self.modules[p.target] for p in peers]
        first, path = modules[0], peers[0].target
        if any(repr(m) != repr(first) or _tensor_shapes(m) != _tensor_shapes(first) for m in modules):
            raise NotLiftable(
                f"{opaque_weights_reason(path, first)} Its blocks' {type(first).__name__} modules differ "
                "in configuration or in their tensors' shapes: no one module can take each block's weights."
            )
        target = unique_name(_relative(path, self.scopes[0]), self.template_modules)
        shell, keys = _without_tensors(first), _weight_keys(first)
        _check_shell(shell, keys, modules, peers)
        self.template_modules[target] = shell
        weights = []
        for key in keys:
            values = [_tensor_at(m, key) for m in modules]
            kind = "param" if _is_trainable(values[0]) else "buffer"  # never by value: load rebuilds
            weights.append(self.new_slot(f"{target}.{key}", kind, values))
            self.origins[self.slots[-1].name] = [f"{p.target}.{key}" for p in peers]
        module = self.graph.get_attr(target)
        call = (module, keys, weights, tuple(args), kwargs)
        return self.graph.call_function(call_with_weights, call, name=name)

    def lift_glue(self, segments: tuple[tuple[Segment, ...], ...], value: fx.Node) -> fx.Node:
        """Apply one sub-field's glue segments (one tuple per block, all alike) to ``value``.

        Each segment reads a sub-block's output in the network; here it reads ``value``, the state
        or update the template holds. Glue nodes are named ``glue_<node>`` in the template.
        """
        for position in range(len(segments[0])):
            peers = [blocks[position] for blocks in segments]
            for e, segment in zip(self.env, peers, strict=True):
                e[segment.source] = value
            for depth, node in enumerate(peers[0].nodes):
                values = [segment.nodes[depth] for segment in peers]
                value = self._copy_in_step(values, f"glue_{node.name}")
        return value

    def _copy_in_step(self, values: list[fx.Node], name: str | None) -> fx.Node:
        """One template node for the peer nodes ``values`` (a glue node or a shape read in every block);
        ``name`` None: a shape read's (:meth:`_shape_read_name`)."""
        first = values[0]
        if any((v.op, v.target) != (first.op, first.target) for v in values):
            raise NotLiftable(f"'{first.name}' and its peers in the other blocks compute different things")
        args = self.lift_arg([v.args for v in values], first.name)
        kwargs = self.lift_arg([v.kwargs for v in values], first.name)
        name = name or self._shape_read_name(first)
        new = self.graph.create_node(first.op, first.target, args, kwargs, name=name)
        for e, v in zip(self.env, values, strict=True):
            e[v] = new
        return new

    def _shape_read_name(self, node: fx.Node) -> str:
        """``x_shape`` for ``x.shape``, ``x_shape_0`` for ``x.shape[0]``; else the node's own name."""
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if source is not None and source in self.env[0]:
            if is_metadata_query(node) and node.op == "call_function":
                return f"{self.env[0][source].name}_{node.args[1]}"
            if node.target is operator.getitem and isinstance(node.args[1], int):
                return f"{self.env[0][source].name}_{node.args[1]}"
        return _local_name(node, self.scopes[0])

    def lift_node(self, values: list[fx.Node]):
        first, env = values[0], self.env
        if first in env[0]:
            return env[0][first]
        if first.name in self.shape_reads and self._reads_state(first):
            return self._copy_in_step(values, None)  # x.shape[0] of the block's or the glue's state
        if first.op == "get_attr":
            key = ("attr", first.name)
            if key not in env[0]:
                tensors_k = [fetch_attr(self.gm, v.target) for v in values]
                relative = _relative(first.target, self.scopes[0])
                env[0][key] = _tensor_slot(self.new_slot, relative, tensors_k)
                self.origins[self.slots[-1].name] = [v.target for v in values]
                for e, v in zip(env[1:], values[1:], strict=True):
                    e[("attr", v.name)] = env[0][key]
            return env[0][key]
        if first.name not in self.data and all(v is first for v in values):
            return self.constant_input(first)
        raise NotLiftable(f"block reads '{first.name}', computed outside the block")

    def _reads_state(self, node: fx.Node) -> bool:
        """``node`` is computed from shape reads of values the template holds (its state, the glue's)."""
        stack, seen = [node], set()
        while stack:
            current = stack.pop()
            if current in self.env[0] or current in seen:
                continue
            seen.add(current)
            if current.name in self.data:
                return False
            stack.extend(current.all_input_nodes)
        return True

    def lift_arg(self, values: list, path: str):
        first = values[0]
        if isinstance(first, fx.Node):
            return self._lift_with_pass_through(values)
        if isinstance(first, (tuple, list)):
            return type(first)(
                self.lift_arg([v[i] for v in values], f"{path}.{i}") for i in range(len(first))
            )
        if isinstance(first, dict):
            return {k: self.lift_arg([v[k] for v in values], f"{path}.{k}") for k in first}
        if isinstance(first, slice):  # x[:, :H] after Swin's window_reverse: H is a node
            parts = ("start", "stop", "step")
            return slice(*(self.lift_arg([getattr(v, p) for v in values], f"{path}.{p}") for p in parts))
        if isinstance(first, float) and any(v != first for v in values):
            stacked = [torch.tensor(v, dtype=model_dtype(self.gm)) for v in values]
            return self.new_slot(f"const_{path}", "buffer", stacked)
        return first

    def _lift_with_pass_through(self, values: list[fx.Node]):
        """A node operand, with each block's pass-through calls on that edge put back."""
        sources = [pass_through_source(v, m, self.modules) for v, m in zip(values, self.members, strict=True)]
        value = self.lift_node([source for source, _ in sources])
        chains = [chain for _, chain in sources]
        for depth in range(max(len(chain) for chain in chains)):
            peers = [chain[depth] if depth < len(chain) else None for chain in chains]
            owner = next(i for i, p in enumerate(peers) if p is not None)
            target = self.add_module(peers)
            name = _local_name(peers[owner], self.scopes[owner])
            value = self.graph.create_node("call_module", target, (value,), name=name)
        return value


def _move_fold_records(gm: fx.GraphModule, stage: StageIR, parts: RunParts | SplitParts, scope: str) -> None:
    """Stack the fold records of the run's blocks into the stage, as its knots are stacked.

    A record moves when both tensors it describes became ``param`` slots, one block each; the
    blocks' own records leave ``gm.folds`` either way (their tensors now live in the stage). A split
    stage's fields are moved one by one, under the names the stage gave their slots.
    """
    if isinstance(parts, RunParts):
        _move_field_records(gm, stage, parts, scope, {})
        return
    offset = 0
    for field in parts.fields:
        names = [slot.name for slot in stage.slots[offset : offset + len(field.slots)]]
        offset += len(field.slots)
        renamed = dict(zip((slot.name for slot in field.slots), names, strict=True))
        _move_field_records(gm, stage, field, scope, renamed)


def _move_field_records(
    gm: fx.GraphModule, stage: StageIR, parts: RunParts, scope: str, renamed: dict[str, str]
) -> None:
    """:func:`_move_fold_records` for one field; ``renamed`` maps its slot names to the stage's."""
    records = fold_records(gm)
    if not records:
        return
    kinds = {slot.name: slot.kind for slot in parts.slots}
    slot_of = {
        (target, block): name
        for name, targets in parts.origins.items()
        for block, target in enumerate(targets)
    }
    by_scaled = {record.scaled: key for key, record in records.items()}
    for name, targets in parts.origins.items():
        keys = [by_scaled.get(target) for target in targets]
        if None in keys or kinds[name] != "param":
            continue
        blocks = [records[key] for key in keys]
        shifted = {slot_of.get((record.shifted, block)) for block, record in enumerate(blocks)}
        if len(shifted) != 1 or None in shifted or kinds[next(iter(shifted))] != "param":
            continue
        (bias,) = shifted
        first = blocks[0]
        stacked = {
            part: torch.stack([getattr(record, part) for record in blocks])
            for part in ("gamma", "inv_std", "offset")
        }
        record = FoldRecord(
            **stacked,
            kind=first.kind,
            scaled=f"knots.{renamed.get(name, name)}",
            shifted=f"knots.{renamed.get(bias, bias)}",
            norm=first.norm,
            learnable=all(record.learnable for record in blocks),
        )
        add_fold_record(
            stage, unique_name(record_key(_relative(first.norm, scope)), fold_records(stage)), record
        )
    lifted = {target for targets in parts.origins.values() for target in targets}
    container = getattr(gm, FOLDS)
    for key, record in records.items():
        if record.scaled in lifted or record.shifted in lifted:
            del container[key]


def _shortcut_position(join: fx.Node, fork: fx.Node, modules: dict[str, nn.Module]) -> int:
    """Which operand of the join is the shortcut: the fork itself, or the fork times a scale."""
    for position, operand in enumerate(join.args):
        if fork in identity_sources(operand, modules):
            return position
    for position, operand in enumerate(join.args):
        if any(isinstance(a, fx.Node) and fork in identity_sources(a, modules) for a in operand.args):
            return position
    raise NotLiftable(f"the join '{join.name}' has no shortcut from '{fork.name}'")


def slot_name(path: str) -> str:
    """A Python identifier for a slot, from a module path: 'conv1.weight' -> 'conv1_weight'.

    Slot names are the template's argument names in emitted code, so a path that starts with an
    ``nn.Sequential`` index ('0.weight', ConvMixer) gets a leading underscore: '_0_weight'.
    """
    name = re.sub(r"\W", "_", path)
    return name if name.isidentifier() and not keyword.iskeyword(name) else f"_{name}"


def _check_contained(run: Run, members: set[str], nodes: dict[str, fx.Node], live: set[str]) -> None:
    """Refuse a run whose nodes feed anything outside it but through its last output.

    Lifting erases the run's nodes and everything hanging off them; a live outside user (a feature
    tap, glue between blocks) would be erased with them. The run's value leaves by its last block's
    output, or by the glue after it (:func:`odeify.passes.glue.run_end`).
    """
    last = run_end(run, nodes).name
    for name in members - {last}:
        outside = [u.name for u in nodes[name].users if u.name not in members and u.name in live]
        if outside:
            raise NotLiftable(f"'{name}' inside the run is also read by {', '.join(outside)} outside it")


def call_with_weights(
    module: nn.Module, keys: Sequence[str], weights: Sequence[torch.Tensor], args: tuple, kwargs: dict
) -> object:
    """``module(*args, **kwargs)`` with its tensors ``keys`` set to ``weights`` for this call alone."""
    return torch.func.functional_call(module, dict(zip(keys, weights, strict=True)), args, kwargs)


def _check_shell(
    shell: nn.Module, keys: tuple[str, ...], modules: list[nn.Module], calls: list[fx.Node]
) -> None:
    """One copy called with each block's tensors computes what that block's own module does; else the
    run is not liftable. A module whose output depends on more than its tensors (EfficientViT's
    attention caches the biases it gathers in eval mode) would give every block the first one's.

    Judged with seeded random tensors in [0.5, 1.5), not the blocks' own, on seeded inputs of the
    call's traced shapes, caches cleared first (``train()``, as timm clears them), so the verdict
    depends on the module's code alone: ``load`` rebuilds the model with other weights and must lift
    the same runs.
    """
    generator = torch.Generator().manual_seed(0)

    def sample(value: object) -> object:
        if not isinstance(value, fx.Node):
            return value
        meta = value.meta.get("tensor_meta")
        if meta is None:
            return _traced_number(value)
        if not meta.dtype.is_floating_point:
            raise NotLiftable(f"'{value.name}', which a module kept whole reads, is no float tensor")
        return torch.randn(meta.shape, generator=generator, dtype=meta.dtype)

    def fresh(module: nn.Module) -> nn.Module:
        return module.train().eval()

    fresh(shell)
    for module, call in zip(modules, calls, strict=True):
        args, kwargs = fx.node.map_aggregate((call.args, call.kwargs), sample)
        weights = [
            torch.rand(t.shape, generator=generator, dtype=t.dtype) + 0.5
            for t in (_tensor_at(module, key) for key in keys)
        ]
        with torch.no_grad():
            want = call_with_weights(fresh(copy.deepcopy(module)), keys, weights, args, kwargs)
            got = call_with_weights(shell, keys, weights, args, kwargs)
        same = [torch.equal(g, w) for g, w in zip(_tensors_of(got), _tensors_of(want), strict=True)]
        if not same or not all(same):
            raise NotLiftable(
                f"module '{call.target}' ({type(module).__name__}) is kept whole, and one copy of it given "
                "each block's tensors does not compute what each block's own does (it keeps more state "
                "than its tensors, such as a cache), so no stage can take its weights"
            )


def _traced_number(node: fx.Node) -> object:
    """The value a shape expression had when traced (Twins' ``H // 2`` passed to its attention), from
    the shapes the trace recorded; a NotLiftable where ``node`` is no such expression."""
    if is_metadata_query(node) and node.op == "call_function" and node.args[1] == "shape":
        return torch.Size(node_shape(node.args[0]))
    if node.op == "call_function" and getattr(node.target, "__module__", "") == "_operator":
        return node.target(*fx.node.map_aggregate(node.args, _traced_value))
    raise NotLiftable(f"'{node.name}', which a module kept whole reads, has no value the trace recorded")


def _traced_value(value: object) -> object:
    return _traced_number(value) if isinstance(value, fx.Node) else value


def _tensors_of(value: object) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or an LSTM's nested tuple)."""
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else v)
    return found


def _holds_tensors(module: nn.Module) -> bool:
    """A module with parameters or float buffers: a block's own weights, which a stage takes as slots."""
    return bool(_weight_keys(module))


def _weight_keys(module: nn.Module) -> tuple[str, ...]:
    """The names of a module's parameters and floating-point buffers (a BatchNorm's step count is none)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return tuple(key for key, tensor in tensors if tensor.is_floating_point())


def _tensor_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(t.shape) for key, t in [*module.named_parameters(), *module.named_buffers()]}


def _tensor_at(module: nn.Module, key: str) -> torch.Tensor:
    owner, _, name = key.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)


def _without_tensors(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are empty non-persistent buffers: a shell
    that ``functional_call`` fills with a stage time's weights (and a stage's state dict leaves out)."""
    shell = copy.deepcopy(module)
    for key in _weight_keys(module):
        tensor = _tensor_at(module, key)
        owner, _, name = key.rpartition(".")
        sub = shell.get_submodule(owner) if owner else shell
        sub._parameters.pop(name, None)
        sub._buffers.pop(name, None)
        sub.register_buffer(name, tensor.new_empty(0), persistent=False)
    return shell


def _attributes_read(node: fx.Node) -> list[fx.Node]:
    """The ``get_attr`` nodes that ``node`` is computed from, transitively (not through shape reads)."""
    found: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "get_attr":
            found.append(current)
        if not is_metadata_query(current):  # x.shape reads no tensor of x's
            stack.extend(current.all_input_nodes)
    return found


def _is_trainable(value: object) -> bool:
    """A parameter that takes gradients: a ``param`` slot, never a shared or buffer one."""
    return isinstance(value, nn.Parameter) and value.requires_grad


def _tensor_slot(new_slot, relative: str, values: list[torch.Tensor]) -> fx.Node:
    if _is_trainable(values[0]):
        return new_slot(relative, "param", values)
    if all(torch.equal(values[0], v) for v in values[1:]):
        return new_slot(relative, "shared", values)
    return new_slot(relative, "buffer", values)


def _local_name(node: fx.Node, scope: str) -> str:
    """A template node's name without the block's module path: 'layer3_1_act1' -> 'act1'."""
    if node.op == "call_module":
        return _relative(node.target, scope).replace(".", "_")
    prefix = scope.replace(".", "_") + "_"
    return node.name[len(prefix) :] if scope and node.name.startswith(prefix) else node.name


def _relative(target: str, scope: str) -> str:
    return target[len(scope) + 1 :] if scope and target.startswith(scope + ".") else target


def _replace_run(
    gm: fx.GraphModule, run: Run, attribute: str, stage: StageIR, inputs: Sequence[str]
) -> fx.Node:
    """Swap the run's nodes for one ``call_module`` of the stage, given its state and constant ``inputs``."""
    nodes = {n.name: n for n in gm.graph.nodes}
    gm.add_submodule(attribute, stage)
    fork = nodes[run.blocks[0].fork]
    last = run_end(run, nodes)
    with gm.graph.inserting_before(last):
        call = gm.graph.call_module(attribute, (fork, *(nodes[name] for name in inputs)))
    tag(call, stage=run.name, role="stage")
    call.meta["tensor_meta"] = last.meta.get("tensor_meta")
    last.replace_all_uses_with(call)
    doomed: list[fx.Node] = [nodes[name] for name in run.glue]
    for block in run.blocks:
        doomed.extend(block_node_list(block, nodes))
    _erase_with_side_chains(gm.graph, doomed)
    if run.glue:
        _erase_unused_shape_reads(gm.graph, fork)
    return call


def _erase_unused_shape_reads(graph: fx.Graph, node: fx.Node) -> None:
    """Erase the shape reads of ``node`` (``B, H, W, C = x.shape``) that only the erased glue used."""

    def erase_if_unused(read: fx.Node) -> None:
        for user in list(read.users):
            if user.op == "call_function" and getattr(user.target, "__module__", "") == "_operator":
                erase_if_unused(user)  # x.shape[0], H // 7: pure arithmetic on the read
        if not read.users:
            graph.erase_node(read)

    for read in [user for user in node.users if is_metadata_query(user)]:
        erase_if_unused(read)


def _erase_with_side_chains(graph: fx.Graph, doomed: list[fx.Node]) -> None:
    """Erase nodes plus dead users hanging off them (``torch._assert`` side chains)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    pending = set(doomed)
    stack = list(doomed)
    while stack:
        for user in stack.pop().users:
            if user not in pending:
                pending.add(user)
                stack.append(user)
    for node in sorted(pending, key=order.__getitem__, reverse=True):
        graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)


def prune_unused_attributes(gm: fx.GraphModule) -> None:
    """Drop submodules, then parameters and buffers, that no node references any more.

    Submodules first: a module the graph called whole (a lifted run's opaque GPSA or LSTM) is the
    source's own object, so it is detached from ``gm``, never emptied in place.
    """
    gm.delete_all_unused_submodules()
    used = {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}

    def referenced(path: str) -> bool:
        return any(u == path or u.startswith(path + ".") or path.startswith(u + ".") for u in used)

    for name, _ in list(gm.named_parameters(remove_duplicate=False)) + list(
        gm.named_buffers(remove_duplicate=False)
    ):
        if not referenced(name):
            owner, attr = owner_of(gm, name)
            if attr in owner._parameters:
                del owner._parameters[attr]
            elif attr in owner._buffers:
                del owner._buffers[attr]
