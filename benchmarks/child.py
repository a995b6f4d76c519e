"""Measurements in fresh processes: the parent reruns the script with ``--child``, reads JSON lines.

A fresh process per configuration keeps one configuration's allocator state, caches and resident
memory out of the next one's figures. :func:`run_child` runs one to its end; :class:`SteppedChild`
keeps one alive and has it take timed steps on request, so that a parent can interleave several
configurations step by step: a change of the machine's speed during a run (other tenants' load)
then moves every configuration's times alike instead of one configuration's ratio to another.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any, TextIO

STEP, DONE = "step", "done"
"""The parent's requests to a :class:`SteppedChild`: one timed step; the end (the child reports)."""


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
    """A child's word to its parent: a dataclass or a dict as one JSON line on stdout."""
    print(json.dumps(result if isinstance(result, dict) else asdict(result)), flush=True)


def requests() -> Iterator[str]:
    """In a stepped child: the parent's requests, one per line, until :data:`DONE`."""
    for line in sys.stdin:
        request = line.strip()
        if request == DONE:
            return
        yield request


class SteppedChild:
    """``script --child *arguments`` kept alive: it reports once ready (a line), then takes a timed step
    per :meth:`step` (reading :func:`requests`, answering a line each) and reports its result on
    :meth:`finish`.

    stderr goes to a temporary file (a pipe nobody reads could fill and block the child); a child
    that ends early raises with ``what`` and the end of it.
    """

    def __init__(self, script: str, arguments: list[str], what: str) -> None:
        self.what = what
        self._stderr = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, script, "--child", *arguments]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True
        )
        self._read()  # built, warmed up, measured: ready to step

    def step(self) -> dict[str, Any]:
        """One timed step; the child's report of it."""
        return self._ask(STEP)

    def finish(self) -> dict[str, Any]:
        """The child's result (its after-timing checks run now); the process ends."""
        result = self._ask(DONE)
        self._process.wait()
        self._stderr.close()
        return result

    def kill(self) -> None:
        """End the child without its result (another child failed, or the parent is stopping)."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._stderr.close()

    def _ask(self, request: str) -> dict[str, Any]:
        stdin: TextIO = self._process.stdin  # type: ignore[assignment]
        try:
            stdin.write(request + "\n")
            stdin.flush()
        except BrokenPipeError:
            self._fail()
        return self._read()

    def _read(self) -> dict[str, Any]:
        """The child's next report (a line that is a JSON object; anything else it prints is skipped)."""
        while True:
            line = self._process.stdout.readline()  # type: ignore[union-attr]
            if not line:
                self._fail()
            if line.startswith("{"):
                return json.loads(line)

    def _fail(self) -> None:
        self._process.wait()
        self._stderr.seek(0)
        tail = self._stderr.read()[-4000:]
        self._stderr.close()
        raise RuntimeError(f"{self.what} failed:\n{tail}")
