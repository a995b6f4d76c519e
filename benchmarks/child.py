"""One measurement per fresh process: the parent reruns the script with ``--child``, reads one JSON line.

A fresh process per configuration keeps one configuration's allocator state, caches and resident
memory out of the next one's figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from typing import Any


def run_child(script: str, arguments: list[str], what: str) -> dict[str, Any]:
    """Run ``script --child *arguments`` in a fresh Python and return the JSON of its last stdout line.

    A failed child raises with ``what`` and the end of its stderr.
    """
    command = [sys.executable, script, "--child", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report_to_parent(result: Any) -> None:
    """The child's last word: its result dataclass as one JSON line on stdout."""
    print(json.dumps(asdict(result)))
