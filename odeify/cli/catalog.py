"""``odeify list``: the integrators, bases and backward modes convert and retarget accept.

Torch-free, so the command answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys

from odeify.cli.console import console_on
from odeify.core.errors import ConfigError
from odeify.ir.settings import BACKWARD_MODES, validate_backward
from odeify.numerics.bases import BASES
from odeify.numerics.tableaus import TABLEAUS, ReversibleHeun, resolve_integrator


def run_list(args: argparse.Namespace) -> int:
    """``odeify list``: integrators (stages, order, backward modes), bases, backward modes."""
    from rich.table import Table

    integrators = []
    for name in [*TABLEAUS, ReversibleHeun.name]:
        integrator = resolve_integrator(name)
        modes = [m for m in BACKWARD_MODES if _allows(integrator, m)]
        integrators.append(
            {"name": name, "stages": integrator.evals_per_step, "order": integrator.order, "backward": modes}
        )
    bases = [{"name": n, "description": _first_line(type(b).__doc__)} for n, b in BASES.items()]
    if args.json:
        print(json.dumps({"integrators": integrators, "bases": bases, "backward": list(BACKWARD_MODES)}))
        return 0
    table = Table(title="integrators (--integrator)", caption="NFE per stage = stages x steps")
    for header, justify in (("name", "left"), ("stages", "right"), ("order", "right"), ("backward", "left")):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in integrators:
        table.add_row(row["name"], str(row["stages"]), str(row["order"]), ", ".join(row["backward"]))
    basis_table = Table(title="bases (--basis): weights over depth")
    basis_table.add_column("name")
    basis_table.add_column("description")
    for row in bases:
        basis_table.add_row(row["name"], row["description"])
    console = console_on(sys.stdout)
    console.print(table)
    console.print(basis_table)
    return 0


def _allows(integrator: object, mode: str) -> bool:
    try:
        validate_backward(mode, integrator)  # type: ignore[arg-type]
    except ConfigError:
        return False
    return True


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc else ""
