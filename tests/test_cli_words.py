"""What the command line says, checked against what it does (issue 39, the confusing cases)."""

from __future__ import annotations

import json

import pytest

from odeify.cli.parser import main
from odeify.ir.settings import BACKWARD_MODES
from odeify.numerics.tableaus import KNOWN_INTEGRATORS, ReversibleScheme, resolve_integrator

pytestmark = pytest.mark.usefixtures("one_thread")


def test_list_shows_every_integrator_and_the_backward_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(row["name"] for row in listed["integrators"]) == sorted(KNOWN_INTEGRATORS)
    assert [row["name"] for row in listed["backward"]] == list(BACKWARD_MODES)
    for row in listed["integrators"]:  # reversible where the scheme inverts exactly, else reverse
        integrator = resolve_integrator(row["name"])
        reversible = isinstance(integrator, ReversibleScheme) or getattr(integrator, "reversible", False)
        expected = ["backprop", "checkpoint", "reversible" if reversible else "reverse"]
        assert row["backward"] == expected, row
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "backward modes (--backward)" in out and all(n in out for n in ("alf", "lie_trotter", "strang"))


def test_every_example_in_the_help_is_one_command_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    from odeify.cli.parser import COMMAND_EXAMPLES

    for command in COMMAND_EXAMPLES:
        assert main([command, "--help"]) == 0
        examples = capsys.readouterr().out.split("examples:\n")[1]
        for line in examples.splitlines():
            said = line.split("  #")[0].strip()  # the command, without its comment
            assert "  " not in said, (command, line)  # a '\' ending a line of the source's string joined two
