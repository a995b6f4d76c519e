"""The folders are layers in a straight line: a module imports only from its own folder or below.

``LAYERS`` lists the folders of the package, lowest first (docs/architecture.md explains each);
``odeify.passes`` is the folder ``passes/`` at the top of the repository. A module's layer is its
folder, so every module has exactly one, and a new folder must be placed here before this test
passes. Imports are read from the source (top-level, inside functions and under TYPE_CHECKING
alike), and the import graph must be acyclic. A second check imports the lower layers in a fresh process,
lowest first, each while every module above it is blocked, as a user of that layer alone would.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

import odeify
import odeify.passes

LAYERS = [
    "core",  # errors, atomic writes, budgets, the model-dtype rule
    "numerics",  # bases (weight paths) and Butcher tableaus, exact
    "ir",  # settings, the analysis plan, the node-meta schema, the stage IR
    "codegen",  # fx graphs of a stage's computation
    "runtime",  # ODEStage and the backward modes
    "passes",  # tracing and every graph pass (passes/ at the repository's top)
    "models",  # names, checkpoint files, the digits model, timm's interface
    "compiler",  # the pipelines and their runner, the conversion record
    "serialization",  # the recipe, save and load
    "inspection",  # tables, listings, Graphviz, plots
    "train",  # datasets, evaluation, sweeps, fine-tuning
    "cli",  # the odeify command
]
TOP = {"__init__", "__main__"}  # the public surface and `python -m odeify`: above every folder


def _package_modules() -> dict[str, Path]:
    """Every module of odeify by dotted name below odeify: 'runtime.stage', 'passes.lift', '__init__'."""
    root = Path(odeify.__file__).parent
    found = {path.stem: path for path in root.glob("*.py")}
    for path in root.glob("*/*.py"):
        found[f"{path.parent.name}.{path.stem}"] = path
    for path in Path(odeify.passes.__file__).parent.glob("*.py"):
        found[f"passes.{path.stem}"] = path
    return found


def _layer_of(module: str) -> int:
    if module in TOP:
        return len(LAYERS)
    folder = module.split(".")[0]
    assert folder in LAYERS and "." in module, f"odeify.{module} is in no layer folder of LAYERS"
    return LAYERS.index(folder)


def _layer_name(index: int) -> str:
    return LAYERS[index] if index < len(LAYERS) else "top"


def _imports(path: Path) -> set[str]:
    """The odeify modules ``path`` imports, as dotted names below odeify.

    ``from odeify.cli import commands`` imports the module ``cli.commands``; a name that is not a
    module (``from odeify.models import DEFAULT_MODEL_PATH``) comes from the folder's ``__init__``.
    The package root (``odeify/__init__.py``: lazy, it imports no module until a name is used) is
    imported by Python before any module of it, so reading ``odeify.__version__`` is no upward edge.
    """
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] != "odeify" or len(parts) < 2:
                continue
            if parts[1].startswith("__"):
                continue  # `from odeify import __version__`: the package root, imported before any module
            if len(parts) == 2 or f"{parts[1]}.{parts[2]}" not in MODULES:
                names.add(f"{parts[1]}.__init__")
            else:
                names.add(f"{parts[1]}.{parts[2]}")
    return names


MODULES = _package_modules()
MODULES.update({f"{f}.__init__": Path(odeify.__file__).parent / f / "__init__.py" for f in LAYERS})
MODULES["passes.__init__"] = Path(odeify.passes.__file__)


def test_every_folder_is_a_layer_and_every_module_in_one() -> None:
    root = Path(odeify.__file__).parent
    folders = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders | {"passes"} == set(LAYERS), "a package folder is not in LAYERS, or a layer has no folder"
    assert {m for m in MODULES if "." not in m} == TOP, "odeify/ holds only __init__ and __main__"
    for module in MODULES:
        _layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    own = _layer_of(module)
    upward = {
        name: _layer_name(_layer_of(name))
        for name in _imports(MODULES[module])
        if name in MODULES and _layer_of(name) > own
    }
    assert not upward, f"odeify.{module} ({_layer_name(own)}) imports from layers above it: {upward}"


def test_no_import_cycles() -> None:
    graph = nx.DiGraph()
    for module, path in MODULES.items():
        graph.add_node(module)
        graph.add_edges_from((module, name) for name in _imports(path) if name in MODULES and name != module)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles among odeify modules: {cycles}"


LAYERED_IMPORT = """
import importlib, importlib.abc, json, sys
blocked = set()
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in blocked:
            raise ImportError(f"{name} belongs to a higher layer")
        return None
sys.meta_path.insert(0, Block())
for layer, modules, above in json.loads(sys.argv[1]):
    blocked.clear()
    blocked.update(above)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:
            sys.exit(f"layer {layer}: import {name} failed with the layers above it blocked: {error}")
"""
"""Imports the layers lowest first in one process, each while every module above it is blocked.

As a fresh process per layer would: the layers below were imported, each under its own stricter
block, before this one's modules are, so an upward import at import time fails in its own layer."""


def _dotted(module: str) -> str:
    if module in TOP:
        return "odeify" if module == "__init__" else "odeify.__main__"
    return "odeify." + module.removesuffix(".__init__")


def test_each_layer_imports_without_the_layers_above() -> None:
    phases = [
        (
            layer,
            [_dotted(m) for m in MODULES if _layer_of(m) == index],
            [_dotted(m) for m in MODULES if _layer_of(m) > index and m not in TOP],
        )
        for index, layer in enumerate(LAYERS[:8])
    ]
    done = subprocess.run(
        [sys.executable, "-c", LAYERED_IMPORT, json.dumps(phases)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
