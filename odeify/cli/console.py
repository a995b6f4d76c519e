"""The rich console the CLI writes its tables to (shared by the parser and the commands)."""

from __future__ import annotations

from typing import IO

TABLE_WIDTH = 120  # rich's width when the stream is not a terminal (its own default, 80, wraps the tables)


def console_on(stream: IO[str]):
    """A rich console on ``stream``, wide enough for the tables when it is not a terminal."""
    from rich.console import Console  # lazily: ``odeify --help`` stays fast

    console = Console(file=stream, highlight=False)
    if not console.is_terminal:
        console = Console(file=stream, highlight=False, width=TABLE_WIDTH)
    return console
