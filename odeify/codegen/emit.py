"""Write an ODE stage's computation as fx nodes: weights at stage times, the field, the steps.

One writer serves both uses: the ``lower`` pass inlines a whole stage into a model graph, and
:meth:`ODEStage.step_graph` builds one-step graphs that run eagerly and are re-run by the
adjoint modes. Coefficients are exact Fractions from the basis; a one-hot row references its knot
directly, so native-depth Euler adds no arithmetic to the original network.

A graph built for a stage to run by itself comes as a :class:`StepGraph`, which says which knot
rows it reads, and is cached on the stage (one :class:`GraphCache` per stage, rebuilt when
:meth:`StageIR.graph_signature` changes) under this module's lock.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.fx as fx

from odeify.ir.meta import tag
from odeify.ir.stage_ir import Slot, StageIR, template_inputs
from odeify.numerics.schemes import Add, Evaluate, Op, Reflect, ReversibleScheme
from odeify.numerics.tableaus import TABLEAUS, Splitting, Tableau

DENSE_MIX_ABOVE = 4  # rows with more nonzero coefficients use one tensordot instead of a sum


class StageWriter:
    """Emits nodes for one stage into ``graph``.

    ``prefix`` is the stage's attribute path as seen from the graph's owner module ("" when the
    owner is the stage itself). ``knot_inputs`` maps slot names to nodes holding the stacked knots:
    placeholders in a step graph; by default get_attr nodes of the stage's own stacks, emitted at
    the graph's insertion point. ``window`` says which knots those stacks hold (all unless given).
    ``inputs`` maps the stage's constant inputs (:attr:`StageIR.inputs`) to the nodes holding them.
    ``used_knots`` collects the knots read.
    """

    def __init__(
        self,
        stage: StageIR,
        graph: fx.Graph,
        prefix: str,
        knot_inputs: dict[str, fx.Node] | None = None,
        window: slice | None = None,
        inputs: dict[str, fx.Node] | None = None,
    ):
        self.stage = stage
        self.inputs = inputs or {}
        self.graph = graph
        self.prefix = f"{prefix}." if prefix else ""
        self.tag = stage.stage_name.replace(".", "_")
        self.window = window or slice(0, stage.num_knots)
        self.used_knots: set[int] = set()
        self.knot_inputs = self._own_knots() if knot_inputs is None else knot_inputs
        self._weights: dict[tuple, list[fx.Node]] = {}
        self._fields: dict[tuple, fx.Node] = {}
        self._knots: dict[tuple[str, int], fx.Node] = {}
        self._unbound: dict[str, fx.Node] = {}
        self._weight_nodes: list[fx.Node] = []  # knot reads and mixes, in the order made
        self.evaluations = 0
        self.field_writers: list[StageWriter] | None = None  # a split stage's, made by field_writers()

    def _own_knots(self) -> dict[str, fx.Node]:
        """get_attr nodes of the stage's own knot stacks; at a step count the stage holds a correction
        for, each trainable stack detached plus its correction (as :meth:`StageIR.knot_tensors`)."""
        stage = self.stage
        correction = stage.correction()
        stacks = {}
        for slot in stage.slots:
            if slot.kind == "shared":
                continue
            name = f"{self.tag}_{slot.name}"
            stack = self.attr(stage.slot_attr(slot), name)
            if correction is not None and slot.name in correction:
                fixed = self.node("call_method", "detach", (stack,), name=f"{name}_fixed")
                delta = self.attr(stage.correction_attr(slot), f"{name}_correction")
                stack = self.node("call_function", operator.add, (fixed, delta), name=f"{name}_corrected")
            stacks[slot.name] = stack
        return stacks

    # -- node creation -------------------------------------------------------------------------
    def node(
        self, op: str, target, args: tuple, kwargs: dict | None = None, name: str | None = None
    ) -> fx.Node:
        created = self.graph.create_node(op, target, args, kwargs or {}, name=name)
        tag(created, stage=self.stage.stage_name)
        return created

    def _weight_node(self, op: str, target, args: tuple, kwargs: dict | None = None, name: str | None = None):
        created = self.node(op, target, args, kwargs, name)
        self._weight_nodes.append(created)
        return created

    def sink_weights(self) -> None:
        """Move each knot read (``unbind``, its items, their mixes) to just before its first use.

        Autograd runs a backward node after those made later in forward, so a knot ``unbind`` at the
        graph's top runs last: every knot gradient of the graph waits in its buffer until the end. Read
        where it is used, a knot's gradient reaches its stack (and the runtime's accumulator) as soon
        as its use is differentiated, and the next one's is made after that one is freed (resnet18 at
        32x32, batch 64, where weights outweigh activations: a checkpointed step's peak 32.0 MiB with
        two 9 MiB conv gradients and a stacked copy alive, 14.3 MiB now, timm checkpointing's 24.3).
        """
        nodes = self.graph.nodes
        for made in reversed(self._weight_nodes):
            first_use = next((n for n in nodes if n in made.users), None)
            if first_use is not None:
                first_use.prepend(made)

    def attr(self, path: str, name: str) -> fx.Node:
        return self.node("get_attr", f"{self.prefix}{path}", (), name=name)

    # -- weights at a stage time ---------------------------------------------------------------
    def weights(self, t: Fraction, left: bool) -> list[fx.Node]:
        """One node per template slot: the weight path theta(t) (or theta(t-) when ``left``)."""
        row = self.stage.row(t, left)
        if row not in self._weights:
            self._weights[row] = [self._slot_weight(slot, row) for slot in self.stage.slots]
        return self._weights[row]

    def _slot_weight(self, slot: Slot, row: tuple[Fraction, ...]) -> fx.Node:
        if slot.kind == "shared":
            return self.attr(self.stage.slot_attr(slot), slot.name)
        stack = self.knot_inputs[slot.name]
        nonzero = [(k, c) for k, c in enumerate(row) if c != 0]
        self.used_knots.update(k for k, _ in nonzero)
        if len(nonzero) == 1 and nonzero[0][1] == 1:
            return self._knot(slot, nonzero[0][0])
        label = f"{self.tag}_{slot.name}_mix"
        if len(nonzero) > DENSE_MIX_ABOVE:
            # the row's coefficients over the window, as a constant list: no buffer to keep in sync
            window_row = [float(c) for c in row[self.window]]
            coeffs = self._weight_node(
                "call_method", "new_tensor", (stack, window_row), name=f"{label}_coeffs"
            )
            return self._weight_node(
                "call_function", torch.tensordot, (coeffs, stack), {"dims": 1}, name=label
            )
        total = None
        for k, c in nonzero:
            term = self._weight_node("call_function", operator.mul, (self._knot(slot, k), float(c)))
            total = (
                term
                if total is None
                else self._weight_node("call_function", operator.add, (total, term), name=label)
            )
        return total

    def _knot(self, slot: Slot, k: int) -> fx.Node:
        """Knot ``k`` of a slot, emitted once, from one ``unbind`` of the stack per slot (a
        ``squeeze`` where the graph reads one knot: a view, so its gradient is not copied).

        ``unbind`` has a single backward node, so all knots' gradients land in one buffer; indexing
        the stack per knot would allocate a stack-sized gradient for every use.
        """
        key = (slot.name, k)
        if key in self._knots:
            return self._knots[key]
        stack = self.knot_inputs[slot.name]
        name = f"{self.tag}_{slot.name}_k{k}"
        if self.window.stop - self.window.start == 1:
            # a one-row window: a view, whose gradient is the knot's own (unbind's would be a stacked copy)
            self._knots[key] = self._weight_node("call_method", "squeeze", (stack, 0), name=name)
            return self._knots[key]
        if slot.name not in self._unbound:
            self._unbound[slot.name] = self._weight_node(
                "call_function", torch.unbind, (stack,), name=f"{self.tag}_{slot.name}_knots"
            )
        self._knots[key] = self._weight_node(
            "call_function", operator.getitem, (self._unbound[slot.name], k - self.window.start), name=name
        )
        return self._knots[key]

    # -- the block and the field ---------------------------------------------------------------
    def block(self, t: Fraction, left: bool, y: fx.Node, tag: str) -> tuple[fx.Node, fx.Node]:
        """Inline the template at time ``t``: returns (branch f(y), block output); names end in ``tag``."""
        weights = iter(self.weights(t, left))
        variant = self.stage.variant_index(t, left)
        template = self.stage.template
        constant = set(template_inputs(template, len(self.stage.slots)))
        env: dict[fx.Node, fx.Node] = {}
        result = None
        for tnode in template.graph.nodes:
            if tnode.op == "placeholder":
                if not env:
                    env[tnode] = y
                else:
                    env[tnode] = self.inputs[tnode.name] if tnode.name in constant else next(weights)
            elif tnode.op == "output":
                result = fx.map_arg(tnode.args[0], env.__getitem__)
            else:
                target = tnode.target
                if tnode.op == "get_attr":  # a module a functional_call fills with the weights at t
                    target = f"{self.prefix}{self.stage.template_attr}.{target}"
                elif tnode.op == "call_module":
                    key = self.stage.variant_targets.get(target)
                    target = (
                        f"{self.prefix}variants.{key}.{variant}"
                        if key
                        else f"{self.prefix}{self.stage.template_attr}.{target}"
                    )
                args = fx.map_arg(tnode.args, env.__getitem__)
                kwargs = fx.map_arg(tnode.kwargs, env.__getitem__)
                env[tnode] = self.node(tnode.op, target, args, kwargs, name=f"{self.tag}_{tnode.name}_{tag}")
        branch, out = result
        return branch, out

    def field(self, t: Fraction, left: bool, y: fx.Node, tag: str) -> fx.Node:
        """F(t, y): ``L * (block(y) - y)`` for post-activation blocks, ``L * f(y)`` for pre-activation."""
        # an evaluation that draws random numbers (DropPath) is its own draw: never shared across steps
        key = (self.stage.field_weights(t, left), y, tag if self.stage.draws_random else None)
        if key not in self._fields:
            delta = self.delta(t, left, y, tag)
            self._fields[key] = self.node(
                "call_function", operator.mul, (delta, self.stage.depth), name=f"{self.tag}_F_{tag}"
            )
        return self._fields[key]

    def delta(self, t: Fraction, left: bool, y: fx.Node, tag: str) -> fx.Node:
        """F(t, y) / L, one new evaluation: ``block(y) - y``, or the branch ``f(y)`` (pre-activation)."""
        self.evaluations += 1
        branch, out = self.block(t, left, y, tag)
        if self.stage.form == "pre":
            return branch
        return self.node("call_function", operator.sub, (out, y), name=f"{self.tag}_delta_{tag}")

    def axpy(self, y: fx.Node, terms: list[tuple[Fraction, fx.Node]], name: str) -> fx.Node:
        """``y + sum(c * k)`` with zero terms skipped."""
        out = y
        for coef, k in terms:
            if coef == 0:
                continue
            term = k if coef == 1 else self.node("call_function", operator.mul, (k, float(coef)))
            out = self.node("call_function", operator.add, (out, term), name=name)
        return out


# -- integrators: one step each, written against a StageWriter ------------------------------------
def rk_step(w: StageWriter, tableau: Tableau, n: int, y: fx.Node, direction: int = 1) -> fx.Node:
    """One explicit Runge-Kutta step from step ``n``'s start (``direction=-1``: from its end, backward).

    Stage times are ``(n + c_i) / N`` forward and ``(n + 1 - c_i) / N`` backward; a time at the far
    end of the step takes the one-sided limit from inside the step, decided exactly.
    """
    steps = w.stage.steps
    h = Fraction(direction, steps)
    start = Fraction(n if direction > 0 else n + 1, steps)
    if direction > 0 and tableau.stages == 1 and tableau.b == (1,) and h * w.stage.depth == 1:
        w.evaluations += 1
        return w.block(start, False, y, f"s{n}")[1]  # x + (1/L) * L * (block(x) - x) is block(x), exactly
    ks: list[fx.Node] = []
    for i in range(tableau.stages):
        theta = tableau.c[i]
        t = start + h * theta
        left = (theta == 1) if direction > 0 else (theta == 0)
        terms = [(h * a, k) for a, k in zip(tableau.a[i][:i], ks, strict=True)]
        yi = w.axpy(y, terms, name=f"{w.tag}_y{n}_{i + 1}")
        ks.append(w.field(t, left, yi, f"s{n}_{i + 1}"))
    end = n + 1 if direction > 0 else n
    return w.axpy(y, [(h * b, k) for b, k in zip(tableau.b, ks, strict=True)], name=f"{w.tag}_x{end}")


# -- splitting schemes: one step of a stage of sub-fields (odeify.numerics.splitting) ---------------
def field_writers(w: StageWriter) -> list[StageWriter]:
    """One writer per sub-field of a split stage, on ``w``'s graph, knot inputs and window (made once)."""
    if w.field_writers is None:
        w.field_writers = [
            StageWriter(
                view,
                w.graph,
                w.prefix.removesuffix("."),
                {s.name: w.knot_inputs[s.name] for s in view.slots if s.kind != "shared"},
                w.window,
                w.inputs,
            )
            for view in w.stage.field_views()
        ]
    return w.field_writers


def split_step(w: StageWriter, scheme: Splitting, n: int, y: fx.Node, direction: int = 1) -> fx.Node:
    """One step of a splitting scheme from step ``n``'s start (``direction=-1``: from its end, backward).

    Each sub-step integrates one sub-field over its part of the step; backward, the sub-steps run
    in reverse order, each from its end. States between sub-steps are named ``x<n>_<k>_F<field>``.
    """
    writers = field_writers(w)
    h = Fraction(1, w.stage.steps)
    substeps = scheme.substeps(len(writers))
    ordered = substeps if direction > 0 else tuple(reversed(substeps))
    tableau = TABLEAUS[scheme.substep]
    for k, sub in enumerate(ordered, start=1):
        lo = (n + sub.start) * h
        hi = lo + sub.length * h
        begin, span = (lo, hi - lo) if direction > 0 else (hi, lo - hi)
        end = n + 1 if direction > 0 else n
        name = f"{w.tag}_x{end}" if k == len(ordered) else f"{w.tag}_x{n}_{k}_F{sub.field + 1}"
        y = _substep(writers[sub.field], tableau, begin, span, y, f"s{n}_{k}_F{sub.field + 1}", name)
    w.used_knots.update(*(fw.used_knots for fw in writers))
    w.evaluations = sum(fw.evaluations for fw in writers)
    return y


def _substep(
    w: StageWriter, tableau: Tableau, begin: Fraction, h: Fraction, y: fx.Node, tag: str, name: str
) -> fx.Node:
    """One explicit Runge-Kutta step of one sub-field from time ``begin`` over the signed length ``h``.

    A stage time on the sub-interval's upper end takes the left limit (from inside). A forward Euler
    sub-step over exactly one block's cell is that block, as in :func:`rk_step`.
    """
    depth = w.stage.depth
    if (
        h > 0
        and tableau.stages == 1
        and tableau.b == (1,)
        and h * depth == 1
        and (begin * depth).denominator == 1
    ):
        w.evaluations += 1
        return w.block(begin, False, y, tag)[1]
    top = max(begin, begin + h)
    ks: list[fx.Node] = []
    for i in range(tableau.stages):
        t = begin + h * tableau.c[i]
        terms = [(h * a, k) for a, k in zip(tableau.a[i][:i], ks, strict=True)]
        yi = w.axpy(y, terms, name=f"{w.tag}_y_{tag}_{i + 1}")
        ks.append(w.field(t, t == top, yi, f"{tag}_{i + 1}"))
    return w.axpy(y, [(h * b, k) for b, k in zip(tableau.b, ks, strict=True)], name=name)


# -- reversible schemes: a register program (odeify.numerics.schemes) written as float ops ----------
Registers = dict[str, fx.Node | None]
"""A reversible scheme's registers as graph nodes, by register name; None for one still at zero."""


@dataclass(frozen=True)
class _Reflection:
    """``factor * about - target``, not yet written (None is zero)."""

    factor: Fraction
    about: fx.Node | None
    target: fx.Node | None


@dataclass(frozen=True)
class _Pending:
    """A register's value not yet written: ``base + sum(coef * node for coef, node in terms)``."""

    base: fx.Node | _Reflection | None
    terms: tuple[tuple[Fraction, fx.Node], ...] = ()


def reversible_step(w: StageWriter, scheme: ReversibleScheme, n: int, registers: Registers) -> Registers:
    """Step ``n`` of a reversible scheme (its start ops first, at n = 0) as float ops: its register
    program, read op by op. An increment ``[l h/2 F]`` is ``l h/2 * F`` here (the lattice's rounding
    is the runtime's alone); each evaluation runs on its sub-field's writer on a split stage.

    Where values are rounded is the scheme's :attr:`~ReversibleScheme.rounds_each_op`. A register
    with a ``velocity`` is carried divided by h/2 under that name (ALF's p as v). Each register's
    value after the step is named ``<register>_<n+1>``, after sub-step k of a split step
    ``<register>_<n>_<k>_F<field>``, and ``..._part`` where it is written again within the (sub-)step;
    ``F_s<n>_<i>`` (``F_s<n>_<k>_F<field>_<i>``) is the (sub-)step's i-th evaluation.
    """
    writers = field_writers(w) if isinstance(w.stage.integrator, Splitting) else [w]
    program = _ProgramWriter(w, writers, scheme, registers)
    if n == 0 and scheme.start:
        program.write(scheme.start, 0, "start", "start", "0")
    parts = scheme.substeps
    for k, ops in enumerate(parts, start=1):
        field = next((op.field for op in ops if isinstance(op, Evaluate)), 0)
        label = f"{n}_{k}_F{field + 1}" if len(parts) > 1 else f"{n}"
        program.write(ops, n, f"s{label}", label, f"{n + 1}" if k == len(parts) else label)
    w.used_knots.update(*(fw.used_knots for fw in writers))
    w.evaluations = sum(fw.evaluations for fw in writers)
    return program.registers()


class _ProgramWriter:
    """The registers of one reversible step while its ops are written (see :func:`reversible_step`)."""

    def __init__(
        self, w: StageWriter, writers: list[StageWriter], scheme: ReversibleScheme, registers: Registers
    ) -> None:
        self.w, self.writers, self.scheme = w, writers, scheme
        self.h = Fraction(1, w.stage.steps)
        self.values: dict[str, fx.Node | _Pending | None] = dict(registers)
        self.scale = {r.name: self.h / 2 if r.velocity else Fraction(1) for r in scheme.registers}
        self.names = {r.name: r.velocity or r.name for r in scheme.registers}

    def registers(self) -> Registers:
        """Every register as one node (or None), after the ops written."""
        return {name: self._node(name, len(self.ops)) for name in self.values}

    def write(self, ops: tuple[Op, ...], n: int, tag: str, label: str, end: str) -> None:
        """One (sub-)step's ops from step ``n``'s start; evaluations tagged ``<tag>_<i>``, values named
        ``<register>_<label>_part`` within it and ``<register>_<end>`` after it."""
        self.ops, self.label, self.end = ops, label, end
        increments: dict[str, tuple[Fraction, fx.Node]] = {}
        for i, op in enumerate(ops):
            if isinstance(op, Evaluate):
                x = self._node(op.register, i - 1)
                at = (n + op.at) * self.h
                f = self.writers[op.field].field(at, op.left, x, f"{tag}_{len(increments) + 1}")
                increments[op.into] = (op.length * self.h / 2, f)
                continue
            if isinstance(op, Add):
                self._add(op, increments, i)
            else:
                self._reflect(op, increments, i)
            if self.scheme.rounds_each_op:
                self._node(op.target, i)
        for name in self.values:
            self._node(name, len(ops))

    def _add(self, op: Add, increments: dict[str, tuple[Fraction, fx.Node]], i: int) -> None:
        """``target += times * source``: one more term of the target's sum."""
        if op.source in increments:
            coef, node = increments[op.source]
        else:
            coef, node = self.scale[op.source], self._node(op.source, i - 1)
            if node is None:  # a register still at zero
                return
        target = self._sum(op.target)
        term = (op.times * coef / self.scale[op.target], node)
        self.values[op.target] = _Pending(target.base, (*target.terms, term))

    def _reflect(self, op: Reflect, increments: dict[str, tuple[Fraction, fx.Node]], i: int) -> None:
        """``target = 2 * about - target``: about's base reflected, the terms pending on it doubled."""
        target = self._node(op.target, i - 1)
        if op.about in increments:
            coef, node = increments[op.about]
            about = _Pending(node)
        else:
            coef, about = self.scale[op.about], self._sum(op.about)
            if isinstance(about.base, _Reflection):  # a reflection's centre is one node
                about = _Pending(self._node(op.about, i - 1))
        factor = 2 * coef / self.scale[op.target]
        terms = tuple((factor * c, node) for c, node in about.terms)
        self.values[op.target] = _Pending(_Reflection(factor, about.base, target), terms)

    def _sum(self, name: str) -> _Pending:
        value = self.values[name]
        return value if isinstance(value, _Pending) else _Pending(value)

    def _node(self, name: str, after: int) -> fx.Node | None:
        """Register ``name`` as one node, written now if pending, named for where op ``after`` leaves it."""
        value = self.values[name]
        if not isinstance(value, _Pending):
            return value
        again = any(not isinstance(op, Evaluate) and op.target == name for op in self.ops[after + 1 :])
        label = f"{self.w.tag}_{self.names[name]}_" + (f"{self.label}_part" if again else self.end)
        node = self.values[name] = self._written(value, label)
        return node

    def _written(self, value: _Pending, name: str) -> fx.Node | None:
        """``value`` as nodes: its base, then its terms added in order; the last node is ``name``."""
        w, terms, base = self.w, list(value.terms), value.base
        if isinstance(base, _Reflection):
            base = _reflected(w, base, None if terms else name)
        if base is None and terms:
            coef, base = terms.pop(0)
            if coef != 1:
                last = None if terms else name
                base = w.node("call_function", operator.mul, (base, float(coef)), name=last)
        for i, (coef, node) in enumerate(terms, start=1):  # as StageWriter.axpy, naming only the sum
            term = node if coef == 1 else w.node("call_function", operator.mul, (node, float(coef)))
            base = w.node("call_function", operator.add, (base, term), name=name if i == len(terms) else None)
        return base


def _reflected(w: StageWriter, r: _Reflection, name: str | None) -> fx.Node | None:
    """``factor * about - target`` as nodes (None is zero); the last is ``name``."""
    if r.about is None:
        return None if r.target is None else w.node("call_function", operator.neg, (r.target,), name=name)
    if r.target is None:
        return w.node("call_function", operator.mul, (r.about, float(r.factor)), name=name)
    scaled = r.about if r.factor == 1 else w.node("call_function", operator.mul, (r.about, float(r.factor)))
    return w.node("call_function", operator.sub, (scaled, r.target), name=name)


def summed_field(w: StageWriter, t: Fraction, left: bool, y: fx.Node) -> fx.Node:
    """F(t, y) of a split stage: the sum of its sub-fields."""
    total = None
    for i, fw in enumerate(field_writers(w), start=1):
        f = fw.field(t, left, y, f"t_F{i}")
        total = f if total is None else w.node("call_function", operator.add, (total, f), name=f"{w.tag}_F")
    w.used_knots.update(*(fw.used_knots for fw in field_writers(w)))
    w.evaluations = sum(fw.evaluations for fw in field_writers(w))
    return total


def write_stage(w: StageWriter, x: fx.Node) -> fx.Node:
    """The whole stage, unrolled: returns the node holding x(1)."""
    integrator = w.stage.integrator
    scheme = w.stage.reversible_scheme()
    if scheme is not None:
        registers: Registers = {r.name: x if r.start == "input" else None for r in scheme.registers}
        for n in range(w.stage.steps):
            registers = reversible_step(w, scheme, n, registers)
        return registers[scheme.output]
    if isinstance(integrator, Splitting):
        for n in range(w.stage.steps):
            x = split_step(w, integrator, n, x)
        return x
    for n in range(w.stage.steps):
        x = rk_step(w, integrator, n, x)
    return x


@dataclass(frozen=True)
class StepGraph:
    """A graph module built for a stage to run by itself, with what its runner must know.

    Its inputs are the state, then each knot stack's rows ``knot_window`` (the rows it reads; see
    :func:`odeify.runtime.rerun.knot_window_inputs`), then the stage's constant inputs
    (:attr:`StageIR.inputs`); ``evaluations`` counts its field evaluations.
    """

    module: fx.GraphModule
    knot_window: slice
    evaluations: int

    def __call__(self, *inputs: torch.Tensor):
        return self.module(*inputs)

    @property
    def code(self) -> str:
        """The Python the graph runs, for reading."""
        return self.module.code


def build_unrolled_graph(stage: StageIR) -> StepGraph:
    """A graph ``(x, knots...) -> x(1)``: the whole stage unrolled as lowering inlines it."""
    return _graph_over_knots(stage, "unrolled", ("x",), lambda w, x: write_stage(w, x))


def build_step_graph(stage: StageIR, n: int, kind: str) -> StepGraph:
    """A graph ``(state..., knots...) -> state`` for step ``n``, over the knots it reads.

    ``forward`` steps from n to n+1; ``reverse`` approximately rebuilds step n's start from its
    end by stepping backward (explicit tableaus; the reversible schemes are inverted exactly by
    :mod:`odeify.runtime.reversible` instead).
    """
    integrator = stage.integrator
    scheme = stage.reversible_scheme()
    if scheme is not None:
        if kind != "forward":
            raise ValueError(
                f"{integrator.name} has no {kind!r} step graph; odeify.runtime.reversible inverts it"
            )
        return _reversible_step_graph(stage, scheme, n)
    direction = 1 if kind == "forward" else -1
    if isinstance(integrator, Splitting):
        return _graph_over_knots(
            stage, f"{kind}_step{n}", ("x",), lambda w, x: (split_step(w, integrator, n, x, direction),)
        )
    return _graph_over_knots(
        stage, f"{kind}_step{n}", ("x",), lambda w, x: (rk_step(w, integrator, n, x, direction),)
    )


def _reversible_step_graph(stage: StageIR, scheme: ReversibleScheme, n: int) -> StepGraph:
    """Step ``n`` of a reversible scheme over its registers (placeholders named as the graph carries
    them); at step 0 a register that starts at zero is zero, whatever is passed for it."""
    layout = scheme.registers

    def write(w: StageWriter, *state: fx.Node) -> tuple[fx.Node | None, ...]:
        given = zip(layout, state, strict=True)
        registers = {r.name: None if n == 0 and r.start == "zero" else s for r, s in given}
        out = reversible_step(w, scheme, n, registers)
        return tuple(out[r.name] for r in layout)

    return _graph_over_knots(stage, f"forward_step{n}", tuple(r.velocity or r.name for r in layout), write)


def build_field_graph(stage: StageIR, t: Fraction, left: bool = False) -> StepGraph:
    """A graph ``(x, knots...) -> F(t, x)`` for one time, over the knots it reads."""
    if isinstance(stage.integrator, Splitting):
        return _graph_over_knots(stage, "field", ("x",), lambda w, x: summed_field(w, t, left, x))
    return _graph_over_knots(stage, "field", ("x",), lambda w, x: w.field(t, left, x, "t"))


def build_delta_graph(stage: StageIR, t: Fraction, left: bool = False, field: int = 0) -> StepGraph:
    """A graph ``(x, knots...) -> F(t, x) / L``: the field without its depth factor (on a split
    stage sub-field ``field``'s).

    The reversible schemes fold L into their lattice increments (one multiply fewer per
    evaluation, and one fewer in its VJP).
    """
    if not isinstance(stage.integrator, Splitting):
        return _graph_over_knots(stage, "delta", ("x",), lambda w, x: w.delta(t, left, x, "t"))

    def write(w: StageWriter, x: fx.Node) -> fx.Node:
        fw = field_writers(w)[field]
        out = fw.delta(t, left, x, f"t_F{field + 1}")
        w.used_knots.update(fw.used_knots)
        w.evaluations = fw.evaluations
        return out

    return _graph_over_knots(stage, f"delta_F{field + 1}", ("x",), write)


def _graph_over_knots(stage: StageIR, name: str, state: tuple[str, ...], write) -> StepGraph:
    """Build ``(state..., knot stacks...) -> write(writer, *state)`` taking only the knots it reads.

    The graph is written over the full stacks first to learn which knots it reads; if that is a
    narrower window it is written again over just those rows. A gradient w.r.t. the inputs then
    covers those knots alone, so a re-run step of a K-knot stage costs O(1), not O(K), knots.
    """
    full = slice(0, stage.num_knots)
    graph, writer = _write_graph(stage, state, write, full)
    if writer.used_knots:
        window = slice(min(writer.used_knots), max(writer.used_knots) + 1)
        if window != full:
            graph, writer = _write_graph(stage, state, write, window)
    else:
        window = full
    return StepGraph(fx.GraphModule(stage, graph, f"{writer.tag}_{name}"), window, writer.evaluations)


def _write_graph(
    stage: StageIR, state: tuple[str, ...], write, window: slice
) -> tuple[fx.Graph, StageWriter]:
    graph = fx.Graph()
    placeholders = [graph.placeholder(s) for s in state]
    knots = {s.name: graph.placeholder(s.name) for s in stage.slots if s.kind != "shared"}
    constants = {name: graph.placeholder(name) for name in stage.inputs}
    writer = StageWriter(stage, graph, "", knots, window, constants)
    out = write(writer, *placeholders)
    graph.output(out)
    writer.sink_weights()
    return graph, writer


def unrolled_graph(stage: StageIR) -> StepGraph:
    """The stage's unrolled graph, built once per manifestation (see :class:`GraphCache`)."""
    return _cached(stage, "unrolled", lambda: build_unrolled_graph(stage))


def step_graph(stage: StageIR, n: int, kind: str = "forward") -> StepGraph:
    """The graph of step ``n`` (``forward`` or approximate ``reverse``), built once per manifestation."""
    return _cached(stage, (n, kind), lambda: build_step_graph(stage, n, kind))


def field_graph(stage: StageIR, t: Fraction, left: bool = False) -> StepGraph:
    """The graph of F(t, x) at an exact time, built once per manifestation."""
    t = Fraction(t)
    return _cached(stage, (t, left, "field"), lambda: build_field_graph(stage, t, left))


def delta_graph(stage: StageIR, t: Fraction, left: bool = False, field: int = 0) -> StepGraph:
    """The graph of F(t, x) / L (sub-field ``field``'s on a split stage) at an exact time, built once
    per manifestation."""
    t = Fraction(t)
    return _cached(stage, (t, left, "delta", field), lambda: build_delta_graph(stage, t, left, field))


CACHE_LOCK = threading.RLock()
"""Serialises building a stage's graphs: two threads running a cold stage must not race.

One lock for all stages (a per-stage lock would not survive ``copy.deepcopy``); it is taken only
while a cache or a graph is built, never while a built graph runs."""


@dataclass
class GraphCache:
    """The graphs built for one stage, valid while its :meth:`StageIR.graph_signature` is ``signature``."""

    signature: tuple | None
    graphs: dict[tuple | str, StepGraph] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict) -> GraphCache:
        return GraphCache(None)  # a copied stage builds its own: these graphs hold the original's modules


def _cached(stage: StageIR, key: tuple | str, build: Callable[[], StepGraph]) -> StepGraph:
    signature = stage.graph_signature()
    cache = getattr(stage, "_graph_cache", None)
    if cache is None or cache.signature != signature:
        cache = _new_cache(stage, signature)
    graph = cache.graphs.get(key)
    return graph if graph is not None else _build(cache.graphs, key, build)


@torch.compiler.disable
def _new_cache(stage: StageIR, signature: tuple) -> GraphCache:
    with CACHE_LOCK:
        cache = getattr(stage, "_graph_cache", None)
        if cache is None or cache.signature != signature:
            cache = stage._graph_cache = GraphCache(signature)
    return cache


# Under torch.compile a cache miss runs eagerly (a graph break): writing a graph handles exact
# Fractions and fx objects that dynamo would try, and fail, to trace. Built graphs are traced.
@torch.compiler.disable
def _build(graphs: dict, key: tuple | str, build: Callable[[], StepGraph]) -> StepGraph:
    with CACHE_LOCK:
        if key not in graphs:
            graphs[key] = build()
    return graphs[key]


def count_evaluations(stage: StageIR) -> int:
    """Field evaluations (NFE) of the unrolled stage."""
    return unrolled_graph(stage).evaluations
