"""Names that become code or markup (issue 18, part 4): printed as text, never run or interpreted.

``Tableau.create`` and a file both require Python names (test_tableaus.py, test_hostile_files.py,
test_save_load_symmetry.py); a tableau renamed after its checks (``dataclasses.replace``) can still
hold anything, and these tests use one. Wherever a name is printed as code (the
``#`` comments of ``odeify.model_code``), as rich markup (the tables of ``odeify inspect``) or as
Graphviz text, it stays one piece of text.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

import odeify
from odeify.inspection.dot import converted_to_dot
from odeify.inspection.report import describe, format_report_table
from odeify.models import DEFAULT_MODEL_PATH

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits() -> odeify.ODEStage:
    return odeify.convert(str(DEFAULT_MODEL_PATH))


def _named(digits, name: str):
    tableau = dataclasses.replace(odeify.Tableau.create("mine", [[0]], [1]), name=name)
    return odeify.retarget(digits, integrator=tableau, steps=1, backward="checkpoint")


def test_a_tableau_name_in_the_listing_is_a_comment_not_a_line(digits) -> None:
    name = "mine\nimport os\r\nos.system('x')"
    code = odeify.model_code(_named(digits, name))
    lines = [line.strip() for line in code.splitlines()]
    assert not any(line.startswith(("import os", "os.system")) for line in lines)  # no live line
    assert f"# stage 'layer1' ({name!r}, 1 step, " in code  # the name, as its one-line repr
    assert "# stage 'layer1' (euler" in odeify.model_code(odeify.retarget(digits, backward="checkpoint"))


@pytest.mark.parametrize("name", ["[/x]", "[bold]x", "[link=file:///etc/passwd]x"])
def test_a_tableau_name_in_a_table_is_text_not_markup(digits, name: str) -> None:
    out = io.StringIO()
    Console(file=out, width=200).print(
        format_report_table(describe(_named(digits, name), name=f"{name}.sft"))
    )
    assert f"{name}.sft: ODE stages" in out.getvalue() and f" {name} " in out.getvalue()


def test_a_name_in_graphviz_stays_one_quoted_string(digits) -> None:
    dot = converted_to_dot(_named(digits, 'say "hi"\nthere'), 'm"\r\n.safetensors')
    first = dot.splitlines()[0]
    assert first == 'digraph "m\\"\\n\\n.safetensors" {'
    assert 'say \\"hi\\"\\nthere' in dot and dot.count("{") == dot.count("}")
