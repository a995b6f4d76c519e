"""The modules form a straight line of layers: each imports only from its own layer or below.

The layers, lowest first, are listed in ``LAYERS`` (docs/architecture.md explains them). Every
module of the package must be in exactly one layer, so a new module has to be placed before this
test passes. Imports are read from the source (top-level, inside functions, and under
TYPE_CHECKING alike), and within a layer the import graph must be acyclic. A second check imports
each layer in a fresh process where every module above it is blocked, as a user of that layer alone
would.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

import odeify
import odeify.passes

LAYERS: list[tuple[str, set[str]]] = [
    (
        "foundation",
        {"errors", "dtypes", "settings", "fileio", "budget", "stats", "meta", "plan", "bases", "tableaus"},
    ),
    ("ir", {"ir"}),
    ("codegen", {"emit"}),
    ("runtime", {"rerun", "rng_tape", "adjoint", "reversible", "stage"}),
    ("passes", {"passes", "tracing"}),  # the frontend (fx tracing) and every module of odeify.passes
    (
        "api",
        {
            "archs",
            "checkpoints",
            "loading",
            "digits",
            "timm_interface",
            "_testing",
            "datasets",
            "recipe",
            "analysis",
            "conversion",
            "io",
            "listing",
            "report",
            "dot",
        },
    ),  # fmt: skip
    (
        "apps",
        {"console", "evaluate", "sweep", "plots", "finetune", "demo", "commands", "cli"}
        | {"__main__", "__init__"},
    ),
]


def _package_modules() -> dict[str, Path]:
    """Every module of odeify and odeify.passes, by short name ('stage', 'passes.lift')."""
    found = {}
    for folder, prefix in (
        (Path(odeify.__file__).parent, ""),
        (Path(odeify.passes.__file__).parent, "passes."),
    ):
        for path in folder.glob("*.py"):
            found[prefix + path.stem] = path
    return found


def _layer_of(module: str) -> int:
    key = "passes" if module.startswith("passes") else module
    homes = [i for i, (_, names) in enumerate(LAYERS) if key in names]
    assert len(homes) == 1, f"odeify module '{module}' must be in exactly one layer of LAYERS (in {homes})"
    return homes[0]


def _imports(path: Path) -> set[str]:
    """The odeify modules ``path`` imports, as short names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] != "odeify" or len(parts) < 2:
                continue
            short = ".".join(parts[1:3]) if parts[1] == "passes" and len(parts) > 2 else parts[1]
            names.add(short)
    return names


MODULES = _package_modules()


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    own = _layer_of(module)
    upward = {
        name: LAYERS[_layer_of(name)][0]
        for name in _imports(MODULES[module])
        if name in MODULES and _layer_of(name) > own
    }
    assert not upward, f"odeify.{module} ({LAYERS[own][0]}) imports from layers above it: {upward}"


def test_no_import_cycles() -> None:
    graph = nx.DiGraph()
    for module, path in MODULES.items():
        graph.add_node(module)
        graph.add_edges_from((module, name) for name in _imports(path) if name in MODULES and name != module)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles among odeify modules: {cycles}"


BLOCKER = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in blocked:
            raise ImportError(f"{name} belongs to a higher layer")
        return None
sys.meta_path.insert(0, Block())
import importlib
for name in sys.argv[2].split(","):
    importlib.import_module(name)
"""


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS[:5]])
def test_each_layer_imports_without_the_layers_above(layer: str) -> None:
    index = next(i for i, (name, _) in enumerate(LAYERS) if name == layer)

    def dotted(module: str) -> str:
        return f"odeify.{module}" if module != "__init__" else "odeify"

    below = [dotted(m) for m in MODULES if _layer_of(m) <= index]
    above = [dotted(m) for m in MODULES if _layer_of(m) > index and m != "__init__"]
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, ",".join(above), ",".join(below)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
