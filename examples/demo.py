"""odeify's main job, end to end, on the shipped default model (a ResNet trained on sklearn digits).

1. analyze: find the residual blocks and same-shape runs;
2. convert: each run becomes an ODE stage; Euler at native depth reproduces the network;
3. retarget: the same continuous model as other integrators, depths and knot counts;
4. fine-tune memory-free: a compressed manifestation trained with the reversible adjoint;
5. save: the fine-tuned model and its readable graph, under out/demo/.

Run it with ``make demo`` (or ``python examples/demo.py --help``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

import odeify
from odeify.digits import DEFAULT_MODEL_PATH, load_digits
from odeify.emit import count_evaluations
from odeify.fileio import atomic_write_bytes
from odeify.report import format_plan_table

console = Console(width=None if sys.stdout.isatty() else 120)


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def total_nfe(model: torch.nn.Module) -> int:
    return sum(count_evaluations(stage) for stage in odeify.converted_stages(model))


def saved_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one training forward (dedup by storage)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def manifestations(ode: torch.nn.Module, original: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """One continuous model, several graphs: accuracy, cost and distance from the original."""
    table = Table(title="3. the same ODE model in other manifestations (digits test set)")
    for column in ("manifestation", "NFE", "knot params", "accuracy", "max |logit diff|"):
        table.add_column(column, justify="right" if column != "manifestation" else "left")
    with torch.no_grad():
        reference = original(x)
    settings = [
        ("euler, native steps (exact)", {}),
        ("rk4, native steps", {"integrator": "rk4"}),
        ("midpoint, half the steps", {"integrator": "midpoint", "steps": 0.5}),
        ("euler, twice the steps", {"steps": 2.0}),
        ("linear basis, 2 knots (least squares)", {"knots": 2, "basis": "linear"}),
        ("cubic basis, refined to 8 knots", {"knots": 8, "basis": "cubic", "steps": 8}),
    ]
    for label, kwargs in settings:
        model = odeify.retarget(ode, **kwargs)
        with torch.no_grad():
            diff = (model(x) - reference).abs().max().item()
        knots = sum(p.numel() for s in odeify.converted_stages(model) for p in s.knots.values())
        table.add_row(
            label, str(total_nfe(model)), f"{knots:,}", f"{accuracy(model, x, y):.4f}", f"{diff:.2e}"
        )
    console.print(table)


def fine_tune(ode: torch.nn.Module, epochs: int, out: Path) -> torch.nn.Module:
    """Compress to 2 knots per stage, then recover accuracy with the memory-free reversible adjoint."""
    x_train, y_train = load_digits("train")
    x_test, y_test = load_digits("test")
    student = odeify.retarget(
        ode, knots=2, basis="linear", integrator="reversible_heun", backward="reversible"
    )
    before = accuracy(student, x_test, y_test)
    backprop = odeify.set_backward(student, "backprop")
    batch = (x_train[:64], y_train[:64])
    memory = (saved_bytes(backprop, *batch), saved_bytes(student, *batch))

    optimizer = torch.optim.AdamW(student.parameters(), lr=2e-3, weight_decay=1e-4)
    generator = torch.Generator().manual_seed(0)
    student.train()
    for epoch in range(epochs):
        order = torch.randperm(len(x_train), generator=generator)
        bar = tqdm(order.split(64), desc=f"fine-tune epoch {epoch + 1}/{epochs}", leave=False)
        for idx in bar:
            loss = F.cross_entropy(student(x_train[idx]), y_train[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    student.eval()
    after = accuracy(student, x_test, y_test)

    table = Table(title="4. memory-free fine-tuning of the 2-knot reversible-Heun manifestation")
    for column in ("", "value"):
        table.add_column(column)
    table.add_row("test accuracy before fine-tuning", f"{before:.4f}")
    table.add_row(f"test accuracy after {epochs} epochs", f"{after:.4f}")
    table.add_row("bytes saved for backward, backprop (batch 64)", f"{memory[0]:,}")
    table.add_row("bytes saved for backward, reversible adjoint", f"{memory[1]:,}")
    console.print(table)
    odeify.save(student, out / "digits_ode.safetensors")
    return student


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs (default 3)")
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="where to write artifacts")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)

    original = odeify.load_model(str(DEFAULT_MODEL_PATH))
    x_test, y_test = load_digits("test")
    console.rule(f"odeify demo: {DEFAULT_MODEL_PATH.name}")
    plan = odeify.analyze(original)
    console.print(format_plan_table(plan))

    ode = odeify.convert(original)
    with torch.no_grad():
        diff = (ode(x_test) - original(x_test)).abs().max().item()
    console.print(
        f"2. converted: Euler at native depth, max |logit diff| vs the original = {diff:.2e}; "
        f"accuracy {accuracy(original, x_test, y_test):.4f} -> {accuracy(ode, x_test, y_test):.4f}"
    )
    manifestations(ode, original, x_test, y_test)
    student = fine_tune(ode, args.epochs, args.out)
    atomic_write_bytes(args.out / "digits_ode_code.py", student.code.encode())
    native_code = args.out / "digits_native_code.py"
    atomic_write_bytes(native_code, ode.code.encode())
    console.print(
        f"5. wrote {args.out / 'digits_ode.safetensors'} (odeify.load reads it back), "
        f"and the rewritten graphs as Python: {native_code}, {args.out / 'digits_ode_code.py'}"
    )


if __name__ == "__main__":
    main()
