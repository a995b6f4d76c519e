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
from odeify.numerics.splitting import SPLITTINGS
from odeify.numerics.tableaus import REVERSIBLE_SCHEMES, TABLEAUS, Splitting, resolve_integrator

BACKWARD_WORDS = {
    "backprop": "keeps every intermediate of every step; exact (autograd)",
    "checkpoint": "keeps the state every checkpoint_every steps and re-runs the steps in backward; exact",
    "reverse": "keeps the stage's input and output and steps backward; approximate, redone exactly past "
    "a tolerance",
    "reversible": "keeps the output and the final registers, rebuilds every state bit for bit; exact",
}
"""One line per backward mode (docs/backward-modes.md has the whole table)."""


def run_list(args: argparse.Namespace) -> int:
    """``odeify list``: integrators (stages, order, backward modes), bases, backward modes."""
    from rich.table import Table

    integrators = []
    for name in [*TABLEAUS, *REVERSIBLE_SCHEMES, *SPLITTINGS]:
        integrator = resolve_integrator(name)
        modes = [m for m in BACKWARD_MODES if _allows(integrator, m)]
        integrators.append(
            {"name": name, "stages": _stages(integrator), "order": integrator.order, "backward": modes}
        )
    bases = [{"name": n, "description": _first_line(type(b).__doc__)} for n, b in BASES.items()]
    backward = [{"name": mode, "description": BACKWARD_WORDS[mode]} for mode in BACKWARD_MODES]
    if args.json:
        print(json.dumps({"integrators": integrators, "bases": bases, "backward": backward}))
        return 0
    table = Table(
        title="integrators (--integrator)",
        caption="NFE per stage = stages x steps; p: a split stage's sub-fields (2 in a transformer block), "
        "which only split stages run",
    )
    for header, justify in (("name", "left"), ("stages", "right"), ("order", "right"), ("backward", "left")):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in integrators:
        table.add_row(row["name"], str(row["stages"]), str(row["order"]), ", ".join(row["backward"]))
    console = console_on(sys.stdout)
    console.print(table)
    for title, rows in (
        ("bases (--basis): weights over depth", bases),
        ("backward modes (--backward)", backward),
    ):
        listing = Table(title=title)
        listing.add_column("name")
        listing.add_column("description")
        for row in rows:
            listing.add_row(row["name"], row["description"])
        console.print(listing)
    return 0


def _stages(integrator: object) -> int | str:
    """Field evaluations per step: a number, or for a splitting per sub-step times its sub-steps."""
    if not isinstance(integrator, Splitting):
        return integrator.evals_per_step  # type: ignore[attr-defined]
    each = resolve_integrator(integrator.substep).evals_per_step
    return f"{each} x {'p' if integrator.pattern == 'sequential' else '(2p - 1)'}"


def _allows(integrator: object, mode: str) -> bool:
    try:
        validate_backward(mode, integrator)  # type: ignore[arg-type]
    except ConfigError:
        return False
    return True


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc else ""
