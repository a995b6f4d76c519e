"""``backward='reversible'``: a reversible scheme's memory-free backward, exact to the last bit.

One runtime for every reversible integrator. A scheme (:mod:`odeify.numerics.schemes`: reversible
Heun, ALF, and their split steps over a split stage's sub-fields) is a register program;
:func:`compile_program` lays it out over a stage's steps, with exact times, and
:class:`_LatticeAdjoint` executes it on the fixed-point lattice (:mod:`odeify.runtime.lattice`):
forward under ``no_grad``, keeping only the compact final registers; backward by undoing the ops
from last to first. Each increment is re-evaluated, with grad, from the register it was computed
from (which holds the same bits again), used to undo the ops that added it, and differentiated once
its cotangent is complete, at the op that evaluated it. Every field is evaluated once in forward and
once, with grad, in backward.

Cotangents are the adjoints of the same ops, on the unrounded recurrence (the lattice's rounding
is invisible to the gradient): ``Add(target, source, k)`` gives ``λsource += k λtarget``,
``Reflect(target, about)`` gives ``λabout += 2 λtarget`` and ``λtarget = -λtarget``, an increment
``[h/2 F(t, r)]`` gives ``λr += h/2 J^T λincrement``. The graphs evaluate delta = F / L: the depth L
is folded into the increments' scale, h L / 2, and into the cotangents (a multiply fewer per
evaluation and per VJP).

Compiling merges what one evaluation can serve: two evaluations of one unchanged register with
the same weights and nothing random drawn (reversible Heun's step end and the next step's start,
on a continuous weight path) are one; adjacent additions of one source into one target are one
pass (ALF's ``z += p`` at a step's end and the next step's start); an addition of a register
that is still zero (ALF's v_0 = 0) is dropped.

Whatever the counts cannot hold exactly is detected, never stored lossily: a register past 2^52
counts (the float64 sums are no longer exact) or not finite (a NaN or inf sample) makes the
forward keep its input instead and the backward recompute the forward's states from it (memory:
every evaluation's input, during backward only), with one warning per stage and
``stats.fallbacks`` counting. A field that returns other bits on a re-run (nondeterministic
kernels), or a state that exceeded the bound between steps only, shows as rebuilt initial
registers that differ from the start (reversible Heun's y_0 = z_0, ALF's p_0 = 0): every such
pass warns and records the gap in ``stats.last_errors``.

A stage of one step, or of one block at any steps, keeps its input in place of its final registers,
quietly: the input (the output of the part before, which that part keeps in any case) costs one
state at most where the output's residual and the other registers cost about 1.25 (ALF's p in int32
beside an int8 residual), and backward recomputes the stage's steps from it, exactly, at one more
evaluation a step and, while it walks back, one evaluation input a step per slice of the batch.
Swin's first stages convert to one-block stages: swin_tiny's reversible ALF keeps 89 MiB for
backward so, 144 with the packed registers, against timm checkpointing's 91
(benchmarks/results/train_step_transformers.md); at 4x steps its training step peaks at 120.5 MiB,
as at native steps (175.6 with the packed registers; batch 8, tensor peak).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from odeify.codegen.emit import delta_graph
from odeify.ir.stage_ir import StageIR
from odeify.numerics.schemes import Add, Evaluate, Op, Reflect, ReversibleScheme
from odeify.runtime.batch_slices import batch_slices, probe_sample_bytes
from odeify.runtime.lattice import Lattice, half_step
from odeify.runtime.rerun import Backward, ForwardContext, Rerun, StageCall, StageFunction, warn_fallback
from odeify.runtime.rerun import knot_window_inputs as _knot_inputs

__all__ = ["LatticeAdjoint", "Program", "compile_program", "run_on_lattice"]


@dataclass(frozen=True)
class _Evaluation:
    """One increment of a compiled program: ``into = [length h/2 F_field(t, register)]`` (left limit
    when ``left``).

    ``first``: no evaluation comes before it, so its register's cotangent only matters for x's.
    """

    register: str
    t: Fraction
    left: bool
    into: str
    first: bool
    field: int = 0
    length: Fraction = Fraction(1)

    @property
    def finer_by(self) -> int:
        """log2 of ``length`` (a power of two): the increment, [length h/2 F], is [h/2 F] in counts
        of a lattice that many bits finer."""
        return self.length.numerator.bit_length() - self.length.denominator.bit_length()


Step = _Evaluation | Add | Reflect


@dataclass(frozen=True)
class Program:
    """A scheme's ops over one stage's steps: exact times, uniquely named increments, merged evaluations.

    ``frees[i]`` names the increments op i uses for the last time (their buffers are reused then);
    ``finer[name]`` how many bits finer than q a register's or increment's lattice is.
    """

    scheme: ReversibleScheme
    ops: tuple[Step, ...]
    frees: tuple[tuple[str, ...], ...]
    finer: dict[str, int]

    def shift(self, op: Add | Reflect) -> int:
        """How many bits finer the op's source lattice is than its target's."""
        return self.finer[_source(op)] - self.finer[op.target]

    def field_times(self) -> list[tuple[Fraction, bool]]:
        """The exact time and side (left limit or not) of every field evaluation, in forward order."""
        return [(op.t, op.left) for op in self.ops if isinstance(op, _Evaluation)]

    def increment_bits(self, op: _Evaluation) -> int:
        """How many bits finer than q the lattice is on which ``op``'s field value is rounded."""
        return self.finer[op.into] + op.finer_by


def compile_program(stage: StageIR) -> Program:
    """The stage's scheme laid out over its steps, with what one evaluation or one pass can serve merged."""
    scheme = stage.reversible_scheme()
    assert scheme is not None, "backward='reversible' runs a reversible scheme (validate_backward)"
    h = Fraction(1, stage.steps)
    ops = _placed(scheme.start, Fraction(0), h, "start")
    for n in range(stage.steps):
        ops += _placed(scheme.step, n * h, h, str(n))
    ops = _merged_additions(_shared_evaluations(stage, _without_zero_additions(scheme, ops)))
    first = next(i for i, op in enumerate(ops) if isinstance(op, _Evaluation))
    ops[first] = dataclasses.replace(ops[first], first=True)
    last_use = {_source(op): i for i, op in enumerate(ops) if not isinstance(op, _Evaluation)}
    increments = {op.into for op in ops if isinstance(op, _Evaluation)}
    frees = [[] for _ in ops]
    for name, i in last_use.items():
        if name in increments:
            frees[i].append(name)
    bits = increment_bits(half_step(stage))
    finer = {r.name: bits if r.lattice == "increment" else 0 for r in scheme.registers}
    for op in ops:  # an increment lives on the lattice of the registers it is added to
        if not isinstance(op, _Evaluation) and _source(op) in increments:
            finer[_source(op)] = finer[op.target]
    return Program(scheme, tuple(ops), tuple(tuple(f) for f in frees), finer)


def increment_bits(half: Fraction) -> int:
    """How much finer than q an ``increment`` register's lattice is: the k >= 0 with 2^-(k + 1) just
    above h L / 2 (0 at native steps, 1 at 2x, 6 at 64x), so its counts stay as large as a state's."""
    k = 0
    while Fraction(2) ** (k + 2) <= 1 / half:
        k += 1
    return k


def _placed(ops: tuple[Op, ...], start: Fraction, h: Fraction, suffix: str) -> list[Step]:
    """One step's (or the start's) ops at their exact times, increments renamed ``<name>.<suffix>``."""
    local = {op.into for op in ops if isinstance(op, Evaluate)}

    def name(n: str) -> str:
        return f"{n}.{suffix}" if n in local else n

    placed: list[Step] = []
    for op in ops:
        if isinstance(op, Evaluate):
            t = start + op.at * h
            placed.append(_Evaluation(op.register, t, op.left, name(op.into), False, op.field, op.length))
        elif isinstance(op, Add):
            placed.append(Add(op.target, name(op.source), op.times))
        else:
            placed.append(Reflect(op.target, name(op.about)))
    return placed


def _source(op: Add | Reflect) -> str:
    return op.source if isinstance(op, Add) else op.about


def _without_zero_additions(scheme: ReversibleScheme, ops: list[Step]) -> list[Step]:
    """Drop additions of a register that is still zero (it starts at zero and nothing wrote it yet)."""
    zero = {r.name for r in scheme.registers if r.start == "zero"}
    kept: list[Step] = []
    for op in ops:
        if isinstance(op, Add) and op.source in zero:
            continue
        if not isinstance(op, _Evaluation):
            zero.discard(op.target)
        kept.append(op)
    return kept


def _shared_evaluations(stage: StageIR, ops: list[Step]) -> list[Step]:
    """One evaluation for two of one sub-field, over sub-steps of one length, at an unchanged register
    with equal weights, unless it draws random numbers."""
    if stage.draws_random:  # every evaluation is its own draw
        return ops
    fresh: dict[tuple[str, int], _Evaluation] = {}  # (register, field) -> its last evaluation since
    alias: dict[str, str] = {}
    kept: list[Step] = []
    for op in ops:
        if isinstance(op, _Evaluation):
            last = fresh.get((op.register, op.field))
            if (
                last is not None
                and last.length == op.length
                and stage.field_weights(last.t, last.left) == stage.field_weights(op.t, op.left)
            ):
                alias[op.into] = last.into
                continue
            fresh[op.register, op.field] = op
            kept.append(op)
            continue
        if isinstance(op, Add):
            op = Add(op.target, alias.get(op.source, op.source), op.times)
        else:
            op = Reflect(op.target, alias.get(op.about, op.about))
        for key in [key for key in fresh if key[0] == op.target]:
            del fresh[key]
        kept.append(op)
    return kept


def _merged_additions(ops: list[Step]) -> list[Step]:
    """Adjacent additions of one source into one target as one (reversible Heun's 2 b_n, ALF's 2 p)."""
    merged: list[Step] = []
    for op in ops:
        previous = merged[-1] if merged else None
        if (
            isinstance(op, Add)
            and isinstance(previous, Add)
            and (previous.target, previous.source)
            == (
                op.target,
                op.source,
            )
        ):
            merged[-1] = Add(op.target, op.source, previous.times + op.times)
        else:
            merged.append(op)
    return merged


class LatticeAdjoint(StageFunction):
    """``reversible``: the stage's scheme run on the lattice, slice by slice of the batch
    (:mod:`odeify.runtime.batch_slices`); forward keeps each slice's compact final registers."""

    @staticmethod
    def forward(ctx: Any, call: StageCall, x: Tensor, *params: Tensor) -> Tensor:
        stage = call.stage
        program = compile_program(stage)
        context = ForwardContext.capture(x, call.inputs)
        knots = params[: call.num_knots]
        slices = batch_slices(x, sample_bytes=_sample_bytes(program, stage, x, knots, call.inputs))
        out = torch.empty_like(x) if len(slices) > 1 else None
        kept: list[tuple[Tensor | None, ...] | None] = []
        whys = []
        for index, rows in enumerate(slices):
            sliced = _sliced(context, slices, index)
            part, packed, why = _forward_slice(program, stage, x[rows], sliced, knots)
            if out is None:
                out = part
            else:
                out[rows] = part
            kept.append(packed)
            whys += [why] if why else []
        if whys:
            _note_fallback(call, whys[0])
        layout = [None if packed is None else len(packed) for packed in kept]
        saved = [out, x if None in layout else None]
        saved += [t for packed in kept if packed is not None for t in packed]

        def walk_back(work: Backward, tensors: tuple[Tensor, ...], grad_out: Tensor) -> Tensor | None:
            return _walk_slices(work, program, slices, layout, tensors, grad_out)

        StageFunction.keep(ctx, call, context, params, saved, walk_back)
        return out


def _sample_bytes(program: Program, stage: StageIR, x: Tensor, knots, inputs: tuple[Tensor, ...]) -> int:
    """What one sample costs while the stage steps: its float64 register and the tensors the largest
    of its fields creates in one evaluation (:func:`odeify.runtime.batch_slices.probe_sample_bytes`)."""
    first: dict[int, _Evaluation] = {}
    for op in program.ops:
        if isinstance(op, _Evaluation):
            first.setdefault(op.field, op)

    def evaluating(op: _Evaluation):
        graph = delta_graph(stage, op.t, op.left, op.field)
        return graph.module, lambda sample: graph(sample[0], *_knot_inputs(graph, knots), *inputs)

    fields = [evaluating(op) for op in first.values()]
    return 8 * x[0].numel() + max(probe_sample_bytes(module, run, [x]) for module, run in fields)


def _forward_slice(
    program: Program, stage: StageIR, x: Tensor, context: ForwardContext | _SliceContext, knots
) -> tuple[Tensor, tuple[Tensor | None, ...] | None, str]:
    """One slice forward: its output, its compact final registers (None: keep its input instead), why not."""
    lattice = Lattice(x, half_step(stage))
    registers = _run(program, stage, lattice, context, knots, lattice.counts(x))
    if stage.steps == 1 or stage.depth == 1:  # its input costs less to keep (module docstring)
        return lattice.value(registers[0]), None, ""
    return lattice.pack(registers, program.scheme)


def _walk_slices(
    work: Backward,
    program: Program,
    slices: list[slice],
    layout: list[int | None],
    tensors: tuple[Tensor | None, ...],
    grad_out: Tensor,
) -> Tensor | None:
    """One backward pass, slice by slice: each slice's states rebuilt (or recomputed from its input)
    and walked back; x's gradient written slice by slice, the knots' accumulated across them."""
    out, x, *rest = tensors
    grad_x = grad_out.new_empty(grad_out.shape) if work.needs_x and len(slices) > 1 else None
    gaps, offsets, start = [], [], 0
    for size in layout:
        offsets.append(start)
        start += size or 0
    for index in reversed(range(len(slices))):
        rows, size = slices[index], layout[index]
        sliced = dataclasses.replace(work, context=_sliced(work.context, slices, index))
        walk = _Walk(sliced, program, grad_out[rows])
        if size is None:
            part = walk.from_input(x[rows])
        else:
            packed = rest[offsets[index] : offsets[index] + size]
            part = walk.inverted((out[rows], *packed))
            gaps.append(walk.rebuild_gap())
        if grad_x is None:
            grad_x = part
        elif part is not None:
            grad_x[rows] = part
    work.stats.backward_passes += 1
    if gaps:
        _record_rebuild(work, program, gaps)
    return grad_x


def run_on_lattice(
    stage: StageIR, x: Tensor, points: list[Tensor] | None = None
) -> tuple[Lattice, Program, list[Tensor]]:
    """The stage's scheme forward on the lattice from ``x``, under ``no_grad`` and outside autograd:
    the lattice, the program and the final registers in counts (``points``, when given, collects
    every evaluation's input). What a training forward does, for diagnostics and tests."""
    program = compile_program(stage)
    lattice = Lattice(x, half_step(stage))
    with torch.no_grad():
        registers = _run(
            program,
            stage,
            lattice,
            ForwardContext.capture(x),
            stage.knot_tensors(),
            lattice.counts(x),
            points,
        )
    return lattice, program, registers


def _run(
    program: Program,
    stage: StageIR,
    lattice: Lattice,
    context: ForwardContext | _Replaying,
    knots,
    x: Tensor,
    points: list[Tensor] | None = None,
) -> list[Tensor]:
    """The program forward on the lattice from x (counts; the first register starting at x takes it,
    in place); returns the final registers. ``points``, when given, collects every evaluation's input
    (backward's fallback), else each register's value is one reused buffer.

    A register that starts at zero is allocated at its first write, which takes the value written
    (ALF's first ``p = 2a - p`` is ``p = 2a``, in the increment's own buffer): no zeros to fill.
    """
    registers: dict[str, Tensor | None] = {}
    taken = False  # x itself becomes the first register that starts at x; the others copy it
    for r in program.scheme.registers:
        if r.start == "zero":
            registers[r.name] = None
        else:
            registers[r.name], taken = (x.clone() if taken else x), True
    increments: dict[str, Tensor] = {}
    values: dict[str, Tensor] = {}  # a register's value in the input's dtype, while it is unchanged
    for i, op in enumerate(program.ops):
        if isinstance(op, _Evaluation):
            value = values.get(op.register)
            if value is None:
                reuse = None if points is not None else op.register
                value = values[op.register] = lattice.value(registers[op.register], reuse)
            if points is not None:
                points.append(value)
            graph = delta_graph(stage, op.t, op.left, op.field)
            delta = context.record(op.into, graph, (value, *_knot_inputs(graph, knots)))
            increments[op.into] = lattice.increment(delta, registers[op.register], program.increment_bits(op))
            del delta
            continue
        name = _source(op)
        if name in registers and registers[name] is None:  # reading a register still at zero
            registers[name] = torch.zeros_like(x)
        source = registers[name] if name in registers else increments[name]
        if registers[op.target] is None:
            registers[op.target] = _first_write(lattice, op, source, program, owned=name in program.frees[i])
            if name in program.frees[i]:
                increments.pop(name)  # now the register's own buffer
        elif isinstance(op, Add):
            lattice.add(registers[op.target], source, op.times, program.shift(op))
        else:
            lattice.reflect(registers[op.target], source, program.shift(op))
        values.pop(op.target, None)
        lattice.release(*(increments.pop(n) for n in program.frees[i] if n in increments))
    return [torch.zeros_like(x) if t is None else t for t in registers.values()]


def _first_write(
    lattice: Lattice, op: Add | Reflect, source: Tensor, program: Program, owned: bool
) -> Tensor:
    """The value an op writes into a register still at zero: ``times * source`` for an addition,
    ``2 * about`` for a reflection (on the target's lattice), in ``source``'s buffer when ``owned``."""
    factor = op.times if isinstance(op, Add) else 2
    moved = lattice.on_target_lattice(source, program.shift(op))
    if moved is not source or owned:
        return moved.mul_(factor)
    return torch.mul(source, factor)


def _note_fallback(call: StageCall, why: str) -> None:
    stats, stage = call.stats, call.stage
    stats.fallbacks += 1
    if stats.fallbacks == 1:
        warn_fallback(
            f"stage '{stage.stage_name}' (backward='reversible', integrator='{stage.integrator.name}', "
            f"steps={stage.steps}) cannot keep its final state exactly: {why}. This pass keeps the stage "
            "input instead and recomputes the forward's states from it in backward (exact, memory ~ all "
            "steps' states during backward), and later passes will too whenever this happens; "
            "stage.adjoint_stats.fallbacks counts them."
        )


@dataclass
class _Pending:
    """An increment re-evaluated with grad, waiting for its complete cotangent (at its own op)."""

    delta: Tensor
    leaf: Tensor
    rerun: Rerun
    counts: Tensor | None = None


class _Walk:
    """One backward pass: the program's ops from last to first, each adjoint taken, each undone."""

    def __init__(self, work: Backward, program: Program, grad_out: Tensor) -> None:
        self.work, self.program, self.stage = work, program, work.stage
        self.lam = _Cotangents(program, grad_out, half_step(work.stage))
        self.producers = {op.into: op for op in program.ops if isinstance(op, _Evaluation)}
        self.pending: dict[str, _Pending] = {}
        self.registers: dict[str, Tensor] | None = None  # None: evaluate at recorded points instead
        self.values: dict[str, Tensor] = {}
        self.points: list[Tensor] = []

    def inverted(self, kept: tuple[Tensor, ...]) -> Tensor | None:
        """Rebuild the states by undoing every op from the final registers; check the start is rebuilt."""
        out, *packed, quantum = kept
        self.lattice = Lattice(out, half_step(self.stage), quantum)
        layout = self.program.scheme.registers
        rebuilt = self.lattice.unpack(out, packed, self.program.scheme)
        self.registers = {r.name: t for r, t in zip(layout, rebuilt, strict=True)}
        self._walk()
        return self.lam.result(layout) if self.work.needs_x else None

    def from_input(self, x: Tensor) -> Tensor | None:
        """The fallback: recompute the forward from the saved input, keeping every evaluation's input."""
        lattice = Lattice(x, half_step(self.stage))
        with torch.no_grad():
            replaying = _Replaying(self.work.context)
            _run(
                self.program, self.stage, lattice, replaying, self.work.knots, lattice.counts(x), self.points
            )
        self._walk()
        return self.lam.result(self.program.scheme.registers) if self.work.needs_x else None

    def _walk(self) -> None:
        for op in reversed(self.program.ops):
            if isinstance(op, _Evaluation):
                self._differentiate(op)
                continue
            self.lam.adjoint(op)
            if self.registers is not None:
                self._undo(op)

    def _undo(self, op: Add | Reflect) -> None:
        target, name = self.registers[op.target], _source(op)
        source = self.registers[name] if name in self.registers else self._increment(name)
        if isinstance(op, Add):
            self.lattice.add(target, source, -op.times, self.program.shift(op))
        else:
            self.lattice.reflect(target, source, self.program.shift(op))
        self.values.pop(op.target, None)

    def _increment(self, name: str) -> Tensor:
        """An increment's counts, re-evaluated (with grad, for its VJP) when undoing first needs it."""
        pending = self.pending.get(name)
        if pending is None:
            op = self.producers[name]
            register = self.registers[op.register]
            value = self.values.get(op.register)
            if value is None:
                value = self.values[op.register] = self.lattice.value(register, reuse=op.register)
            pending = self.pending[name] = self._evaluate(op, value)
            pending.counts = self.lattice.increment(
                pending.delta.detach(), register, self.program.increment_bits(op)
            )
        return pending.counts

    def _evaluate(self, op: _Evaluation, value: Tensor) -> _Pending:
        """delta(t, value) with grad, replaying the forward's draws for this evaluation."""
        graph = delta_graph(self.stage, op.t, op.left, op.field)
        rerun = self.work.grads.rerun(graph)
        with torch.enable_grad():
            leaf = value.detach().requires_grad_(not op.first or self.work.needs_x)
            delta = self.work.context.replay(op.into, graph, (leaf, *rerun.knots))
        return _Pending(delta, leaf, rerun)

    def _differentiate(self, op: _Evaluation) -> None:
        """One evaluation's VJP, its increment's cotangent complete: into its register's and the knots'."""
        pending = self.pending.pop(op.into, None)
        if pending is None:  # the fallback: the input the forward recorded
            pending = self._evaluate(op, self.points.pop())
        cotangent = self.lam.take(op.into)
        wanted = [pending.leaf] if pending.leaf.requires_grad else []
        wrt = wanted + pending.rerun.wrt
        if cotangent is not None and wrt:
            delta = pending.delta
            found = torch.autograd.grad(delta, wrt, cotangent.to(delta.dtype), allow_unused=True)
            if wanted and found[0] is not None:
                self.lam.accumulate(op.register, found[0])
            self.work.grads.add(pending.rerun, found[len(wanted) :])
            self.lam.release(cotangent)
        if pending.counts is not None:
            self.lattice.release(pending.counts)

    def rebuild_gap(self) -> Tensor:
        """How far the rebuilt initial registers are from where the forward started them, relative (0
        when every state was rebuilt bit for bit): a gap means the rebuilt states were not the forward's."""
        layout = self.program.scheme.registers
        inputs = [self.registers[r.name] for r in layout if r.start == "input"]
        zeros = [self.registers[r.name] for r in layout if r.start == "zero"]
        if all(torch.equal(t, inputs[0]) for t in inputs[1:]) and not any(bool(t.any()) for t in zeros):
            return torch.zeros((), dtype=torch.float64)
        gaps = [torch.linalg.vector_norm(t - inputs[0]) for t in inputs[1:]]
        gaps += [torch.linalg.vector_norm(t) for t in zeros]
        scale = torch.linalg.vector_norm(inputs[0]).clamp_min(1e-300)
        return torch.stack(gaps).norm() / scale


def _record_rebuild(work: Backward, program: Program, gaps: list[Tensor]) -> None:
    """Note a pass's largest rebuild gap over its slices (one number a pass); warn when it is not 0."""
    stats = work.stats
    stats.record([torch.stack(gaps).max()])
    if not stats.last_errors[0]:
        return
    layout = program.scheme.registers
    start = " = ".join(r.name for r in layout if r.start == "input")
    start = ", ".join(
        [start] * (sum(r.start == "input" for r in layout) > 1)
        + [f"{r.name} = 0" for r in layout if r.start == "zero"]
    )
    warn_fallback(
        f"stage '{work.stage.stage_name}' (backward='reversible', integrator="
        f"'{work.stage.integrator.name}') did not rebuild its states exactly (the rebuilt initial "
        f"registers, which started at {start}, are {stats.last_errors[0]:.1e} off, relative): its field "
        "returned other bits on a re-run, or its state outgrew exact float64 arithmetic between "
        "steps, so these gradients carry that difference, amplified by the inverse. On GPUs use "
        "deterministic kernels (torch.use_deterministic_algorithms(True), "
        "torch.backends.cudnn.benchmark = False). stage.adjoint_stats.worst_error tracks it."
    )


class _Cotangents:
    """The cotangent λ of every register and live increment, kept as (tensor, scale), λ = scale * tensor.

    So a reflection's sign flip costs no pass, and an increment's cotangent is made already scaled
    by its length times h L / 2 for its VJP (``take`` hands the tensor over as it is), in a reused buffer
    (:meth:`release` it after the VJP): a fresh state-sized tensor per step costs page faults.
    """

    def __init__(self, program: Program, grad_out: Tensor, half: Fraction) -> None:
        self.registers = {r.name for r in program.scheme.registers}
        self.halves = {op.into: half * op.length for op in program.ops if isinstance(op, _Evaluation)}
        output = self.output_name = program.scheme.output
        self.tensors: dict[str, Tensor] = {output: grad_out.clone()}
        self.scales: dict[str, Fraction] = {output: Fraction(1)}
        self._spare: list[Tensor] = []

    def adjoint(self, op: Add | Reflect) -> None:
        """``Add``: λsource += times λtarget. ``Reflect``: λabout += 2 λtarget, λtarget = -λtarget."""
        if isinstance(op, Add):
            self._add(op.source, op.target, op.times)
        else:
            self._add(op.about, op.target, 2)
            if op.target in self.scales:
                self.scales[op.target] = -self.scales[op.target]

    def _add(self, name: str, source: str, factor: int) -> None:
        if source not in self.tensors:
            return  # a zero cotangent
        weight = factor * self.scales[source]
        if name in self.tensors:
            self.tensors[name].add_(self.tensors[source], alpha=float(weight / self.scales[name]))
            return
        is_register = name in self.registers
        scale = Fraction(1) if is_register else 1 / self.halves[name]
        out = self._spare.pop() if self._spare and not is_register else None
        self.tensors[name] = torch.mul(self.tensors[source], float(weight / scale), out=out)
        self.scales[name] = scale

    def take(self, increment: str) -> Tensor | None:
        """length h L / 2 times an increment's cotangent: the cotangent of the delta it was evaluated as."""
        tensor = self.tensors.pop(increment, None)
        if tensor is None:
            return None
        factor = self.scales.pop(increment) * self.halves[increment]
        return tensor if factor == 1 else tensor * float(factor)

    def release(self, cotangent: Tensor) -> None:
        """Hand a taken cotangent back for reuse, once its VJP is done."""
        self._spare.append(cotangent)

    def accumulate(self, register: str, grad: Tensor) -> None:
        """λregister += grad (a VJP's result, taken over)."""
        if register in self.tensors:
            self.tensors[register].add_(grad, alpha=float(1 / self.scales[register]))
        else:
            self.tensors[register], self.scales[register] = grad, Fraction(1)

    def result(self, layout) -> Tensor:
        """The gradient w.r.t. x: the sum of the cotangents of the registers that started at x."""
        parts = [r.name for r in layout if r.start == "input" and r.name in self.tensors]
        if not parts:  # no cotangent reached the start (a stage whose output ignores its input)
            return torch.zeros_like(self.tensors[self.output_name])
        total = self.tensors[parts[0]]
        if self.scales[parts[0]] != 1:
            total.mul_(float(self.scales[parts[0]]))
        for name in parts[1:]:
            total.add_(self.tensors[name], alpha=float(self.scales[name]))
        return total


class _SliceContext:
    """One batch slice's view of the forward's context: its random draws noted under ``(slice, key)``."""

    def __init__(self, context: ForwardContext, index: int) -> None:
        self.context, self.index = context, index

    def record(self, key: Any, graph, args) -> Tensor:
        return self.context.record((self.index, key), graph, args)

    def replay(self, key: Any, graph, args) -> Tensor:
        return self.context.replay((self.index, key), graph, args)


def _sliced(context: ForwardContext, slices: list[slice], index: int) -> ForwardContext | _SliceContext:
    """The context slice ``index`` records and replays under: the whole context when there is one slice."""
    return context if len(slices) == 1 else _SliceContext(context, index)


class _Replaying:
    """A stand-in for :class:`ForwardContext` whose ``record`` replays the forward's draws instead."""

    def __init__(self, context: ForwardContext) -> None:
        self.context = context

    def record(self, key: Any, graph, args) -> Tensor:
        return self.context.replay(key, graph, args)
