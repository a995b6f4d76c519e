"""``pip install .`` puts odeify, and odeify.passes inside it, into site-packages: no top-level ``passes``.

The repository keeps the graph passes in a top-level ``passes/`` folder (the product's layout); a
setuptools package-dir mapping installs it as ``odeify.passes``, so it cannot collide with another
project's top-level ``passes`` package. This test installs a real (non-editable) copy into an empty
target folder and imports it from there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_install_exposes_only_the_odeify_package(tmp_path: Path) -> None:
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    top_level = {p.name for p in target.iterdir() if not p.name.endswith((".dist-info", ".egg-info"))}
    assert "passes" not in top_level
    assert "odeify" in top_level and (target / "odeify" / "passes" / "lift.py").is_file()
    check = (
        "import odeify, odeify.passes.lift, odeify.compiler.conversion; "
        "print(odeify.__file__); print(odeify.passes.lift.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    ran = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert all(line.startswith(str(target)) for line in ran.stdout.split()), ran.stdout
