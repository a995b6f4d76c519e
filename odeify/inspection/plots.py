"""PNG pictures of converted models and of what was measured on them (matplotlib, no pyplot).

Figures are built with matplotlib's object API (``Figure`` + the Agg canvas), so plotting never
selects a backend or opens a window in the caller's process, and every file is written atomically
(:func:`odeify.core.fileio.atomic_path`): an interrupted run never leaves a half-written PNG.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from fractions import Fraction

import torch
from matplotlib.figure import Figure
from torch import nn

from odeify.compiler.conversion import converted_stages
from odeify.core.fileio import atomic_path
from odeify.core.words import plural
from odeify.numerics.bases import get_basis

__all__ = [
    "plot_conversion_check",
    "plot_history",
    "plot_memory",
    "plot_sweep",
    "plot_weight_path",
    "weight_path",
]

PATH_POINTS = 240  # times at which the weight path is drawn between the knots


def _plain(text: str) -> str:
    """``text`` shown as typed: matplotlib reads ``$...$`` as math (a file name with one '$' would fail)."""
    return text.replace("$", r"\$")


def _save(fig: Figure, path: str | os.PathLike[str]) -> None:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def weight_path(
    stage: nn.Module, points: int = PATH_POINTS
) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """Per knot tensor of ``stage``: (times, ||theta(t)|| at those times, ||theta_k|| at the knots).

    theta(t) = sum_k B_k(t) theta_k with the stage's own basis; knot k sits at t = k / K.
    """
    basis, count = get_basis(stage.basis), stage.num_knots
    times = [Fraction(i, points) for i in range(points + 1)]
    rows = torch.tensor(
        [[float(c) for c in basis.coefficients(count, t)] for t in times], dtype=torch.float64
    )
    paths = {}
    for slot in stage.slots:
        if slot.kind == "shared":
            continue
        stack = stage.slot_tensor(slot).detach().to(torch.float64).reshape(count, -1)
        paths[slot.name] = (
            [float(t) for t in times],
            (rows @ stack).norm(dim=1).tolist(),
            stack.norm(dim=1).tolist(),
        )
    return paths


def plot_weight_path(model: nn.Module, path: str | os.PathLike[str], title: str | None = None) -> None:
    """One panel per stage: each knot tensor's norm over depth t, knots as dots, the basis curve between."""
    stages = converted_stages(model)
    fig = Figure(figsize=(5.2 * len(stages), 4.0))
    axes = fig.subplots(1, len(stages), squeeze=False)[0]
    for ax, stage in zip(axes, stages, strict=True):
        count = stage.num_knots
        for index, (name, (times, norms, knot_norms)) in enumerate(weight_path(stage).items()):
            color = f"C{index % 10}"
            ax.plot(times, norms, color=color, linewidth=1.4, label=name)
            ax.plot([k / count for k in range(count)], knot_norms, "o", color=color, markersize=5)
        ax.set_xlabel("depth t (stage input 0, output 1)")
        ax.set_ylabel("norm of the weight tensor")
        ax.set_title(
            _plain(f"{stage.stage_name}: {plural(count, 'knot')}, {stage.basis} basis\n")
            + _plain(f"{stage.integrator.name}, ")
            + plural(stage.steps, "step")
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(_plain(title))
    _save(fig, path)


def plot_sweep(
    points: Sequence, path: str | os.PathLike[str], title: str = "accuracy vs field evaluations"
) -> None:
    """Accuracy against NFE, one line per integrator (and knot count, when several were swept)."""
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.subplots()
    several_knots = len({p.knots for p in points}) > 1
    lines: dict[str, list] = {}
    for point in points:
        label = f"{point.integrator}, knots {point.knots}" if several_knots else point.integrator
        lines.setdefault(label, []).append(point)
    for label, members in lines.items():
        members = sorted(members, key=lambda p: p.nfe)
        ax.plot([p.nfe for p in members], [100 * p.accuracy for p in members], "o-", label=_plain(label))
        for p in members:
            ax.annotate(
                f"steps {p.steps}",
                (p.nfe, 100 * p.accuracy),
                fontsize=6,
                alpha=0.7,
                textcoords="offset points",
                xytext=(3, -9),
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("field evaluations per forward pass (NFE, all stages)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(_plain(title))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_history(
    histories: Mapping[str, Sequence], path: str | os.PathLike[str], title: str = "fine-tuning"
) -> None:
    """Validation accuracy per epoch (epoch 0 = before fine-tuning) and training loss, per run."""
    fig = Figure(figsize=(10, 4))
    acc_ax, loss_ax = fig.subplots(1, 2)
    for label, history in histories.items():
        acc_ax.plot([r.epoch for r in history], [100 * r.val_accuracy for r in history], "o-", label=label)
        trained = [r for r in history if r.train_loss is not None]
        loss_ax.plot([r.epoch for r in trained], [r.train_loss for r in trained], "o-", label=label)
    acc_ax.set(
        xlabel="epoch (0 = before fine-tuning)", ylabel="validation accuracy (%)", title=f"{title}: accuracy"
    )
    loss_ax.set(xlabel="epoch", ylabel="mean training loss", title=f"{title}: loss")
    for ax, corner in ((acc_ax, "lower right"), (loss_ax, "upper right")):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc=corner)
    _save(fig, path)


def plot_memory(
    saved: Mapping[str, Sequence[tuple[int, int]]],
    path: str | os.PathLike[str],
    title: str = "memory kept for backward",
) -> None:
    """Bytes saved for backward against steps per stage, one line per backward mode (log-log)."""
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.subplots()
    for mode, pairs in saved.items():
        ax.plot([s for s, _ in pairs], [b / 2**20 for _, b in pairs], "o-", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("steps per stage")
    ax.set_ylabel("MiB saved for backward")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_conversion_check(
    reference: torch.Tensor, converted: torch.Tensor, path: str | os.PathLike[str], title: str
) -> None:
    """Converted logits against the source model's, every logit one dot, with the y = x line."""
    fig = Figure(figsize=(5, 5))
    ax = fig.subplots()
    x, y = reference.detach().flatten().cpu(), converted.detach().flatten().cpu()
    low, high = min(x.min(), y.min()).item(), max(x.max(), y.max()).item()
    ax.plot([low, high], [low, high], color="0.6", linewidth=1, label="y = x")
    ax.plot(x, y, ".", markersize=2, alpha=0.5, label="logits")
    ax.set_xlabel("source model logit")
    ax.set_ylabel("converted model logit")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(True, alpha=0.3)
    _save(fig, path)
