"""Human- and script-readable summaries of an analysis Plan and of a converted model.

``describe`` reads a converted model back into a frozen ``ConversionReport`` (what each ODE stage
is and what it costs), so the CLI, notebooks and benchmarks print the same facts the same way:
rich tables for people, plain dicts for JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from rich.markup import escape
from rich.table import Table
from torch import nn

from odeify.codegen.emit import count_evaluations
from odeify.compiler.conversion import converted_stages
from odeify.compiler.record import META
from odeify.core.errors import ConfigError
from odeify.ir.fold_records import fold_records
from odeify.ir.plan import Plan
from odeify.ir.settings import DepthMultiplier

FORM_NAMES = {"post": "post-activation", "pre": "pre-activation"}


@dataclass(frozen=True)
class StageReport:
    """One ODE stage: the run it replaces (depth L), its knots K and how it is integrated."""

    name: str
    form: str
    depth: int
    knots: int
    basis: str
    integrator: str
    steps: int
    nfe: int
    backward: str
    parameters: int
    fitted_steps: tuple[int, ...] | None = None  # the steps its knots were calibrated or fine-tuned for
    corrected_steps: tuple[int, ...] = ()  # the steps it reads a correction of its own at


@dataclass(frozen=True)
class ConversionReport:
    """All stages of a converted model, with totals and the parameter count before and after."""

    model: str
    input_shape: tuple[int, ...]
    stages: tuple[StageReport, ...]
    parameters_before: int
    parameters_after: int
    not_lifted: tuple[tuple[str, str], ...] = ()
    folded_batchnorm: bool = False  # whether convert folded BatchNorm layers into convolutions
    steps_multiplier: DepthMultiplier | None = None  # what a whole-model 'x<m>' became, where one was asked

    @property
    def nfe(self) -> int:
        """Field evaluations of all stages together."""
        return sum(stage.nfe for stage in self.stages)

    @property
    def knot_parameters(self) -> int:
        """Trainable knot parameters of all stages together."""
        return sum(stage.parameters for stage in self.stages)

    def to_dict(self) -> dict:
        """A JSON-ready dict (tuples become lists), totals included."""
        return {
            "model": self.model,
            "input_shape": list(self.input_shape),
            "stages": [asdict(stage) for stage in self.stages],
            "nfe": self.nfe,
            "knot_parameters": self.knot_parameters,
            "parameters_before": self.parameters_before,
            "parameters_after": self.parameters_after,
            "not_lifted": dict(self.not_lifted),
            "folded_batchnorm": self.folded_batchnorm,
            "steps_multiplier": self.steps_multiplier.to_dict() if self.steps_multiplier else None,
        }


def describe(converted: nn.Module, name: str | None = None) -> ConversionReport:
    """Report the ODE stages of ``converted`` (the output of ``odeify.convert``/``retarget``).

    ``name`` overrides the recorded source name (which is a class name when a module was converted).
    """
    meta = getattr(converted, "meta", {}).get(META)
    if meta is None:
        raise ConfigError("this module was not made by odeify.convert; describe takes a converted model.")
    stages = tuple(
        StageReport(
            name=stage.stage_name,
            form=stage.form,
            depth=stage.depth,
            knots=stage.num_knots,
            basis=stage.basis,
            integrator=stage.integrator.name,
            steps=stage.steps,
            nfe=count_evaluations(stage),
            backward=stage.backward,
            parameters=sum(p.numel() for p in stage.knots.parameters() if p.requires_grad),
            fitted_steps=stage.fitted_steps,
            corrected_steps=stage.corrected_steps,
        )
        for stage in converted_stages(converted)
    )
    return ConversionReport(
        model=name or str(meta["name"]),
        input_shape=tuple(meta["input_shape"]),
        stages=stages,
        parameters_before=int(meta["original_parameters"]),
        parameters_after=sum(p.numel() for p in converted.parameters()),
        not_lifted=tuple(meta.get("not_lifted", {}).items()),
        folded_batchnorm=any(fold_records(module) for module in converted.modules()),
        steps_multiplier=_multiplier(meta, stages),
    )


def _multiplier(meta: dict, stages: tuple[StageReport, ...]) -> DepthMultiplier | None:
    """The recorded whole-model depth multiplier, while the stages still run the steps it gave them."""
    record = meta.get("steps_multiplier")
    if record is None or record["steps"] != {s.name: s.steps for s in stages}:
        return None
    return DepthMultiplier.from_dict(record)


def _text(value: object) -> str:
    """``value`` as table text: names (from a file or a user's tableau) are escaped, never read as rich
    markup (a tableau named ``[/x]`` would end a style that was never opened; ``[bold]`` would vanish)."""
    return escape(str(value))


def format_shape(shape: Sequence[int]) -> str:
    """'C x H x W' of a batched shape, written '64x56x56'."""
    return "x".join(str(s) for s in shape[1:]) or "scalar"


def format_plan_table(plan: Plan) -> Table:
    """The runs of blocks, one row per run: each becomes one ODE stage (a run of period p > 1 a split
    stage of p sub-fields, the layout glue between its sub-blocks inside them: Swin)."""
    runs = plan.runs
    split = sum(run.period > 1 for run in runs)
    split_note = f" ({split} of them split stages)" if split else ""
    table = Table(
        title=f"{_text(plan.model)}: runs of identity blocks (input {'x'.join(map(str, plan.input_shape))})",
        caption=f"{len(runs)} runs{split_note}, {sum(len(run.blocks) for run in runs)} identity "
        f"blocks become ODE stages; {len(plan.discrete)} blocks stay discrete",
    )
    for header, justify in (
        ("stage", "left"),
        ("run", "right"),
        ("blocks", "right"),
        ("period", "right"),
        ("kind", "left"),
        ("form", "left"),
        ("activation", "left"),
        ("shape", "left"),
        ("params/block", "right"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for index, run in enumerate(plan.runs):
        table.add_row(
            _text(run.name),
            str(index),
            str(run.length),
            str(run.period),
            "identity",
            _text(FORM_NAMES.get(run.form, run.form)),
            _text(run.activation or "-"),
            format_shape(run.shape),
            f"{run.parameters_per_block:,}",
        )
    return table


def format_discrete_table(plan: Plan) -> Table:
    """The blocks that stay discrete layers, and why."""
    table = Table(title="blocks that stay discrete")
    for header in ("block", "kind", "shape", "reason"):
        table.add_column(header)
    for item in plan.discrete:
        block = item.block
        table.add_row(
            _text(block.scope or f"block {block.index}"),
            _text(block.kind),
            f"{format_shape(block.in_shape)} -> {format_shape(block.out_shape)}",
            _text(item.reason),
        )
    return table


def format_report_table(report: ConversionReport) -> Table:
    """The ODE stages of a converted model, one row per stage and a total row."""
    ratio = report.parameters_after / report.parameters_before if report.parameters_before else float("nan")
    caption = (
        f"parameters: {report.parameters_before:,} before, {report.parameters_after:,} after "
        f"({ratio:.3f}x{'; BatchNorm folded into convs' if report.folded_batchnorm else ''})"
    )
    if report.not_lifted:
        caption += "; not lifted: " + "; ".join(f"{_text(n)} ({_text(why)})" for n, why in report.not_lifted)
    if report.steps_multiplier is not None:
        caption += f"\n{_text(report.steps_multiplier.line())}"
    if any(s.corrected_steps for s in report.stages):
        caption += "\n*: the stage reads a correction of its own at those steps (native: the knots alone)"
    table = Table(title=f"{_text(report.model)}: ODE stages", caption=caption, show_footer=True)
    columns = (
        ("stage", "left", "total"),
        ("form", "left", ""),
        ("depth L", "right", str(sum(s.depth for s in report.stages))),
        ("knots K", "right", ""),
        ("basis", "left", ""),
        ("integrator", "left", ""),
        ("steps", "right", str(sum(s.steps for s in report.stages))),
        ("NFE", "right", str(report.nfe)),
        ("backward", "left", ""),
        ("knot params", "right", f"{report.knot_parameters:,}"),
        ("fitted for steps", "right", ""),
    )
    for header, justify, footer in columns:
        table.add_column(header, footer, justify=justify)  # type: ignore[arg-type]
    for s in report.stages:
        table.add_row(
            _text(s.name),
            _text(FORM_NAMES.get(s.form, s.form)),
            str(s.depth),
            str(s.knots),
            _text(s.basis),
            _text(s.integrator),
            str(s.steps),
            str(s.nfe),
            _text(s.backward),
            f"{s.parameters:,}",
            _fitted(s),
        )
    return table


def _fitted(stage: StageReport) -> str:
    """'1*, 2*, 4': the steps fitted for, a star where the stage reads a correction of its own."""
    if not stage.fitted_steps:
        return "-"
    return ", ".join(f"{n}*" if n in stage.corrected_steps else str(n) for n in stage.fitted_steps)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[str]], text_columns: int = 2) -> list[str]:
    """Lines of a markdown table; the first ``text_columns`` columns left-aligned, the rest right."""
    rule = "|".join("---" if i < text_columns else "---:" for i in range(len(headers)))
    return [
        "| " + " | ".join(headers) + " |",
        f"|{rule}|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
